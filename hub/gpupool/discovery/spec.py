"""Simulated-inventory specs: ``"node1: 4x H100-80GB, mig=2; node2: 2x A100-40GB"``.

Vocabulary
- *spec*: one or more *node specs* separated by ``;``.
- *node spec*: ``NAME ':' COUNT 'x' MODEL (',' OPTION)*``, where MODEL is a gpupool model key
  (``H100-80GB``, ``V100-32GB``) and OPTION is one of
  ``mig=N`` (the last N GPUs have MIG on, no instances yet: *dynamic* mode),
  ``mig=N:PROFILE+PROFILE+…`` (the last N GPUs have MIG on with these instances pre-created:
  *fixed* mode, placed by :meth:`Geometry.fit`) and
  ``nvlink=K`` (NVLink islands of K consecutive GPUs; default: no NVLink).
- *product*: what NVML would report for a model: its product name and memory in MiB.

Contract: :func:`parse_spec` is pure and either returns frozen :class:`NodeSpec` objects or raises
``ValueError`` quoting the bad part, the grammar and an example. Every model key it accepts is one
that :func:`gpupool.core.inventory.model_key` gives back for the simulated product, so discovery
over the simulated NVML reports the model the spec asked for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from gpupool.core.inventory import model_key
from gpupool.core.mig import GEOMETRIES, Profile

GRAMMAR = (
    "expected 'NAME: COUNTx MODEL[, mig=N | mig=N:PROFILE+PROFILE… | nvlink=K]…', "
    "nodes separated by ';', e.g. 'node1: 4x H100-80GB, mig=2:3g.40gb+4g.40gb, nvlink=2; "
    "node2: 2x A100-40GB'"
)

# Product names and total memory as NVML reports them (nvidia-smi's "MiB" column).
PRODUCTS: dict[str, tuple[str, int]] = {
    "H100-80GB": ("NVIDIA H100 80GB HBM3", 81559),
    "A100-40GB": ("NVIDIA A100-SXM4-40GB", 40960),
    "A100-80GB": ("NVIDIA A100-SXM4-80GB", 81920),
    "H200-141GB": ("NVIDIA H200", 143771),
    "A30-24GB": ("NVIDIA A30", 24576),
    "V100-32GB": ("Tesla V100-SXM2-32GB", 32768),
}

_NODE = re.compile(r"^(?P<name>[^:]*):(?P<body>.*)$", re.S)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_GPUS = re.compile(r"^(?P<count>\d+)\s*[x×]\s*(?P<model>\S+)$", re.I)
_MODEL = re.compile(r"^(?P<family>[A-Z0-9]+)-(?P<gb>\d+)GB$")
_OPTION = re.compile(r"^(?P<key>[a-z]+)\s*=\s*(?P<value>.*)$", re.I)
MAX_GPUS_PER_NODE = 64


@dataclass(frozen=True)
class NodeSpec:
    """One simulated node: ``count`` GPUs of ``model``; the last ``mig`` of them have MIG on."""

    name: str
    count: int
    model: str
    product_name: str
    memory_mib: int
    mig: int = 0
    layout: tuple[Profile, ...] | None = None  # pre-created instances (fixed mode), by start
    starts: tuple[int, ...] = ()
    nvlink: int = 0

    def mig_enabled(self, index: int) -> bool:
        return index >= self.count - self.mig

    def island(self, index: int) -> int | None:
        """The NVLink island of GPU ``index``, or ``None`` without NVLink."""
        return index // self.nvlink if self.nvlink else None


def parse_spec(spec: str) -> tuple[NodeSpec, ...]:
    """Parse a simulated-inventory spec (see the module docstring); raise ``ValueError``."""
    parts = [p.strip() for p in spec.split(";")]
    if not any(parts):
        raise ValueError(f"empty simulated inventory spec {spec!r}; {GRAMMAR}")
    nodes = tuple(_parse_node(p) for p in parts if p)
    names = [n.name for n in nodes]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"node {dupes[0]!r} appears twice in {spec!r}; {GRAMMAR}")
    return nodes


def product(model: str) -> tuple[str, int]:
    """NVML's product name and memory (MiB) for a model key; ``ValueError`` if NVML has none."""
    m = _MODEL.match(model)
    if m is None:
        raise ValueError(f"model {model!r} is not a model key like 'H100-80GB'; {GRAMMAR}")
    if model in PRODUCTS:
        return PRODUCTS[model]
    memory = int(m["gb"]) * 1024
    for name in (f"NVIDIA {m['family']}", m["family"]):
        if model_key(name, memory) == model:
            return name, memory
    known = ", ".join(sorted(PRODUCTS))
    raise ValueError(
        f"model {model!r} is not a GPU NVML would report (known: {known}, or another family "
        f"with its marketed memory, like 'L4-24GB'); {GRAMMAR}"
    )


