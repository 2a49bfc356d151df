"""As root, user code runs as unprivileged accounts from the *runtime* (:mod:`tests.accounts`):
every account can reach it wherever the checkout lies, and a child started as an account has
that account's groups and none of root's (:func:`gpupool.usercode.become`)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from gpupool.usercode import account, become
from tests.accounts import IS_ROOT, NOT_ROOT, ROOT, RUNTIME, RUNTIME_PYTHON, shared_account

pytestmark = pytest.mark.skipif(not IS_ROOT, reason=NOT_ROOT)


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
