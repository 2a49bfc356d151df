"""The local job backend never lends the hub's privileges to user code (real processes, real
unix accounts).

The hub runs as root here (as CI does); each test makes a real unix user, plants what an
attacker would in that user's home (links to a root-owned folder and to a root-only file, a hard
link, a FIFO) and shows that the hub, starting a job and reading its logs and exit codes, neither
changes nor reads anything but that user's own files. Run as an ordinary user these tests skip:
switching accounts needs root.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from traitlets.config import Config

from gpupool.core.jobs import Job, JobSpec
from gpupool.declarations import ConfigError
from gpupool.jobs.local import LocalJobBackend
from tests.accounts import (
    IS_ROOT,
    NOT_ROOT,
    remove_unix_user,
    runtime,
    shared_account,
    unix_user,
)

pytestmark = pytest.mark.skipif(not IS_ROOT, reason=NOT_ROOT)
USER = "gpupool-mallory"
SECRET = "root-only-secret-7f3a"


@pytest.fixture(scope="module")
def mallory() -> Iterator[Path]:
    """A real unix user; yields their home."""
    home = Path(unix_user(USER).pw_dir)
    yield home
    remove_unix_user(USER)


@pytest.fixture
def secret() -> Iterator[Path]:
    """A root-only file on the same file system as the homes (so it can be hard-linked)."""
    path = Path("/home") / f".gpupool-test-secret-{os.getpid()}"
    path.write_text(SECRET)
    path.chmod(0o600)
    yield path
    path.unlink()


@pytest.fixture
def root_dir() -> Iterator[Path]:
    """A root-owned folder anyone may enter, which must stay root's and empty."""
    path = Path(tempfile.mkdtemp(prefix="gpupool-root-owned-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def backend(per_user: bool = True) -> LocalJobBackend:
    c = Config()
    c.LocalJobBackend.run_as_hub_user = not per_user
    c.LocalJobBackend.shared_account = shared_account()
    c.LocalJobBackend.kill_grace = 1.0
    runtime(c)
    return LocalJobBackend(config=c)


def job(script: str, ranks: int = 1) -> Job:
    return Job(os.urandom(6).hex(), USER, "t", JobSpec(script=script, gpus=ranks))


async def run_to_end(b: LocalJobBackend, j: Job, timeout: float = 120) -> tuple[Job, str]:
    """Start ``j`` and watch it as the manager does until it ends; the job and its end state."""
    handle = await b.start(j, [])
    j = Job(j.id, j.owner, j.team, j.spec, handle=handle)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        seen = await b.check(j)
        if seen.ended:
            return j, seen.state
        await b.wait(j, 0.5)
    raise AssertionError(f"job {j.id} did not end in {timeout}s")


def test_a_job_runs_as_its_owner_with_none_of_the_hubs_environment(
    mallory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUPOOL_ADMIN_PASSWORD", SECRET)  # a secret in the hub's environment
    script = "import json, os; print(json.dumps([os.getuid(), os.getgid(), dict(os.environ)]))"
    b = backend()
    j, state = asyncio.run(run_to_end(b, job(script, ranks=2)))
    assert state == "succeeded"
    uid, gid, env = json.loads(asyncio.run(b.read_log(j, 1, 0))[0].decode().splitlines()[-1])
    owner = unix_user(USER)
    assert (uid, gid) == (owner.pw_uid, owner.pw_gid)
    assert SECRET not in json.dumps(env)
    assert not {k for k in env if k.startswith(("JUPYTERHUB_", "CONFIGPROXY_"))}
    jdir = mallory / ".gpupool" / "jobs" / j.id
    for path in (mallory / ".gpupool", jdir, jdir / "script.py", jdir / "rank-1.log"):
        assert path.stat().st_uid == owner.pw_uid  # made by the job itself, as its owner
    assert stat.S_IMODE(jdir.stat().st_mode) == 0o700


def test_a_link_planted_for_the_job_folder_changes_nothing_of_roots(
    mallory: Path, root_dir: Path
) -> None:
    gpupool = mallory / ".gpupool"
    shutil.rmtree(gpupool, ignore_errors=True)
    gpupool.symlink_to(root_dir)  # ~/.gpupool -> a root-owned folder
    os.lchown(gpupool, *_ids())
    try:
        b = backend()
        with pytest.raises(RuntimeError, match="could not be prepared as gpupool-mallory"):
            asyncio.run(b.start(job("print('hi')"), []))
        assert root_dir.stat().st_uid == 0 and list(root_dir.iterdir()) == []
    finally:
        gpupool.unlink()


def test_logs_and_exit_codes_are_read_only_from_the_owners_own_files(
    mallory: Path, secret: Path
) -> None:
    b = backend()
    j, state = asyncio.run(run_to_end(b, job("print('mine')", ranks=2)))
    assert state == "succeeded"
    assert b"mine" in asyncio.run(b.read_log(j, 0, 0))[0]
    jdir = mallory / ".gpupool" / "jobs" / j.id
    # what the user plants once the job has ended: links to root's secret, a hard link, a FIFO
    for name in ("rank-0.log", "rank-1.log", "exit-code", "rank-0.exit", "rank-1.exit"):
        (jdir / name).unlink()
    (jdir / "rank-0.log").symlink_to(secret)
    os.link(secret, jdir / "rank-1.log")  # root makes it here; the kernel may stop a user
    (jdir / "exit-code").symlink_to(secret)
    os.mkfifo(jdir / "rank-0.exit")
    for name in ("rank-0.log", "exit-code", "rank-0.exit"):  # the user's own links and FIFO
        os.lchown(jdir / name, *_ids())
    assert asyncio.run(b.read_log(j, 0, 0)) == (b"", 0)
    assert asyncio.run(b.read_log(j, 1, 0)) == (b"", 0)
    seen = asyncio.run(b.check(j))  # the FIFO does not block; nothing of root's is read
    assert seen.state == "lost" and seen.exit_codes == ()
    assert secret.read_text() == SECRET and secret.stat().st_uid == 0


def test_the_shared_mode_as_root_needs_an_unprivileged_account() -> None:
    c = Config()
    c.LocalJobBackend.run_as_hub_user = True
    with pytest.raises(
        ConfigError, match=r"^LocalGPUSpawner\.shared_account: the hub runs as root"
    ):
        LocalJobBackend(config=c)
    c.LocalJobBackend.shared_account = "root"
    with pytest.raises(ConfigError, match="is root; user code never runs as root"):
        LocalJobBackend(config=c)
    c.LocalJobBackend.shared_account = "no-such-account-here"
    with pytest.raises(ConfigError, match="there is no unix account 'no-such-account-here'"):
        LocalJobBackend(config=c)


def test_a_hub_user_named_root_never_runs_a_job_as_root() -> None:
    b = backend()
    j = Job("rootjob", "root", "t", JobSpec(script="print(1)"))
    with pytest.raises(ConfigError, match="is root; user code never runs as root"):
        asyncio.run(b.start(j, []))


def _ids() -> tuple[int, int]:
    pw = unix_user(USER)
    return pw.pw_uid, pw.pw_gid
