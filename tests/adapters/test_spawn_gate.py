"""The spawn gate's count: starts it let through count as starting until decided.

A real pool (the hub's default ``user_limits``: 2 servers starting); the users are shaped as
JupyterHub's ``User`` is where the gate reads it (``name``, ``groups``, ``spawners`` by server
name, each with ``pending``, ``ready`` and gpupool's ``gpupool_admitted``). The hub's own
behaviour (a refused start writes nothing to JupyterHub's database) is tested against a real
JupyterHub in ``tests/hub/test_fair_use.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gpupool.hub.spawn_gate import SpawnGate
from tests.conftest import small_pool


@dataclass
class Group:
    name: str


@dataclass
class Spawner:
    pending: str | None = None
    ready: bool = False
    gpupool_admitted: bool = False


@dataclass
class User:
    name: str = "ada"
    groups: list[Group] = field(default_factory=lambda: [Group("vision")])
    spawners: dict[str, Spawner] = field(default_factory=dict)


def gate(tmp_path: Path) -> SpawnGate:
    return SpawnGate(small_pool(tmp_path))


def test_starts_sent_at_once_count_before_any_spawner_admits_them(tmp_path: Path) -> None:
    g = gate(tmp_path)
    ada = User()
    assert g.check(ada, "one", named=True) is None
    assert g.check(ada, "two", named=True) is None
    refused = g.check(ada, "three", named=True)  # the first two are still in flight
    assert refused is not None and refused.message == (
        "You have 2 servers starting; the limit is 2 per user in team vision. "
        "Wait until one has started."
    )
    assert g.check(User("ben"), "one", named=True) is None  # per user


def test_a_decided_start_counts_as_its_spawner_says(tmp_path: Path) -> None:
    g = gate(tmp_path)
    ada = User()
    for name in ("one", "two"):
        assert g.check(ada, name, named=True) is None
    ada.spawners["one"] = Spawner(pending="spawn", gpupool_admitted=True)  # admitted
    g.decided("ada", "one")
    ada.spawners["two"] = Spawner(pending="spawn")  # refused (quota, say): not starting
    g.decided("ada", "two")
    assert g.check(ada, "three", named=True) is None  # one starting, one in flight
    assert g.check(ada, "four", named=True) is not None


def test_jupyterhub_answers_some_starts_itself(tmp_path: Path) -> None:
    g = gate(tmp_path)
    ada = User(spawners={"a": Spawner(pending="spawn", gpupool_admitted=True)})
    ada.spawners["b"] = Spawner(pending="spawn", gpupool_admitted=True)
    assert g.check(ada, "a", named=True) is None  # already starting: JupyterHub says 202
    assert g.check(ada, "c", named=True) is not None
    assert g.check(ada, "c", named=False) is None  # named servers off: JupyterHub says 400
    ada.spawners["r"] = Spawner(ready=True)
    assert g.check(ada, "r", named=True) is None  # running: JupyterHub says 400


def test_a_start_jupyterhub_answered_itself_leaves_nothing_in_flight(tmp_path: Path) -> None:
    g = gate(tmp_path)
    ada = User()
    for name in ("one", "two"):
        assert g.check(ada, name, named=True) is None
    assert g.check(ada, "three", named=True) is not None
    g.decided("ada", "one")  # the handler's end: JupyterHub said 400 (a bad body, say)
    assert g.check(ada, "three", named=True) is None
