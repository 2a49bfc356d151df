"""A private network for each local job: its own network namespace with only a loopback.

Why: torchrun's c10d rendezvous (a ``TCPStore``) and gloo's pairs are plain TCP with no
authorization (pytorch/pytorch SECURITY.md); on loopback shared by every account of the machine,
another account could connect to a job's store and write keys, or listen first on its port and
have the job join it. In a network namespace of its own, a job's sockets exist only there: other
accounts can neither see them (``/proc/net/tcp`` is per namespace) nor connect, and nothing they
listen on is reachable from inside. The price: a job has no network beyond its own loopback (no
internet, no hub); its data comes from disk.

Vocabulary
- *launcher*: ``python -I -m gpupool.jobs.private_network UID GID GROUPS -- CMD...``, started
  by the hub (root) with an empty environment. It makes a new network namespace
  (``unshare(CLONE_NEWNET)``), brings its loopback up, becomes the code account (exactly its
  groups, then its gid, then its uid: no capability survives, see capabilities(7)) and execs
  ``CMD`` in place, so the job keeps the launcher's pid and session.
- *header*: the job's environment reaches the launcher on stdin as ``<length>\\n<JSON object>``,
  never through the launcher's own environment, because a root process must not start with
  user-chosen variables (``LD_PRELOAD``, ``PYTHON*``); the launcher reads exactly the header and
  leaves the rest of stdin (the job's script) to ``CMD``.

Contract: the launcher imports only the standard library and never runs anything as root but
itself; any failure is one line on stderr and exit status 111 (the job's set-up error, which the
hub reports). :func:`unavailable` tells, once per hub, why the mechanism cannot work here (not
root, or the kernel refuses), without touching the hub's own namespace.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import json
import os
import socket
import struct
import subprocess
import sys

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
SETUP_FAILED = 111
"""The launcher's exit status when it could not set the job up (as the job's first process)."""
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
"""A private network has one interface: gloo and NCCL must not look for another (gloo would
otherwise take the address the host name resolves to, which does not exist in the namespace)."""


def launcher(uid: int, gid: int, groups: tuple[int, ...]) -> list[str]:
    """The argv that starts a command in a private network as ``uid``/``gid``/``groups``;
    append ``--`` and the command."""
    return [
        sys.executable, "-I", "-m", __name__,
        str(uid), str(gid), ",".join(str(g) for g in groups),
    ]  # fmt: skip


def header(env: dict[str, str]) -> bytes:
    """What the hub writes to the launcher's stdin before the job's own input."""
    body = json.dumps(env).encode()
    return b"%d\n" % len(body) + body


def enter_private_network() -> None:
    """Move this process into a new network namespace and bring its loopback up."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh22x", b"lo", 0)  # struct ifreq: name, flags, padding
        flags = struct.unpack("16sh22x", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | IFF_UP))


def become(uid: int, gid: int, groups: tuple[int, ...]) -> None:
    """Drop root for good: supplementary groups, then gid, then uid (real, effective, saved)."""
    os.setgroups(list(groups))
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise OSError(f"could not become uid {uid} gid {gid}")


def _read_header(fd: int) -> dict[str, str]:
    size = b""
    while not size.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte or len(size) > 12:
            raise ValueError("no environment header on stdin")
        size += byte
    body, want = b"", int(size)
    while len(body) < want:
        chunk = os.read(fd, want - len(body))
        if not chunk:
            raise ValueError("the environment header was cut short")
        body += chunk
    env = json.loads(body)
    if not isinstance(env, dict):
        raise ValueError("the environment header is not an object")
    return {str(k): str(v) for k, v in env.items()}


def main(argv: list[str]) -> int:
    if argv == ["--probe"]:  # can this machine do it? (run by unavailable(), as the hub)
        try:
            enter_private_network()
            with socket.create_server(("127.0.0.1", 0)) as server:
                socket.create_connection(server.getsockname(), timeout=5).close()
        except OSError as e:
            print(e.strerror or e, file=sys.stderr)
            return SETUP_FAILED
        return 0
    try:
        uid, gid, groups, dashes, *command = argv
        if dashes != "--" or not command:
            raise ValueError("usage: UID GID GROUPS -- COMMAND...")
        env = _read_header(0)
        enter_private_network()
        become(int(uid), int(gid), tuple(int(g) for g in groups.split(",") if g))
        os.execve(command[0], command, env)
    except (OSError, ValueError) as e:
        print(f"the job's private network could not be set up: {e}", file=sys.stderr)
    return SETUP_FAILED


@functools.cache
def unavailable() -> str:
    """Why jobs cannot get a private network on this machine, or ``""`` if they can (probed
    once, in a child process)."""
    if os.geteuid() != 0:
        return "the hub does not run as root (a network namespace needs root)"
    probe = subprocess.run(
        [sys.executable, "-I", "-m", __name__, "--probe"],
        env={}, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    if probe.returncode == 0:
        return ""
    return f"the kernel refused a network namespace ({probe.stderr.strip() or probe.returncode})"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
