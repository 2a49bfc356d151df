"""``gpupool.procfs`` on real processes: a child of the test, alive, a zombie and reaped."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from gpupool import procfs


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A Python child that waits on its stdin, with one item of its own in its environment."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()", "an argument"],
        stdin=subprocess.PIPE,
        env={**os.environ, "GPUPOOL_PROCFS_TEST": "a=b"},
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_a_live_child_is_listed_with_its_environment_and_command_line(
    child: subprocess.Popen[bytes],
) -> None:
    assert child.pid in procfs.pids()
    assert os.getpid() in procfs.pids()
    items = procfs.environ_items(child.pid)
    assert items is not None and b"GPUPOOL_PROCFS_TEST=a=b" in items
    assert procfs.parse_environ(items)["GPUPOOL_PROCFS_TEST"] == "a=b"
    assert (
        procfs.cmdline(child.pid) == f"{sys.executable} -c import sys; sys.stdin.read() an argument"
    )


def test_a_zombie_has_no_command_line_and_a_reaped_child_nothing(
    child: subprocess.Popen[bytes],
) -> None:
    assert child.stdin is not None
    child.stdin.close()  # the child reads to the end and exits
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert procfs.process_start(child.pid) is None
    assert procfs.cmdline(child.pid) == ""
    child.wait()
    assert child.pid not in procfs.pids()
    assert procfs.environ_items(child.pid) is None
    assert procfs.cmdline(child.pid) == ""
