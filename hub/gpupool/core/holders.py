"""Who may use a device: each process found on a device of the pool holds it, or does not.

Vocabulary
- *process on a device* (:class:`OnDevice`): one process NVML reports on a GPU or a MIG instance
  of the pool, with the account it runs as (``uid``; 0 for a process running as root at all)
  and its *claim*: the allocation id or job id this hub's marker in its environment (or in its
  nearest marked parent's) names, ``""`` without one.
- *holding* (:class:`Holding`): an allocation holding the device, with the account its code runs
  as (the *code account*, ``None`` when unknown) and whether that account alone makes a process
  its own (``by_account``: the per-user mode, where the account is the user's) or only the
  account together with a claim of it (the shared mode, where every user's code runs as one
  account).
- *held*: a process that counts for a holding of its device (:func:`holder_of`). A claim never
  counts without the account: a marker is only an environment variable, which anyone can copy.
- *stray*: a process of an account that runs user code (a hub user's, or the shared account)
  on a device it does not hold: warned, then stopped, as the policy says.
- *outside*: a process of any other account (root, a daemon, an account of no hub user),
  never stopped; *unknown*: an account the hub could not tell about (its REST API did not
  answer), neither stopped nor warned until it can tell.
- *outside use*: a device with any process that is not held on it; the ledger hands out nothing
  in outside use (:meth:`gpupool.core.ledger.Ledger.set_outside_use`), with the reason
  :func:`outside_reasons` words, until it is free again.

Contract: pure, no I/O. Accounts are uids here; the hub reads them from ``/proc``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Kind = Literal["held", "stray", "outside", "unknown"]


@dataclass(frozen=True)
class OnDevice:
    """One process NVML reports on one device (see *process on a device*)."""

    pid: int
    device: str
    uid: int
    used_mib: int | None = None
    claim: str = ""
    account: str = ""
    """The account's name, for people (``#<uid>`` for an account without one)."""


@dataclass(frozen=True)
class Holding:
    """An allocation holding a device, as processes are counted for it (see *holding*)."""

    allocation: str
    ref: str
    uid: int | None
    by_account: bool


def holder_of(process: OnDevice, holdings: Sequence[Holding]) -> str | None:
    """The allocation ``process`` counts for among its device's ``holdings``: one whose code
    account it runs as, claimed by its marker (a notebook's allocation id, a job's id), else the
    first that its account alone makes its own; ``None`` when it holds the device under none."""
    mine = [h for h in holdings if h.uid is not None and h.uid == process.uid]
    claimed = [h for h in mine if process.claim and process.claim in (h.allocation, h.ref)]
    if claimed:
        return claimed[0].allocation
    by_account = [h for h in mine if h.by_account]
    return by_account[0].allocation if by_account else None


def classify(
    process: OnDevice, holder: str | None, code: frozenset[int], unknown: frozenset[int]
) -> Kind:
    """What ``process`` is on its device (see the vocabulary): ``code`` are the uids of the
    accounts that run user code, ``unknown`` those the hub could not tell about. Root is always
    outside, whatever else is said of it."""
    if holder is not None:
        return "held"
    if process.uid == 0:
        return "outside"
    if process.uid in code:
        return "stray"
    if process.uid in unknown:
        return "unknown"
    return "outside"


def outside_reasons(found: Iterable[OnDevice]) -> dict[str, str]:
    """Device -> why it is not handed out, one sentence naming the processes on it that do not
    hold it (by pid and account), for refusals, the spawn page and the admin page."""
    by_device: dict[str, list[OnDevice]] = {}
    for p in found:
        by_device.setdefault(p.device, []).append(p)
    reasons = {}
    for device, unsorted in sorted(by_device.items()):
        procs = sorted(unsorted, key=lambda p: p.pid)
        named = ", ".join(f"{p.pid} ({p.account or f'#{p.uid}'})" for p in procs)
        if len(procs) == 1:
            reasons[device] = f"{device} is in use by process {named}, which does not hold it"
        else:
            reasons[device] = f"{device} is in use by processes {named}, which do not hold it"
    return reasons
