"""Tests of the README's commands as a newcomer runs them, and what they share: the environment
of a ``make`` started from inside ``make test``."""

from __future__ import annotations

import os
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what the outer ``make test`` exported into it (its venv and
    node_modules on PATH, make's own variables)."""
    ours = (str(ROOT / ".venv"), str(ROOT / ".venv-jh5"), str(ROOT / "node_modules"))
    path = [p for p in os.environ.get("PATH", "").split(":") if p and not p.startswith(ours)]
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MAKE", "MFLAGS", "VIRTUAL_ENV", "GPUPOOL_", "PYTEST"))
    }
    return {**env, "PATH": ":".join(path), **extra}
