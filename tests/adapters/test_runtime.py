"""As root, user code runs as unprivileged accounts from the *runtime* (:mod:`tests.accounts`):
every account can reach it wherever the checkout lies, and a child started as an account has
that account's groups and none of root's (:func:`gpupool.usercode.become`)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from gpupool.usercode import account, become
from tests.accounts import IS_ROOT, NOT_ROOT, ROOT, RUNTIME, RUNTIME_PYTHON, shared_account
from tests.preflight import runtime_is_current

as_root = pytest.mark.skipif(not IS_ROOT, reason=NOT_ROOT)


@as_root
def test_a_child_started_as_an_account_has_its_groups_and_none_of_roots() -> None:
    code_account = account(shared_account(), "the tests' account")
    probe = "import os; print(os.getuid(), os.getgid(), *sorted(os.getgroups()))"
    out = subprocess.run(
        [RUNTIME_PYTHON, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
        **become(code_account),
    )
    uid, gid, *groups = map(int, out.stdout.split())
    assert (uid, gid) == (code_account.uid, code_account.gid)
    assert 0 not in groups
    assert set(groups) == set(code_account.groups)


@as_root
def test_the_runtime_lies_outside_the_checkout_and_every_account_can_read_it() -> None:
    """The checkout may lie in a folder other accounts cannot enter (a clone under /root, a
    0700 temporary folder): the runtime must not depend on it, nor on root's umask."""
    assert not RUNTIME.resolve().is_relative_to(ROOT)
    for folder in RUNTIME.resolve().parents:
        assert folder.stat().st_mode & stat.S_IXOTH, f"others cannot enter {folder}"
    unreadable = []
    for folder, dirs, files in os.walk(RUNTIME):
        for name in dirs + files:
            path = Path(folder, name)
            mode = path.lstat().st_mode
            need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
            if not stat.S_ISLNK(mode) and mode & need != need:
                unreadable.append(str(path))
    assert not unreadable[:10], f"{len(unreadable)} paths other accounts cannot read"


@as_root
def test_an_account_that_cannot_run_the_python_stops_make_once_saying_what_to_do() -> None:
    """What ``make run`` and the tests' preflight run: one message, not a failure per test."""
    private = Path(tempfile.mkdtemp(prefix="gpupool-private-"))  # 0700, root's
    try:
        (private / "python").symlink_to(RUNTIME_PYTHON)
        done = subprocess.run(
            [str(ROOT / "scripts" / "demo-account"), shared_account(), str(private / "python")],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        shutil.rmtree(private)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert lines[0] == (
        f"gpupool: the account {shared_account()} cannot run {private}/python with gpupool, "
        "gpupool_lab and"
    )
    assert "Permission denied" in lines[1]
    assert "make builds it outside the checkout" in done.stderr


def test_the_preflight_finds_a_runtime_older_than_the_sources(tmp_path: Path) -> None:
    runtime, root = tmp_path / "runtime", tmp_path / "checkout"
    source = root / "hub" / "gpupool" / "pool.py"
    source.parent.mkdir(parents=True)
    source.write_text("")
    assert "is not built: run make install" in str(runtime_is_current(runtime, root))
    runtime.mkdir()
    (runtime / ".installed").touch()
    os.utime(source, (0, 0))
    assert runtime_is_current(runtime, root) is None
    source.touch()
    assert runtime_is_current(runtime, root) == (
        f"the runtime {runtime} (where user code runs from) is older than hub/gpupool/pool.py: "
        "run make install (it rebuilds the runtime)"
    )
