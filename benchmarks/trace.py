"""Where the replay's trace comes from: the public Alibaba GPU trace when it is at hand, otherwise
a small synthetic trace with the same columns and the trace's published shape.

The public trace is Alibaba's cluster-trace-gpu-v2023 (https://github.com/alibaba/clusterdata,
folder ``cluster-trace-gpu-v2023/csv/``, published for research use): the pod file
``openb_pod_list_default.csv`` and the node file ``openb_node_list_gpu_node.csv``. It is never
copied into this repository; the replay reads it from a *traces folder* holding
``alibaba-gpu-v2023/`` (or the two files directly), found in this order:

1. the ``--traces DIR`` option (a folder without the files is an error);
2. the environment variable ``GPUPOOL_TRACES`` (a folder without the files falls back to 3.);
3. ``../shared/traces`` relative to the repository root, when it holds the files;
4. otherwise a synthetic trace: :func:`synthetic_trace` with a seed, about a tenth of the
   trace's size, written to a temporary folder and read back like the real files.

The synthetic trace follows the published figures of the real one (aggregates only: no row is
taken from it): the mix of GPU requests (whole GPUs, 2/4/8-GPU pods, fractional ``gpu_milli``
shares and GPU-less pods, with the trace's frequencies), inter-arrival gaps, lifetimes and
scheduling delays (sampled from the trace's quantiles, interpolated log-linearly), QoS classes and
pod phases, and a node mix (GPU models and counts per node) sized so that the GPU pods' demand is
97.98% of the GPUs, as in the trace.
"""

from __future__ import annotations

import csv
import itertools
import math
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[1]
ENV = "GPUPOOL_TRACES"
DEFAULT_TRACES = ROOT.parent / "shared" / "traces"
SUBDIR = "alibaba-gpu-v2023"
POD_FILE = "openb_pod_list_default.csv"
NODE_FILE = "openb_node_list_gpu_node.csv"
SYNTHETIC = "synthetic"
PUBLIC_SOURCE = (
    "the real one is Alibaba cluster-trace-gpu-v2023 (https://github.com/alibaba/clusterdata, "
    "folder cluster-trace-gpu-v2023/csv/, for research use)"
)

POD_COLUMNS: tuple[str, ...] = (
    "name",
    "cpu_milli",
    "memory_mib",
    "num_gpu",
    "gpu_milli",
    "gpu_spec",
    "qos",
    "pod_phase",
    "creation_time",
    "deletion_time",
    "scheduled_time",
)
NODE_COLUMNS: tuple[str, ...] = ("sn", "cpu_milli", "memory_mib", "gpu", "model")

T = TypeVar("T")

