"""The README's first command from a fresh clone in a private folder: ``make run`` in a clone of
this repository (its last commit) inside a 0700 folder, as whoever runs the tests (root or not),
installs what the demo needs and serves the login page; nothing above the clone changes
permissions. As root the demo's servers run as ``gpupool-demo``, which cannot enter the folder:
so this fails if any part of user code still runs from the checkout.

The clone shares the download caches (pip's, npm's and the extension's yarn cache) with this
checkout, so it pays for installing, not for downloading. ``make clean`` in the clone removes
what it built, the runtime outside it included.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.install import ROOT, clean_env, free_port

INSTALL_TIMEOUT = 1200  # seconds: a cold install (pip, the extension's build, the runtime)


@pytest.fixture
def private_clone() -> Iterator[Path]:
    """A clone of this repository in a fresh 0700 folder; removed with what it built."""
    folder = Path(tempfile.mkdtemp(prefix="gpupool-private-"))
    assert folder.stat().st_mode & 0o777 == 0o700
    clone = folder / "gpupool"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    try:
        yield clone
    finally:
        subprocess.run(["make", "clean"], cwd=clone, env=clean_env(), capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def test_make_run_serves_the_login_page_from_a_private_clone(private_clone: Path) -> None:
    folder = private_clone.parent
    port = free_port()
    log = folder / "make-run.log"
    env = clean_env(
        GPUPOOL_PORT=str(port),
        GPUPOOL_HUB_PORT=str(free_port()),
        GPUPOOL_PROXY_API_PORT=str(free_port()),
        YARN_CACHE_FOLDER=str(ROOT / "labextension" / ".yarn-cache"),
    )
    with log.open("wb") as out:
        make = subprocess.Popen(
            ["make", "run"],
            cwd=private_clone,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        page = wait_for_login_page(make, f"http://127.0.0.1:{port}/hub/login", log)
        assert 'name="password"' in page
    finally:
        os.killpg(make.pid, signal.SIGINT)  # Ctrl-C: the hub stops its proxy and servers
        try:
            make.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
    assert folder.stat().st_mode & 0o777 == 0o700, "make run changed a folder above the clone"
    install_log = (private_clone / ".run" / "install.log").read_text(errors="replace")
    assert "playwright" not in install_log.lower(), "make run installed the test tools"


def wait_for_login_page(make: subprocess.Popen[bytes], url: str, log: Path) -> str:
    """The login page's HTML once the hub serves it; fails if ``make run`` ends first."""
    deadline = time.monotonic() + INSTALL_TIMEOUT
    while time.monotonic() < deadline:
        if make.poll() is not None:
            pytest.fail(f"make run exited {make.returncode}:\n{tail(log)}")
        try:
            r = requests.get(url, timeout=5)
            if r.status_code == 200:
                return r.text
        except requests.ConnectionError:
            pass
        time.sleep(1)
    pytest.fail(f"no login page at {url} after {INSTALL_TIMEOUT} s:\n{tail(log)}")


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
