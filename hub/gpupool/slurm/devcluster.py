"""A Slurm cluster on this machine, for trying gpupool on Slurm and for its tests.

Vocabulary
- *dev cluster*: munged, slurmctld and one slurmd per node (and, with accounting, MariaDB and
  slurmdbd), all started as root in one folder, with simulated GPUs: character devices made
  with ``mknod`` (major 195, NVIDIA's), which is all Slurm's gres plugin needs of a GPU when no
  NVML plugin autodetects (Debian's build has none), so MIG types are declared in ``gres.conf``.
- *layout*: per node, its GPU gres as ``{type: count}`` (``{"h100": 2, "1g.10gb": 3}``) and
  ``shards`` (Slurm's shard gres, spread over the node's GPUs).

Contract: :meth:`DevCluster.start` returns once ``sinfo`` answers and every node is idle;
:meth:`stop` kills every daemon it started and leaves the folder. Clients find the cluster
through ``SLURM_CONF`` (:attr:`DevCluster.env`). Needs root and Debian's ``slurmctld``,
``slurmd``, ``slurm-client`` and ``munge`` (``mariadb-server`` and ``slurmdbd`` for accounting);
:func:`missing` says what is absent.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
SBIN = Path("/usr/sbin")
NVIDIA_MAJOR = 195


def missing(accounting: bool = False) -> list[str]:
    """What this machine lacks to run a dev cluster (empty: it can)."""
    wanted = [*DAEMONS, "sbatch", "squeue", "sinfo", "scancel"]
    if accounting:
        wanted += ["slurmdbd", "mariadbd", "mariadb-install-db", "sacctmgr"]
    gone = [name for name in wanted if not shutil.which(name, path=f"{SBIN}:/usr/bin")]
    if os.geteuid() != 0:
        gone.append("root")
    return gone


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class NodeLayout:
    name: str
    gpus: Mapping[str, int]
    """GPU gres types and how many of each (``{"h100": 2}``; MIG types are types too)."""
    shards: int = 0
    cpus: int = 16
    memory_mb: int = 64000


@dataclass
class DevCluster:
    folder: Path
    nodes: tuple[NodeLayout, ...] = (NodeLayout("gpu1", {"h100": 4}),)
    partition: str = "gpu"
    min_job_age: int = 300
    accounting: bool = False
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm client needs to find this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Slurm command against this cluster, as root."""
        return subprocess.run(
            args, env={**os.environ, **self.env}, capture_output=True, text=True, check=check
        )

    # -- files --------------------------------------------------------------------------------
    def _write(self) -> None:
        f = self.folder
        for sub in ("state", "spool", "log", "dev", "munge"):
            (f / sub).mkdir(parents=True, exist_ok=True)
        f.chmod(0o755)
        self._ports = {"ctld": free_port(), "d": free_port()}
        gres_types = ["gpu"] + (["shard"] if any(n.shards for n in self.nodes) else [])
        lines = [
            "ClusterName=gpupooldev",
            f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
            f"SlurmctldPort={self._ports['ctld']}",
            f"SlurmdPort={self._ports['d']}",
            "AuthType=auth/munge",
            "CryptoType=crypto/munge",
            f"AuthInfo=socket={f / 'munge' / 'munge.socket'}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={f / 'state'}",
            f"SlurmdSpoolDir={f / 'spool' / '%n'}",
            f"SlurmctldPidFile={f / 'slurmctld.pid'}",
            f"SlurmdPidFile={f / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={f / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={f / 'log' / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1,sched_interval=1",
            f"GresTypes={','.join(gres_types)}",
            "SlurmdParameters=config_overrides",
            f"MinJobAge={self.min_job_age}",
            "ReturnToService=2",
            "JobCompType=jobcomp/none",
            "InactiveLimit=0",
            "KillWait=5",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
        ]
        if self.accounting:
            lines += [
                "AccountingStorageType=accounting_storage/slurmdbd",
                f"AccountingStoragePort={self._ports.setdefault('dbd', free_port())}",
                "AccountingStorageHost=127.0.0.1",
                "AccountingStorageTRES=gres/gpu,gres/shard",
                "AccountingStorageEnforce=associations,limits,qos,safe",
                "JobAcctGatherType=jobacct_gather/none",
                "PriorityType=priority/multifactor",
            ]
        gres_conf = []
        index = 0
        for node in self.nodes:
            gres = [f"gpu:{t}:{n}" for t, n in node.gpus.items() if n]
            if node.shards:
                gres.append(f"shard:{node.shards}")
            (f / "spool" / node.name).mkdir(exist_ok=True)
            port = f" Port={free_port()}" if len(self.nodes) > 1 else ""
            lines.append(
                f"NodeName={node.name} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1"
                f" CPUs={node.cpus} RealMemory={node.memory_mb}"
                + (f" Gres={','.join(gres)}" if gres else "")
                + port
                + " State=UNKNOWN"
            )
            first = index
            for gres_type, count in node.gpus.items():
                for _ in range(count):
                    dev = f / "dev" / f"nvidia{index}"
                    if not dev.exists():
                        os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, index))
                    gres_conf.append(f"NodeName={node.name} Name=gpu Type={gres_type} File={dev}")
                    index += 1
            if node.shards:
                gpus = max(index - first, 1)
                per = [
                    node.shards // gpus + (1 if i < node.shards % gpus else 0) for i in range(gpus)
                ]
                for i, count in enumerate(per):
                    if count:
                        gres_conf.append(
                            f"NodeName={node.name} Name=shard Count={count}"
                            f" File={f / 'dev' / f'nvidia{first + i}'}"
                        )
        lines.append(
            f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
        )
        self.conf.write_text("\n".join(lines) + "\n")
        (f / "gres.conf").write_text("\n".join(gres_conf) + "\n")

    # -- daemons ------------------------------------------------------------------------------
    def _munge(self) -> None:
        munge = pwd.getpwnam("munge")
        d = self.folder / "munge"
        key = d / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        for path in (d, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        d.chmod(0o755)
        key.chmod(0o400)
        self.procs["munged"] = subprocess.Popen(
            [
                "runuser",
                "-u",
                "munge",
                "--",
                str(SBIN / "munged"),
                "--foreground",
                f"--socket={d / 'munge.socket'}",
                f"--key-file={key}",
                f"--pid-file={d / 'munged.pid'}",
                f"--log-file={d / 'munged.log'}",
                f"--seed-file={d / 'munged.seed'}",
                "--force",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._wait(lambda: (d / "munge.socket").exists(), "munged's socket")

    def start_controller(self) -> None:
        self.procs["slurmctld"] = subprocess.Popen(
            [str(SBIN / "slurmctld"), "-D", "-i", "-f", str(self.conf)],
            env={**os.environ, **self.env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def stop_controller(self) -> None:
        self._kill("slurmctld")

    def stop_stale(self) -> list[int]:
        """Kill the daemons a previous run left in this folder (its pid files), e.g. after the
        demo was killed; returns their pids."""
        killed = []
        files = [self.folder / "slurmctld.pid", self.folder / "munge" / "munged.pid"]
        files += sorted(self.folder.glob("slurmd-*.pid"))
        for pid_file in files:
            try:
                pid = int(pid_file.read_text().strip())
                exe = os.readlink(f"/proc/{pid}/exe")
            except (OSError, ValueError):
                continue
            if Path(exe).name.removesuffix("-wlm") in DAEMONS:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        return killed

    def start(self) -> DevCluster:
        self._write()
        self._munge()
        self.start_controller()
        for node in self.nodes:
            self.procs[f"slurmd-{node.name}"] = subprocess.Popen(
                [str(SBIN / "slurmd"), "-D", "-N", node.name, "-f", str(self.conf)],
                env={**os.environ, **self.env},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.wait_idle()
        return self

    def wait_idle(self, timeout: float = 30) -> None:
        def idle() -> bool:
            out = self.run("sinfo", "--json", check=False)
            if out.returncode:
                return False
            nodes = json.loads(out.stdout).get("nodes", [])
            return len(nodes) == len(self.nodes) and all(n.get("state") == "idle" for n in nodes)

        self._wait(idle, "every node idle", timeout)

    def _wait(self, ready: object, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not ready():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"dev cluster: {what} not reached in {timeout} s; logs in {self.folder / 'log'}"
                )
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"dev cluster: {name} exited {proc.returncode}; "
                        f"logs in {self.folder / 'log'}"
                    )
            time.sleep(0.05)

    def _kill(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            self._kill(name)