def _fail(part: str, why: str) -> ValueError:
    return ValueError(f"bad simulated inventory spec {part!r}: {why}; {GRAMMAR}")


def _parse_node(part: str) -> NodeSpec:
    m = _NODE.match(part)
    if m is None:
        raise _fail(part, "no 'NAME:' in front")
    name, items = m["name"].strip(), [i.strip() for i in m["body"].split(",")]
    if not _NAME.match(name):
        raise _fail(part, f"node name {name!r} must be letters, digits, '.', '_' or '-'")
    gpus = _GPUS.match(items[0])
    if gpus is None:
        raise _fail(part, f"{items[0]!r} is not 'COUNTx MODEL'")
    count, model = int(gpus["count"]), gpus["model"].upper()
    if not 1 <= count <= MAX_GPUS_PER_NODE:
        raise _fail(part, f"COUNT must be 1 to {MAX_GPUS_PER_NODE}, got {count}")
    try:
        product_name, memory_mib = product(model)
    except ValueError as e:
        raise _fail(part, str(e).split(";")[0]) from None
    node = NodeSpec(name, count, model, product_name, memory_mib)
    seen: set[str] = set()
    for item in items[1:]:
        opt = _OPTION.match(item)
        if opt is None or opt["key"].lower() not in ("mig", "nvlink"):
            raise _fail(part, f"unknown option {item!r} (options: mig=N, mig=N:LAYOUT, nvlink=K)")
        key = opt["key"].lower()
        if key in seen:
            raise _fail(part, f"option {key!r} given twice")
        seen.add(key)
        node = _with_option(node, part, key, opt["value"].strip())
    return node


def _with_option(node: NodeSpec, part: str, key: str, value: str) -> NodeSpec:
    if key == "nvlink":
        k = _number(part, "nvlink", value)
        if k < 2 or node.count % k:
            raise _fail(part, f"nvlink={k}: K must be 2 or more and divide COUNT ({node.count})")
        return replace(node, nvlink=k)
    count, _, layout = value.partition(":")
    n = _number(part, "mig", count.strip())
    if n > node.count:
        raise _fail(part, f"mig={n} but the node has only {node.count} GPUs")
    geometry = GEOMETRIES.get(node.model)
    if geometry is None and (n or layout.strip()):
        models = ", ".join(GEOMETRIES)
        raise _fail(part, f"{node.model} has no MIG (MIG models: {models})")
    if not layout.strip():
        if ":" in value:
            raise _fail(part, "'mig=N:' needs profiles, e.g. 'mig=2:3g.40gb+4g.40gb'")
        return replace(node, mig=n)
    if geometry is None:  # mig=0 on a model without MIG
        return node
    profiles = []
    for name in layout.split("+"):
        profile = geometry.resolve(name.strip())
        if profile is None:
            known = ", ".join(p.name for p in geometry.profiles)
            raise _fail(part, f"{name.strip()!r} is not a {node.model} profile ({known})")
        profiles.append(profile)
    placed = geometry.fit(profiles)
    if placed is None:
        raise _fail(part, f"{layout.strip()!r} does not fit one {node.model}")
    placed.sort(key=lambda ps: ps[1])
    return replace(
        node, mig=n, layout=tuple(p for p, _ in placed), starts=tuple(s for _, s in placed)
    )


def _number(part: str, key: str, value: str) -> int:
    if not value.isdigit():
        raise _fail(part, f"{key}= needs a whole number, got {value!r}")
    return int(value)