# -- the trace's published shape (counts over its 8,152 pods and 1,213 nodes) ---------------
SYNTHETIC_PODS = 815  # a tenth of the trace
DEMAND_OF_CAPACITY = 0.9798  # the GPU pods' summed demand over the trace's 6,212 GPUs
# (num_gpu, gpu_milli): pods
GPU_REQUESTS: tuple[tuple[int, int, int], ...] = (
    (0, 0, 1088),
    (1, 1000, 3911),
    (2, 1000, 16),
    (4, 1000, 15),
    (8, 1000, 44),
    (1, 810, 1078),
    (1, 650, 253),
    (1, 590, 75),
    (1, 550, 72),
    (1, 480, 19),
    (1, 470, 750),
    (1, 460, 128),
    (1, 440, 2),
    (1, 370, 47),
    (1, 350, 6),
    (1, 330, 7),
    (1, 320, 328),
    (1, 290, 1),
    (1, 270, 4),
    (1, 230, 140),
    (1, 220, 62),
    (1, 160, 74),
    (1, 140, 1),
    (1, 110, 24),
    (1, 50, 7),
)
# (cpu_milli, memory_mib): the most frequent pod sizes, with their counts
POD_SIZES: tuple[tuple[int, int, int], ...] = (
    (3152, 5600, 1592),
    (11300, 49152, 874),
    (11908, 47104, 778),
    (11400, 48128, 534),
    (8000, 30517, 649),
    (12500, 57344, 364),
    (32000, 49152, 284),
    (18708, 64512, 255),
    (4000, 22888, 189),
)
QOS: tuple[tuple[str, int], ...] = (
    ("LS", 4647),
    ("BE", 3398),
    ("Burstable", 100),
    ("Guaranteed", 7),
)
PHASES: tuple[tuple[str, int], ...] = (
    ("Running", 5193),
    ("Failed", 1870),
    ("Pending", 897),  # never scheduled: empty scheduled_time
    ("Succeeded", 192),
)
# seconds, as (quantile, value): between pods' creation times, creation to deletion, creation to
# scheduling
ARRIVAL_GAPS = (
    (0.0, 0),
    (0.1, 6),
    (0.25, 45),
    (0.5, 161),
    (0.75, 437),
    (0.9, 948),
    (0.99, 3426),
    (1.0, 1410436),
)
LIFETIMES = (
    (0.0, 0),
    (0.1, 80),
    (0.25, 167),
    (0.5, 540),
    (0.75, 1974),
    (0.9, 6574),
    (0.99, 99719),
    (1.0, 12537496),
)
SCHEDULING_DELAYS = ((0.0, 0), (0.5, 2), (0.75, 35), (0.9, 106), (0.99, 908), (1.0, 14330))
# (gpus, model, cpu_milli, memory_mib): nodes
NODE_KINDS: tuple[tuple[int, str, int, int, int], ...] = (
    (8, "G2", 96000, 393216, 549),
    (2, "T4", 104000, 524288, 387),
    (2, "P100", 16000, 122880, 107),
    (8, "G3", 128000, 786432, 39),
    (4, "V100M16", 32000, 131072, 28),
    (2, "P100", 64000, 262144, 22),
    (8, "V100M32", 96000, 786432, 21),
    (1, "V100M16", 8000, 32768, 19),
    (4, "T4", 96000, 393216, 17),
    (4, "V100M32", 48000, 376832, 9),
    (8, "V100M16", 64000, 262144, 7),
    (1, "P100", 8000, 61440, 3),
    (2, "P100", 8000, 61440, 2),
    (1, "A10", 128000, 1048576, 2),
    (8, "V100M16", 82000, 344064, 1),
)


# -- finding the trace ------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceSource:
    """The files the replay reads, or ``folder is None`` for the synthetic trace (``why`` says
    why no real trace was found)."""

    folder: Path | None
    why: str = ""

    @property
    def pods(self) -> Path:
        assert self.folder is not None
        return self.folder / POD_FILE

    @property
    def nodes(self) -> Path:
        assert self.folder is not None
        return self.folder / NODE_FILE


def trace_folder(traces: Path) -> Path | None:
    """The folder holding the two files: ``traces/alibaba-gpu-v2023`` or ``traces`` itself."""
    for folder in (traces / SUBDIR, traces):
        if (folder / POD_FILE).is_file() and (folder / NODE_FILE).is_file():
            return folder
    return None


def locate(
    option: Path | None,
    environ: Mapping[str, str] = os.environ,
    default: Path = DEFAULT_TRACES,
) -> TraceSource:
    """Where the trace is: the option, ``$GPUPOOL_TRACES``, ``default``, else synthetic.

    ``FileNotFoundError`` when ``option`` is given and holds no trace."""
    if option is not None:
        folder = trace_folder(option)
        if folder is None:
            raise FileNotFoundError(
                f"--traces {option}: no {SUBDIR}/{POD_FILE} and {NODE_FILE} there"
            )
        return TraceSource(folder)
    if environ.get(ENV):
        given = Path(environ[ENV])
        folder = trace_folder(given)
        if folder is not None:
            return TraceSource(folder)
        return TraceSource(None, f"{ENV}={given} holds no {SUBDIR}/{POD_FILE}")
    folder = trace_folder(default)
    if folder is not None:
        return TraceSource(folder)
    return TraceSource(None, f"no {default / SUBDIR} and {ENV} is not set")


