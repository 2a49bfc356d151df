"""``python -m benchmarks.load [--users N] [--jobs J] [--timeout S] [--only PHASE] [--db-url URL]
[--json]``: a hub under load.

One real hub (the repository's ``jupyterhub_config.py`` through the test harness, free loopback
ports, state in a temporary directory) with a simulated pool of 16 H100-80GB (12 whole, 4 with
two fixed 3g.40gb instances each: 16 GPU-equivalents), four teams whose quotas bind, and N users
(default 90) with real JupyterLab servers (``jupyterhub-singleuser``, nothing faked) and real
torchrun jobs. The pool's database is ``--db-url`` (any SQLAlchemy URL; by default SQLite in the
state dir), set as ``c.GPUPool.db_url`` before the demo's ``setup(c)`` builds the pool. The
phases, in order:

1. *storm 1*: every user POSTs ``/hub/api/users/<name>/server`` at once with their own token
   (each POST timed); then wait until no server is pending.
2. *burst*: J jobs (``POST /hub/api/gpupool/jobs``, a third of them on GPUs, a fifth cancelled
   0-3 s after submission) while four threads time ``GET /hub/api/gpupool/jobs``; until every job
   has ended or waits in the queue for GPUs the notebooks hold.
3. *stop*: every server is stopped (DELETE, at once).
4. *storm 2 and crash*: one 40-second job, then every user spawns again while short jobs are
   submitted one a second; the REST view is read every 0.1 s and once it shows a server pending
   its spawn and a job starting at the same look, the hub gets SIGKILL (or ``--kill-after``
   seconds in; the proxy, servers and jobs live on) and is started again. Users whose server is
   not running after the restart retry once (*retry*).
5. *contested* (:mod:`benchmarks.load_contested`): for ``--contested-s`` seconds users spawn and
   stop GPU servers of various offers and submit and cancel GPU jobs, beyond capacity and quota;
   the hub's grants, releases and refusals are counted from ``/hub/metrics``.
6. *faults* (:mod:`benchmarks.load_faults`): the pool's store fails (a full tmpfs, or its tables
   renamed) while jobs end, servers stop and spawns are tried; then *dead holder*: GPU servers'
   processes are killed and the release of their allocations timed.
7. *abuse* (:mod:`benchmarks.abuse`): one user floods the hub with jobs, log followers and
   spawn retries beyond every per-user limit while another user's ``GET /jobs`` and
   ``/offers`` are timed.
8. *stop everything*: every server stopped, every job cancelled; the pool must be empty.

``--only abuse|contested|faults|dead-holder`` runs one phase on a hub of its own (then stop
everything).

Modules, by phase: the plan (pool, teams, users, jobs) in :mod:`benchmarks.load_plan`; requests
and the views read through them in :mod:`benchmarks.load_session`; storm 1 and the retry in
:mod:`benchmarks.load_spawns`; the burst in :mod:`benchmarks.load_jobs`; storm 2 and the crash
in :mod:`benchmarks.load_restart`; the report and its table in :mod:`benchmarks.load_report`.
This module is the runner: arguments, the hub's start and stop, the order of the phases, stop
everything and the cleanup.

Invariants (``double_owner``, ``over_quota``, ``orphans``, ``leaked``, ``leaked_during_run``,
``status_5xx``, ``final_state_changed``) and how they are watched: :mod:`benchmarks.load_watch`.

Latencies: ``spawn_p50_s``/``spawn_p99_s`` over the POSTs of storm 1 (every answer; refusals
included), ``jobs_get_p50_s``/``jobs_get_p99_s`` over the GETs during the burst (the admin's
look follows every page), ``victim_p99_s`` over the victim's GETs during the abuse phase;
nearest-rank percentiles (:mod:`benchmarks.stats`). ``abuse_accepted_beyond_limit``: what the
hub accepted beyond the per-user limits in that phase. ``proc_scan``: what each scan of
``/proc`` cost.

Contract: loopback only; bounded in count (``--users``, ``--jobs``, ``--storm-jobs``) and time
(``--timeout`` bounds every wait; phases left when it is spent are skipped, stop and checks are
not; ``--contested-s``, ``--fault-s``); a monitor stops adding load if the machine's available
memory drops under 1.5 GiB. Always stops what it started (hub, proxy, servers, job processes:
found by this run's homes in their environment; the tmpfs is unmounted), also on failure or
Ctrl-C. Progress goes to stderr; the table (or, with ``--json``, one JSON object) to stdout:
``> benchmarks/results/load.json`` keeps it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.load_faults import tmpfs
from benchmarks.load_jobs import burst
from benchmarks.load_plan import FINAL, OFFERS, SPEC, TEAMS, Persona, groups, plan_users
from benchmarks.load_report import _brief, machine, summarize, table
from benchmarks.load_restart import crash_storm
from benchmarks.load_session import log
from benchmarks.load_spawns import spawn_round
from benchmarks.load_views import homed, live_processes
from benchmarks.load_watch import Watch
from gpupool import procfs

ROOT = Path(__file__).resolve().parents[1]


class LoadRun(Watch):
    """One run: its hub, its users, the phases in order, and what they found (``result``)."""

    def __init__(
        self, args: argparse.Namespace, state: Path, homes: Path, fault_mode: str = "rename"
    ) -> None:
        from tests.hub.conftest import Hub  # the harness: real hub, real proxy, real servers

        self.personas = plan_users(args.users)
        self.fault_mode = fault_mode
        self.pool_db_dir = state / "pooldb"  # a tmpfs of its own in the tmpfs fault mode
        self.db_url: str = args.db_url or f"sqlite:///{self.pool_db_dir / 'gpupool.sqlite'}"
        self.pool_db_dir.mkdir(parents=True, exist_ok=True)
        if not args.db_url:  # where the abuse phase looks for the database's size
            (state / "gpupool.sqlite").symlink_to(self.pool_db_dir / "gpupool.sqlite")
        self.started = time.monotonic()
        self.db_where = _describe(self.db_url)
        hub = Hub(state, homes, extra_config=self._extra_config(), prelude=self._prelude())
        hub.env["GPUPOOL_INVENTORY"] = f"simulated:{SPEC}"
        if args.hub_pythonpath:  # another gpupool for the hub (e.g. an older one)
            first = [str(Path(d).resolve()) for d in args.hub_pythonpath.split(os.pathsep)]
            hub.env["PYTHONPATH"] = os.pathsep.join(
                [*first, os.environ.get("PYTHONPATH", "")]
            ).rstrip(os.pathsep)
        super().__init__(args, hub, homes, self.db_url)
        self.result: dict[str, Any] = {"phases_s": {}}
        self.machine: dict[str, Any] = {}

    # -- config ------------------------------------------------------------------------------
    def _prelude(self) -> str:
        """Config run before the demo's: the demo sets its own teams, offers and database right
        before ``setup(c)``, so the benchmark's are put in by wrapping ``setup`` (in the hub
        process)."""
        return (
            "import gpupool.hub as _gpupool_hub\n"
            "_gpupool_setup = _gpupool_hub.setup\n"
            "def _load_setup(c, *args, **kwargs):\n"
            f"    c.GPUPool.offers = {OFFERS!r}\n"
            f"    c.GPUPool.teams = {TEAMS!r}\n"
            "    c.GPUPool.everyone = {'offers': ['cpu']}\n"
            f"    c.GPUPool.db_url = {self.db_url!r}\n"
            "    return _gpupool_setup(c, *args, **kwargs)\n"
            "_gpupool_hub.setup = _load_setup\n"
        )

    def _extra_config(self) -> str:
        users = sorted(p.name for p in self.personas)
        return (
            f"c.Authenticator.allowed_users = set({users!r})\n"
            f"c.JupyterHub.load_groups = "
            f"{ {t: {'users': m} for t, m in groups(self.personas).items()}!r}\n"
            "c.JupyterHub.allow_named_servers = True\n"  # the abuse phase's spawn flood
            # JupyterHub's own poll interval (the test harness polls every second): a dead
            # server must be noticed by the spawner's exit watch (dead_holder_release_s)
            "c.Spawner.poll_interval = 30\n"
        )

    # -- everything --------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        timings = self.result["phases_s"]

        @contextlib.contextmanager
        def phase(name: str) -> Iterator[None]:
            self.phase = name
            log(f"phase {name}")
            t0 = time.monotonic()
            try:
                yield
            finally:
                timings[name] = round(time.monotonic() - t0, 1)

        def go() -> bool:
            return not self.abort and not self.deadline.spent

        from benchmarks.load_contested import brief, contested
        from benchmarks.load_faults import dead_holder, store_fault
        from gpupool.jobs.local import LocalJobBackend

        self.kill_grace = float(LocalJobBackend.kill_grace.default_value)  # the demo's
        only = self.args.only
        with phase("start"):
            self.hub.start()
            self.hub_up.set()
            self.admin_token = self.hub.token("admin", ["custom:gpupool:admin"])
            for p in self.abuse_pair() if only == "abuse" else self.personas:
                self.tokens[p.name] = self.hub.token(p.name, ["self", "custom:gpupool:jobs"])
        threads = [
            threading.Thread(target=f, daemon=True)
            for f in (self.monitor, self.proc_watch, self.poll_jobs)
        ]
        for t in threads:
            t.start()
        interrupted = False
        try:
            if only is None:
                self.main_phases(phase, go)
            if only in (None, "contested") and go():
                with phase("contested"):
                    self.result["contested"] = contested(self)
                    brief(self.result["contested"], log)
                self.checkpoint(phase, "check-contested")
            if only in (None, "faults") and go():
                with phase("faults"):
                    self.result["faults"] = store_fault(self)
                    f = self.result["faults"]
                    log(
                        f"  store fault: stranded_jobs {f.get('stranded_jobs')}, "
                        f"leaked_on_fault {f.get('leaked_on_fault')}, fault_503 {self.fault_503}"
                    )
            if only in (None, "dead-holder") and go():
                with phase("dead-holder"):
                    self.result["dead_holder"] = dead_holder(self)
            if only in (None, "abuse") and go():
                with phase("abuse"):
                    self.result["abuse"] = self.abuse()
        except (KeyboardInterrupt, SystemExit):
            interrupted = True  # Ctrl-C or SIGTERM: no orderly stop, straight to the cleanup
            raise
        finally:
            if not interrupted:  # also after a failed phase: what it left is measured too
                with phase("stop-all"):
                    self.result["final"] = self.stop_everything()
            self.stop_monitor.set()
            for t in threads:
                t.join(30)
        self.result["total_s"] = round(time.monotonic() - started, 1)
        return self.result

    def main_phases(
        self,
        phase: Callable[[str], contextlib.AbstractContextManager[None]],
        go: Callable[[], bool],
    ) -> None:
        """Storm 1, the burst, storm 2 with the crash, the retry (each with its checkpoint)."""
        with phase("storm1"):
            self.result["storm1"] = spawn_round(self, "storm1", self.personas)
        self.checkpoint(phase, "check-storm1")
        if go():
            with phase("burst"):
                self.result["burst"] = burst(self)
                log(
                    f"  burst: {self.result['burst']['states_at_end']}, GET /jobs p99 "
                    f"{self.result['burst']['jobs_get_p99_s']} s"
                )
            self.checkpoint(phase, "check-burst")
        with phase("stop1"):
            self.stop_servers("stop1")
        if go():
            with phase("storm2-crash"):
                self.result["crash"] = crash_storm(self)
                log(f"  storm 2: {_brief(self.result['crash']['spawns'])}")
            with phase("retry"):
                listed = self.servers("retry") or {}
                again = [p for p in self.personas if p.name not in listed]
                self.result["retry"] = spawn_round(self, "retry", again)
            self.checkpoint(phase, "check-restart")
        with phase("stop2"):  # the contested phase starts from an empty pool
            self.stop_servers("stop2")

    def checkpoint(
        self, phase: Callable[[str], contextlib.AbstractContextManager[None]], name: str
    ) -> None:
        """A phase's end: one look at every view, and the orphan check."""
        with phase(name):
            self.look(name)
            self.check_orphans(name)

    def abuse_pair(self) -> tuple[Persona, Persona]:
        """The abuse phase's attacker (the first user of team vision) and victim (the first
        of team nlp)."""
        return (
            next(p for p in self.personas if p.team == "vision"),
            next(p for p in self.personas if p.team == "nlp"),
        )

    def abuse(self) -> dict[str, Any]:
        """The abuse phase (:mod:`benchmarks.abuse`)."""
        from benchmarks.abuse import Abuse

        attacker, victim = self.abuse_pair()
        return Abuse(
            self.hub,
            (attacker.name, self.tokens[attacker.name]),
            (victim.name, self.tokens[victim.name]),
            self.args,
            log,
        ).run()

    def stop_everything(self) -> dict[str, Any]:
        """Stop every server, cancel every job; then what is left: allocations and processes."""
        out: dict[str, Any] = {}
        if not self.hub_up.is_set():
            return {"skipped": "the hub is not up"}
        stopped = self.stop_servers("stop-all")
        jobs = self.all_jobs("stop-all") or {"jobs": []}
        self.record_jobs(jobs["jobs"])
        open_ = [j["id"] for j in jobs["jobs"] if j["state"] not in FINAL]
        for job_id in open_:
            self.http("DELETE", f"/hub/api/gpupool/jobs/{job_id}", self.admin_token, "stop-all")
        end = time.monotonic() + 60
        while time.monotonic() < end:
            now = self.all_jobs("stop-all")
            if now is not None:
                self.record_jobs(now["jobs"])
                if all(j["state"] in FINAL for j in now["jobs"]):
                    break
            time.sleep(1)
        end = time.monotonic() + 30
        db = self.db_allocations() or []
        while db and time.monotonic() < end:
            time.sleep(1)
            db = self.db_allocations() or []
        self.look("stop-all")
        rest = self.pool_admin("/allocations?all=1", "stop-all")
        out.update(
            servers_stopped=stopped,
            jobs_cancelled=len(open_),
            leaked=len(db),
            leaked_rest=None if rest is None else len(rest["allocations"]),
            leaked_examples=[
                {
                    "id": a.id,
                    "kind": a.kind,
                    "ref": a.ref,
                    "team": a.team,
                    "offer": a.offer,
                    "devices": [d.visible_id for d in a.devices],
                }
                for a in db[:8]
            ],
        )
        out["orphans_after_stop"] = self.check_orphans("stop-all", everything_stopped=True)
        jobs = self.all_jobs("stop-all") or {"jobs": []}
        out["job_states"] = dict(Counter(j["state"] for j in jobs["jobs"]))
        return out

    def cleanup(self) -> dict[str, int]:
        """Stop the hub and proxy, then end every process of this run still alive."""
        killed = {"hub": 0, "proxy": 0, "servers": 0, "job_processes": 0}
        proc = self.hub.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                killed["hub"] = 1
        pidfile = self.hub.state / "jupyterhub-proxy.pid"
        with contextlib.suppress(OSError, ValueError):
            pid = int(pidfile.read_text().strip())
            if "configurable-http-proxy" in procfs.cmdline(pid):
                os.kill(pid, signal.SIGKILL)
                killed["proxy"] = 1
        for p in live_processes(self.homes, self.scan_cost):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
                killed["servers" if p.kind == "server" else "job_processes"] += 1
        for pid, _ in homed(self.homes, procfs.pids()):  # anything else of this run (job shells)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed["job_processes"] += 1
        return killed


