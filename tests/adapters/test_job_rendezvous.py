"""A job's rendezvous and its ranks' traffic belong to the job (real accounts, real torchrun).

PyTorch's c10d ``TCPStore`` has no authorization and accepts connections from anywhere
(pytorch/pytorch SECURITY.md, "Using distributed features"), and gloo's pairs connect by plain
TCP. So on a machine shared by several unix accounts, anything a job listens on must be out of
every other account's reach. Two real accounts here: the victim's job runs 2 gloo ranks; the
attacker, a different account, tries what the issue reproduced: (a) find the job's sockets and
connect to its store while it runs, (b) listen first on the port the job will use and wait for
the job to join. Both must fail, and the job must still run to the end.

Run as an ordinary user these skip (switching accounts needs root).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from traitlets.config import Config

from gpupool.core.jobs import Job, JobSpec
from gpupool.declarations import ConfigError
from gpupool.jobs import local, private_network
from gpupool.jobs.local import LocalJobBackend
from tests.accounts import (
    IS_ROOT,
    NOT_ROOT,
    RUNTIME_PYTHON,
    as_account,
    remove_unix_user,
    runtime,
    shared_account,
    unix_user,
)

needs_root = pytest.mark.skipif(not IS_ROOT, reason=NOT_ROOT)
VICTIM, ATTACKER = "gpupool-victim", "gpupool-eve"

# Two gloo ranks that hold their connections open until the test says "go" (a file the test
# makes in the job's folder), so the attacker acts while every socket of the job is live.
SCRIPT = """\
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print("ready", flush=True)
go = os.path.join(os.environ["GPUPOOL_JOB_DIR"], "go")
while not os.path.exists(go):
    time.sleep(0.05)
dist.barrier()
print("sum", int(t.item()), flush=True)
"""

# The attacker, as another account: every TCP socket in LISTEN state that the victim's account
# owns, as /proc/net/tcp{,6} shows them to anyone, and whether a connection to each succeeds
# (a TCPStore client that connects can write keys: the store checks nothing).
PROBE = """\
import socket, sys
uid = int(sys.argv[1])
found = []
for name, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
    for line in open(name).read().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and int(f[7]) == uid:  # 0A: LISTEN
            found.append((family, int(f[1].split(":")[1], 16)))
reached = []
for family, port in found:
    s = socket.socket(family)
    s.settimeout(5)
    try:
        s.connect(("127.0.0.1" if family == socket.AF_INET else "::1", port))
        reached.append(port)
    except OSError:
        pass
    finally:
        s.close()
print(len(found), len(reached))
"""


@pytest.fixture(scope="module")
def accounts() -> Iterator[None]:
    unix_user(VICTIM)
    unix_user(ATTACKER)
    yield
    remove_unix_user(VICTIM)
    remove_unix_user(ATTACKER)


@pytest.fixture
def evil() -> Iterator[Path]:
    """A folder every account may write to (pytest's own temporary folders are root's only)."""
    path = Path(tempfile.mkdtemp(prefix="gpupool-evil-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path)


def backend() -> LocalJobBackend:
    c = Config()
    c.LocalJobBackend.run_as_hub_user = False  # the per-user mode: one unix account per user
    c.LocalJobBackend.kill_grace = 1.0
    runtime(c)
    return LocalJobBackend(config=c)


async def started(b: LocalJobBackend, script: str) -> Job:
    j = Job(os.urandom(6).hex(), VICTIM, "t", JobSpec(script=script, gpus=2))
    handle = await b.start(j, [])
    return Job(j.id, j.owner, j.team, j.spec, handle=handle)


async def wait_for(b: LocalJobBackend, j: Job, text: bytes, timeout: float = 120) -> None:
    """Until every rank's log says ``text`` (watched as the manager watches a job)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        logs = [(await b.read_log(j, r, 0))[0] for r in range(j.spec.ranks)]
        if all(text in log for log in logs):
            return
        seen = await b.check(j)
        launcher = (b.job_dir(j) / "launcher.log").read_text(errors="replace")[-2000:]
        assert not seen.ended, f"job ended before saying {text!r}: {seen}, {logs}, {launcher}"
        await b.wait(j, 0.2)
    raise AssertionError(f"job {j.id} did not say {text!r} in {timeout}s")


async def ended(b: LocalJobBackend, j: Job, timeout: float = 120) -> str:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        seen = await b.check(j)
        if seen.ended:
            return seen.state
        await b.wait(j, 0.5)
    raise AssertionError(f"job {j.id} did not end in {timeout}s")


def go(b: LocalJobBackend, j: Job) -> None:
    (b.job_dir(j) / "go").touch()


@needs_root
def test_another_account_can_neither_see_nor_reach_a_running_jobs_sockets(accounts: None) -> None:
    b = backend()

    async def scenario() -> tuple[str, str]:
        j = await started(b, SCRIPT)
        await wait_for(b, j, b"ready")  # the store and the gloo pairs are all up
        probe = await asyncio.to_thread(
            subprocess.run,
            [RUNTIME_PYTHON, "-c", PROBE, str(unix_user(VICTIM).pw_uid)],
            capture_output=True, text=True, timeout=60, cwd="/", **as_account(ATTACKER),
        )  # fmt: skip
        go(b, j)
        return probe.stdout.strip() or probe.stderr, await ended(b, j)

    seen, state = asyncio.run(scenario())
    assert state == "succeeded"
    assert seen == "0 0", f"the attacker saw/reached the job's sockets (listening, reached): {seen}"