def notice(source: TraceSource) -> str:
    """The one line saying that the run is on the synthetic trace, and where the real one is."""
    return (
        f"trace: synthetic ({source.why}); {PUBLIC_SOURCE}: put its {POD_FILE} and {NODE_FILE} "
        f"in ../shared/traces/{SUBDIR}/, or point {ENV} or --traces at their folder"
    )


def label(path: Path) -> str:
    """How a trace file is named in the output: relative to the repository root if it can be."""
    try:
        return os.path.relpath(path, ROOT)
    except ValueError:  # pragma: no cover (another drive on Windows)
        return str(path)


# -- the synthetic trace ------------------------------------------------------------------------
def _quantile(rng: random.Random, table: Sequence[tuple[float, int]]) -> int:
    """A value drawn from the distribution whose quantiles ``table`` lists: log-linear between
    the listed points (``log(1 + v)``), the last value beyond the last listed quantile."""
    u = rng.random()
    for (p0, v0), (p1, v1) in itertools.pairwise(table):
        if u < p1:
            t = (u - p0) / (p1 - p0)
            lo, hi = math.log1p(v0), math.log1p(v1)
            return round(math.expm1(lo + t * (hi - lo)))
    return table[-1][1]


def _pick(rng: random.Random, weighted: Sequence[tuple[T, int]]) -> T:
    return rng.choices([v for v, _ in weighted], weights=[w for _, w in weighted])[0]


def synthetic_trace(
    seed: int = 0, pods: int = SYNTHETIC_PODS
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """``(pod rows, node rows)`` of a synthetic trace, as the CSV files' rows (every column a
    string, as :class:`csv.DictReader` reads them). The same ``seed`` gives the same trace."""
    rng = random.Random(seed)
    requests = [((g, m), n) for g, m, n in GPU_REQUESTS]
    sizes = [((c, m), n) for c, m, n in POD_SIZES]
    pod_rows: list[dict[str, str]] = []
    created = 0
    demand = 0
    for i in range(pods):
        if i:
            created += _quantile(rng, ARRIVAL_GAPS)
        num_gpu, gpu_milli = _pick(rng, requests)
        cpu_milli, memory_mib = _pick(rng, sizes)
        phase = _pick(rng, PHASES)
        scheduled = "" if phase == "Pending" else str(created + _quantile(rng, SCHEDULING_DELAYS))
        demand += num_gpu * gpu_milli
        pod_rows.append(
            {
                "name": f"synthetic-pod-{i:04d}",
                "cpu_milli": str(cpu_milli),
                "memory_mib": str(memory_mib),
                "num_gpu": str(num_gpu),
                "gpu_milli": str(gpu_milli),
                "gpu_spec": "",
                "qos": _pick(rng, QOS),
                "pod_phase": phase,
                "creation_time": str(created),
                "deletion_time": str(created + _quantile(rng, LIFETIMES)),
                "scheduled_time": scheduled,
            }
        )
    kinds = [((g, model, c, m), n) for g, model, c, m, n in NODE_KINDS]
    node_rows: list[dict[str, str]] = []
    gpus = 0
    while gpus * 1000 * DEMAND_OF_CAPACITY < demand or not node_rows:
        count, model, cpu_milli, memory_mib = _pick(rng, kinds)
        node_rows.append(
            {
                "sn": f"synthetic-node-{len(node_rows):04d}",
                "cpu_milli": str(cpu_milli),
                "memory_mib": str(memory_mib),
                "gpu": str(count),
                "model": model,
            }
        )
        gpus += count
    return pod_rows, node_rows


def write_synthetic_trace(traces: Path, seed: int = 0, pods: int = SYNTHETIC_PODS) -> Path:
    """Write a synthetic trace as ``traces/alibaba-gpu-v2023/`` (the real files' names and
    columns) and return that folder."""
    folder = traces / SUBDIR
    folder.mkdir(parents=True, exist_ok=True)
    pod_rows, node_rows = synthetic_trace(seed, pods)
    for name, columns, rows in (
        (POD_FILE, POD_COLUMNS, pod_rows),
        (NODE_FILE, NODE_COLUMNS, node_rows),
    ):
        with (folder / name).open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
    return folder
