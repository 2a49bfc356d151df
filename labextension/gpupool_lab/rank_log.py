"""Per-rank launcher: ``python -m gpupool_lab.rank_log LOG_DIR SCRIPT [ARGS...]``.

torchrun runs this module once per rank (``torchrun … -m gpupool_lab.rank_log LOG_DIR SCRIPT``).
It points this process's file descriptors 1 and 2 (``os.dup2``) at ``LOG_DIR/rank-<RANK>.log``
(``RANK`` from torchrun's environment, 0 when unset), opened for appending so a restarted rank
adds to its log, with a marker line per start; Python's ``sys.stdout``/``sys.stderr`` become
line-buffered, and child processes inherit the redirection. Then it runs SCRIPT as ``__main__``
(``runpy.run_path``) with ``sys.argv = [SCRIPT, *ARGS]`` and SCRIPT's folder first on
``sys.path``, as ``python SCRIPT ARGS`` would.

A rank of a job on several MIG instances gets its own one: ``GPUPOOL_RANK_DEVICES`` lists the
instances' UUIDs in local-rank order (or names the variable that lists them, in a pod
``NVIDIA_VISIBLE_DEVICES``, which the NVIDIA device plugin sets), and this launcher sets
``CUDA_VISIBLE_DEVICES`` to the one of ``LOCAL_RANK`` (and ``GPUPOOL_RANK_DEVICE``, so that
``gpupool_lab.ddp`` uses CUDA device 0) before the script runs, saying so in the rank's log; a
list it cannot read (no UUIDs, too few) leaves ``CUDA_VISIBLE_DEVICES`` as it is, saying why.

Exit status: the script's own (``sys.exit(n)`` → n, normal end → 0); an uncaught exception prints
its traceback into the rank's log and exits 1. The status is also written to
``LOG_DIR/rank-<RANK>.exit`` (replaced atomically), where the hub's local job backend reads
per-rank exit codes; a rank killed by a signal leaves none. Usage errors exit 2 (on the original
stderr).

Ending: once the script is done, the launcher ends as Python would (it waits for non-daemon
threads, runs ``atexit`` handlers, flushes) and then leaves with ``os._exit(status)``, skipping
the interpreter's final teardown. libtorch's C++ teardown at that point can abort a rank that
has finished cleanly (seen with gloo, torch 2.13: ``terminate called without an active
exception``, SIGABRT, in about 1 of 10 two-rank runs), which would turn a succeeded job into a
failed one.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import runpy
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path

from gpupool_lab import share_cap

USAGE = "usage: python -m gpupool_lab.rank_log LOG_DIR SCRIPT [ARGS...]"
RANK_DEVICES = "GPUPOOL_RANK_DEVICES"
RANK_DEVICE = "GPUPOOL_RANK_DEVICE"
_UUIDS = ("MIG-", "GPU-")


def rank_device(environ: Mapping[str, str]) -> tuple[str | None, str]:
    """This rank's own device from ``GPUPOOL_RANK_DEVICES`` (``None``: none) and a line saying
    what was chosen, or why nothing was (empty when the variable is not set)."""
    listed = environ.get(RANK_DEVICES, "").strip()
    if not listed:
        return None, ""
    where = RANK_DEVICES
    if not listed.startswith(_UUIDS):  # the name of the variable that lists them
        where, listed = listed, environ.get(listed, "")
    devices = [d.strip() for d in listed.split(",") if d.strip()]
    local = environ.get("LOCAL_RANK", "0").strip() or "0"
    n = int(local) if local.isdigit() else -1
    if not 0 <= n < len(devices) or not all(d.startswith(_UUIDS) for d in devices):
        return None, (
            f"gpupool: local rank {local} has no device of its own in {where}={listed[:200]!r}; "
            "CUDA_VISIBLE_DEVICES is left as it is (a process sees only the first MIG instance)"
        )
    return devices[n], f"gpupool: local rank {n} runs on {devices[n]} (CUDA_VISIBLE_DEVICES)"


def log_path(log_dir: str | Path, rank: int | str) -> Path:
    """Where rank ``rank`` writes: ``LOG_DIR/rank-<rank>.log``."""
    return Path(log_dir) / f"rank-{rank}.log"


def exit_path(log_dir: str | Path, rank: int | str) -> Path:
    """Where rank ``rank``'s exit status goes: ``LOG_DIR/rank-<rank>.exit``."""
    return Path(log_dir) / f"rank-{rank}.exit"


def write_exit_status(path: Path, status: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{status}\n", encoding="ascii")
    os.replace(tmp, path)


def redirect_output(path: Path) -> None:
    """Send fds 1 and 2 (and so ``print``, tracebacks and subprocesses) to ``path``, appending."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)


def run_script(script: str, args: list[str]) -> int:
    """Run ``script`` as ``__main__`` and return its exit status."""
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    share_cap.install()  # a rank on a GPU share: PyTorch kept to the share (no-op otherwise)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        return _exit_status(exc)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _exit_status(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(USAGE, file=sys.stderr)
        return 2
    log_dir, script, script_args = args[0], args[1], args[2:]
    rank = os.environ.get("RANK", "0")
    redirect_output(log_path(log_dir, rank))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print(f"==== gpupool: rank {rank} starting {script} (restart {restart}) at {stamp} ====")
    device, said = rank_device(os.environ)
    if device:  # before the script imports torch: CUDA reads it once
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ[RANK_DEVICE] = device
    if said:
        print(said)
    status = run_script(script, script_args)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    try:
        write_exit_status(exit_path(log_dir, rank), status)
    except OSError as exc:
        print(f"gpupool: could not record the exit status: {exc}", file=sys.stderr)
    return status


def finish(status: int) -> None:
    """End the process as Python's own exit does, without the interpreter's final teardown."""
    main_thread = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main_thread and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    os._exit(status)


if __name__ == "__main__":
    finish(main())