def fault_mode(args: argparse.Namespace) -> str:
    """``tmpfs`` when asked, or (``auto``) as root on the default SQLite database with
    ``mount`` at hand; else ``rename``."""
    if args.fault != "auto":
        return str(args.fault)
    root = os.geteuid() == 0 and not args.db_url and shutil.which("mount") is not None
    return "tmpfs" if root else "rename"


def _describe(url: str) -> str:
    from gpupool.store import describe

    return describe(url)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=90, help="users spawning at once (90)")
    parser.add_argument("--jobs", type=int, default=64, help="jobs in the burst (64)")
    parser.add_argument(
        "--storm-jobs",
        type=int,
        default=8,
        help="jobs with storm 2: one of 40 s, the rest of 1 s one a second until the kill (8)",
    )
    parser.add_argument(
        "--kill-after",
        type=float,
        default=60.0,
        help="SIGKILL the hub this many s into storm 2 if no spawn and job start overlap (60)",
    )

    parser.add_argument(
        "--timeout",
        type=float,
        default=900,
        help="bound on all the waits together, in seconds (900)",
    )
    parser.add_argument("--burst-timeout", type=float, default=180)
    parser.add_argument("--request-timeout", type=float, default=120)
    parser.add_argument(
        "--monitor-interval", type=float, default=0.5, help="seconds between looks (0.5)"
    )
    parser.add_argument(
        "--proc-interval", type=float, default=0.25, help="seconds between /proc scans (0.25)"
    )
    parser.add_argument(
        "--view-grace", type=float, default=12.0, help="a cross-view finding must last (12)"
    )
    parser.add_argument(
        "--leak-grace", type=float, default=15.0, help="a holder must stay gone (15)"
    )
    parser.add_argument("--jobs-poll-interval", type=float, default=1.0)
    parser.add_argument(
        "--db-url", default="", help="the pool's database (any SQLAlchemy URL; SQLite by default)"
    )
    parser.add_argument(
        "--contested-s", type=float, default=120.0, help="the contested phase's length (120)"
    )
    parser.add_argument("--contested-users", type=int, default=24, help="users spawning (24)")
    parser.add_argument(
        "--contested-job-users", type=int, default=4, help="users submitting jobs (4)"
    )
    parser.add_argument(
        "--fault",
        choices=["auto", "tmpfs", "rename"],
        default="auto",
        help="how the store fails: a full tmpfs (root, SQLite) or renamed tables (auto)",
    )
    parser.add_argument("--fault-s", type=float, default=30.0, help="the store fault lasts (30)")
    parser.add_argument(
        "--fault-grace", type=float, default=45.0, help="then counted this much later (45)"
    )
    parser.add_argument("--tmpfs-size", default="128m", help="the tmpfs of the tmpfs fault")
    parser.add_argument("--dead-holders", type=int, default=3, help="servers killed (3)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", metavar="DIR", help="keep the hub's state and log in DIR")
    parser.add_argument("--note", default="", help="a note stored in the JSON (what was run)")
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    parser.add_argument(
        "--only",
        choices=["abuse", "contested", "faults", "dead-holder"],
        help="run only this phase (on a hub of its own)",
    )
    parser.add_argument("--abuse-jobs", type=int, default=300, help="jobs the attacker posts")
    parser.add_argument(
        "--abuse-followers", type=int, default=300, help="log streams the attacker opens"
    )
    parser.add_argument(
        "--abuse-spawns", type=int, default=10, help="named servers the attacker starts at once"
    )
    parser.add_argument("--spawn-retries", type=int, default=5, help="retries of each refusal")
    parser.add_argument("--hold", type=float, default=10.0, help="seconds streams stay open")
    parser.add_argument(
        "--memory-rounds", type=int, default=2, help="jobs floods after, for memory only"
    )
    parser.add_argument(
        "--hub-pythonpath",
        metavar="DIRS",
        help="folders (':'-separated) first on the hub's PYTHONPATH: another gpupool",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.users <= 500 or not 0 <= args.jobs <= 1000 or not 1 <= args.storm_jobs <= 100:
        parser.error("--users 1..500, --jobs 0..1000, --storm-jobs 1..100")
    if not (
        0 <= args.abuse_jobs <= 2000
        and 0 <= args.abuse_followers <= 2000
        and 1 <= args.abuse_spawns <= 100
        and 0 <= args.spawn_retries <= 100
    ):
        parser.error("--abuse-jobs and --abuse-followers 0..2000, --abuse-spawns 1..100")
    if not (
        0 < args.contested_s <= 1800
        and 0 <= args.contested_users <= 200
        and 0 <= args.contested_job_users <= 50
        and 0 < args.fault_s <= 600
        and 0 <= args.fault_grace <= 600
        and 1 <= args.dead_holders <= 10
        and args.monitor_interval > 0
        and args.proc_interval > 0
    ):
        parser.error(
            "--contested-s 0..1800, --contested-users 0..200, --contested-job-users 0..50, "
            "--fault-s 0..600, --fault-grace 0..600, --dead-holders 1..10, intervals > 0"
        )
    sys.path.insert(0, str(ROOT))
    from tests.accounts import homes

    info = machine()
    with contextlib.ExitStack() as stack:
        if args.keep:
            tmp = tempfile.mkdtemp(prefix="gpupool-load-", dir=args.keep)
            log(f"the hub's state and log stay in {tmp}")
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="gpupool-load-"))
        home_root = stack.enter_context(homes())
        mode = fault_mode(args)
        if mode == "tmpfs" and args.only in (None, "faults"):
            stack.enter_context(tmpfs(Path(tmp) / "pooldb", args.tmpfs_size))
        run = LoadRun(args, Path(tmp), home_root, mode)
        run.machine = info
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        cleanup: dict[str, int] = {}
        try:
            run.run()
        except BaseException as e:
            run.result["error"] = f"{type(e).__name__}: {e}"
            log(f"FAILED: {run.result['error']}")
            if not isinstance(e, Exception):
                raise
        finally:
            cleanup = run.cleanup()
            signal.signal(signal.SIGTERM, previous)
            if cleanup and any(cleanup.values()):
                log(f"cleanup ended {cleanup}")
        summary = summarize(run, cleanup)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(table(summary))
    return 1 if summary["error"] else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