@needs_root
def test_a_job_never_joins_a_store_another_account_listens_on_first(
    accounts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attacker holds the port before the job starts; the hub picks that very port (the
    race the issue reproduced, made certain by handing the hub the attacker's port)."""
    attacker = subprocess.Popen(
        [RUNTIME_PYTHON, "-c", LISTENER], stdout=subprocess.PIPE, stdin=subprocess.PIPE,
        text=True, cwd="/", **as_account(ATTACKER),
    )  # fmt: skip
    assert attacker.stdout is not None and attacker.stdin is not None
    port = int(attacker.stdout.readline())
    monkeypatch.setattr(local, "free_port", lambda: port, raising=False)
    b = backend()

    async def scenario() -> str:
        j = await started(b, SCRIPT)
        await wait_for(b, j, b"ready")
        go(b, j)
        return await ended(b, j)

    try:
        state = asyncio.run(scenario())
    finally:
        attacker.stdin.close()  # tells the listener to report and stop
        accepted = attacker.stdout.read().strip()
        attacker.wait(timeout=30)
    assert state == "succeeded"
    assert accepted == "0", f"the job connected to the attacker's listener {accepted} times"


# The attacker's listener: binds a port on loopback, says which, counts the connections it
# accepts until its stdin closes, then prints the count.
LISTENER = """\
import select, socket, sys
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(64)
print(s.getsockname()[1], flush=True)
accepted = 0
while True:
    ready, _, _ = select.select([s, sys.stdin], [], [])
    if s in ready:
        s.accept()[0].close()
        accepted += 1
    if sys.stdin in ready and not sys.stdin.read(1):
        break
print(accepted, flush=True)
"""


@needs_root
def test_other_accounts_reach_nothing_even_on_the_default_port(accounts: None) -> None:
    """torchrun's and gloo's well-known ports, held by another account, change nothing."""
    holders = []
    for port in (29400, 29500):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        s.listen(8)
        holders.append(s)
    try:
        b = backend()

        async def scenario() -> str:
            j = await started(b, SCRIPT)
            await wait_for(b, j, b"ready")
            go(b, j)
            return await ended(b, j)

        assert asyncio.run(scenario()) == "succeeded"
        for s in holders:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.accept()  # nobody of the job came here
    finally:
        for s in holders:
            s.close()


@needs_root
def test_the_root_launcher_takes_nothing_from_the_job_and_leaves_it_nothing_of_roots(
    accounts: None, evil: Path
) -> None:
    """The private network is made by a root process: the job's own variables (a
    ``PYTHONPATH`` with a ``sitecustomize`` that records who runs it) must not run as root,
    and the job ends up with exactly its account's groups, no capability, in a namespace of its
    own."""
    seen = evil / "who"
    (evil / "sitecustomize.py").write_text(
        f"import os\nwith open({str(seen)!r}, 'a') as f: f.write(f'{{os.getuid()}}\\n')\n"
    )
    (evil / "sitecustomize.py").chmod(0o644)
    script = (
        "import json, os\n"
        "caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')]\n"
        "print(json.dumps([os.getgroups(), caps[0], os.readlink('/proc/self/ns/net'),"
        " os.nice(0)]))\n"
    )
    b = backend()
    spec = JobSpec(script=script, gpus=1, env=(("PYTHONPATH", str(evil)),))

    async def scenario() -> tuple[Job, str]:
        j = Job(os.urandom(6).hex(), VICTIM, "t", spec)
        j = Job(j.id, j.owner, j.team, j.spec, handle=await b.start(j, []))
        return j, await ended(b, j)

    done, state = asyncio.run(scenario())
    assert state == "succeeded"
    groups, caps, netns, niceness = json.loads(
        asyncio.run(b.read_log(done, 0, 0))[0].splitlines()[-1]
    )
    victim = unix_user(VICTIM)
    assert sorted(groups) == sorted(os.getgrouplist(VICTIM, victim.pw_gid))
    assert int(caps, 16) == 0
    assert niceness == 10  # below the hub (LocalGPUSpawner.niceness), so the hub stays responsive
    assert netns != os.readlink("/proc/self/ns/net")  # not the hub's (the machine's) network
    uids = {int(u) for u in seen.read_text().split()}
    assert uids == {victim.pw_uid}, f"the job's sitecustomize ran as {uids}"


def cannot(monkeypatch: pytest.MonkeyPatch) -> str:
    """This machine as one where a private network is not possible (as an ordinary user it is
    not: a network namespace needs root); the reason the hub gives."""
    why = private_network.unavailable() or "the kernel refused a network namespace (test)"
    monkeypatch.setattr(private_network, "unavailable", lambda: why)
    return why


def host_backend(**settings: str) -> LocalJobBackend:
    c = Config()
    c.LocalJobBackend.run_as_hub_user = True
    c.LocalJobBackend.shared_account = shared_account() if IS_ROOT else ""
    for key, value in settings.items():
        c.LocalJobBackend[key] = value
    return LocalJobBackend(config=c)


def test_where_no_private_network_is_possible_the_hub_says_so_at_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    why = cannot(monkeypatch)
    b = host_backend()
    assert not b.private_network
    assert b.network_note == f"shared, because a private network is not possible here: {why}"
    assert any("any account on this machine can reach" in r.message for r in caplog.records)


def test_asking_for_a_private_network_where_none_is_possible_stops_the_hub(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    why = cannot(monkeypatch)
    with pytest.raises(ConfigError, match=r"^LocalJobBackend\.job_network: private is not"):
        host_backend(job_network="private")
    assert why


def test_the_host_network_is_an_admins_choice_and_says_what_it_costs() -> None:
    b = host_backend(job_network="host")
    assert not b.private_network and "any account on this machine can reach" in b.network_note
