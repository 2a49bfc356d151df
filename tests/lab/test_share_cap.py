"""The cooperative cap of a GPU share in the kernel (``gpupool_lab.share_cap`` and the IPython
startup file): which fraction, when it is armed, and that it is silent and harmless, tested with
the real PyTorch CPU wheel (no CUDA: the cap is queued and never runs) and in a real IPython
kernel started with ``PYTHONSTARTUP`` as the local spawner sets it. Where CUDA would run the cap,
a stand-in ``torch`` records the call (there is no GPU here).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

import gpupool_lab
from gpupool_lab import share_cap
from gpupool_lab.share_cap import CONTEXT_MIB, SharePlan, install, plan, share_fraction

STARTUP = Path(gpupool_lab.__file__).parent / "ipython_startup.py"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"GPUPOOL_SHARE_MILLI": ""}, None),
        ({"GPUPOOL_SHARE_MILLI": "abc"}, None),
        ({"GPUPOOL_SHARE_MILLI": "0"}, None),
        ({"GPUPOOL_SHARE_MILLI": "1000"}, None),  # a whole GPU is not a share
        ({"GPUPOOL_SHARE_MILLI": "250"}, SharePlan(250, None)),
        ({"GPUPOOL_SHARE_MILLI": "250", "GPUPOOL_SHARE_MIB": "6144"}, SharePlan(250, 6144)),
        ({"GPUPOOL_SHARE_MILLI": "250", "GPUPOOL_SHARE_MIB": "-3"}, SharePlan(250, None)),
    ],
)
def test_the_plan_comes_from_the_hubs_variables(
    env: dict[str, str], expected: SharePlan | None
) -> None:
    assert plan(env) == expected


def test_the_fraction_leaves_room_for_the_cuda_context() -> None:
    assert share_fraction(SharePlan(250, 6144), 24576) == (6144 - CONTEXT_MIB) / 24576
    assert share_fraction(SharePlan(250, None), 24576) == (6144 - CONTEXT_MIB) / 24576
    assert share_fraction(SharePlan(25, 600), 24576) == 300 / 24576  # at least half the share
    assert share_fraction(SharePlan(250, 99999), 24576) == (24576 - CONTEXT_MIB) / 24576
    assert share_fraction(SharePlan(250, 6144), 0) is None


class StandIn:
    """A ``torch`` as far as the cap uses it: ``cuda._lazy_call``, the device's memory and
    ``set_per_process_memory_fraction`` (records its calls, or fails when told to)."""

    def __init__(self, total_mib: int = 24576, fail: bool = False) -> None:
        self.queued: list[Any] = []
        self.calls: list[tuple[float, int]] = []

        def set_fraction(fraction: float, device: int) -> None:
            if fail:
                raise RuntimeError("CUDA error: out of memory")
            self.calls.append((fraction, device))

        self.module = ModuleType("torch")
        self.module.cuda = SimpleNamespace(  # type: ignore[attr-defined]
            _lazy_call=self.queued.append,
            get_device_properties=lambda d: SimpleNamespace(total_memory=total_mib << 20),
            set_per_process_memory_fraction=set_fraction,
        )


def test_without_a_share_nothing_is_armed() -> None:
    before = list(sys.meta_path)
    fake = StandIn()
    assert install({}, {"torch": fake.module}) == "none"
    assert fake.queued == [] and sys.meta_path == before


def test_with_torch_loaded_the_cap_is_queued_for_cudas_first_use_on_device_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake = StandIn()
    env = {"GPUPOOL_SHARE_MILLI": "250", "GPUPOOL_SHARE_MIB": "6144"}
    assert install(env, {"torch": fake.module}) == "armed"
    assert fake.calls == []  # nothing runs before CUDA does
    (cap,) = fake.queued
    cap()  # CUDA's lazy init runs it
    assert fake.calls == [((6144 - CONTEXT_MIB) / 24576, 0)]
    assert capsys.readouterr() == ("", "")


def test_a_failing_cap_is_silent_and_harmless(capsys: pytest.CaptureFixture[str]) -> None:
    fake = StandIn(fail=True)
    assert install({"GPUPOOL_SHARE_MILLI": "500"}, {"torch": fake.module}) == "armed"
    fake.queued[0]()
    assert fake.calls == [] and capsys.readouterr() == ("", "")
    no_lazy = ModuleType("torch")
    no_lazy.cuda = SimpleNamespace()  # type: ignore[attr-defined]
    assert install({"GPUPOOL_SHARE_MILLI": "500"}, {"torch": no_lazy}) == "unavailable"


def test_before_torch_is_imported_an_import_hook_waits_for_it() -> None:
    env = {"GPUPOOL_SHARE_MILLI": "250"}
    try:
        assert install(env, {}) == "waiting"
        hooks = [f for f in sys.meta_path if isinstance(f, share_cap._ArmAfterImport)]
        assert len(hooks) == 1
        assert install(env, {}) == "waiting"  # not twice
        assert len([f for f in sys.meta_path if isinstance(f, share_cap._ArmAfterImport)]) == 1
        assert hooks[0].find_spec("numpy") is None  # other imports are left alone
    finally:
        for f in [f for f in sys.meta_path if isinstance(f, share_cap._ArmAfterImport)]:
            sys.meta_path.remove(f)


PROBE = """
import json, sys
exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"), {"__name__": "__main__"})
import torch
from gpupool_lab import share_cap
hooks = [f for f in sys.meta_path if isinstance(f, share_cap._ArmAfterImport)]
x = torch.ones(4).sum().item()
print(json.dumps({
    "queued": len(torch.cuda._queued_calls),
    "initialized": torch.cuda.is_initialized(),
    "hooks": len(hooks),
    "loader": type(torch.__spec__.loader).__name__,
    "same_loader": torch.__loader__ is torch.__spec__.loader,
    "x": x,
}))
"""


def probe(env: dict[str, str]) -> tuple[dict[str, Any], str]:
    """Run the startup file, then ``import torch``, in a fresh Python: what torch looks like,
    and everything else the process wrote."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(STARTUP)],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", **env},
        timeout=120,
        check=True,
    )
    *noise, last = done.stdout.splitlines()
    return json.loads(last), "\n".join(noise) + done.stderr


def test_with_the_real_cpu_wheel_the_hook_queues_the_cap_and_says_nothing() -> None:
    plain, plain_noise = probe({})
    shared, shared_noise = probe({"GPUPOOL_SHARE_MILLI": "250", "GPUPOOL_SHARE_MIB": "6144"})
    assert shared["queued"] == plain["queued"] + 1  # armed once torch was imported
    assert shared["initialized"] is False  # importing torch made no CUDA context
    assert shared["hooks"] == 0  # the import hook removed itself
    assert shared["loader"] == plain["loader"] != "_Chained" and shared["same_loader"]
    assert shared["x"] == 4.0
    assert shared_noise == plain_noise == ""


def test_a_real_kernel_started_with_the_local_spawners_pythonstartup_is_capped(
    tmp_path: Path,
) -> None:
    """The local spawner's way: ``PYTHONSTARTUP`` names the startup file; IPython runs it in
    the kernel, which then imports torch without a word and with the cap queued."""
    from jupyter_client.manager import start_new_kernel

    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "IPYTHONDIR": str(tmp_path / "ipython"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "CUDA_VISIBLE_DEVICES": "",
        "GPUPOOL_SHARE_MILLI": "250",
        "GPUPOOL_SHARE_MIB": "6144",
        "PYTHONSTARTUP": str(STARTUP),
    }
    km, kc = start_new_kernel(
        kernel_name="python3", env=env, extra_arguments=[], startup_timeout=120
    )
    outputs: list[str] = []

    def collect(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            outputs.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            outputs.append("\n".join(msg["content"]["traceback"]))

    try:
        code = (
            "import sys, torch\n"
            "from gpupool_lab import share_cap\n"
            "print(sorted(k for k in dir() if 'gpupool' in k.lower()),"
            " len(torch.cuda._queued_calls), torch.cuda.is_initialized())\n"
        )
        reply = kc.execute_interactive(code, output_hook=collect, timeout=120)
        assert reply["content"]["status"] == "ok", outputs
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    # the startup file left no name of its own; the cap was queued; no CUDA context
    queued = int("".join(outputs).split()[-2])
    plain, _ = probe({})  # torch's own queued calls, without a share
    assert "".join(outputs).startswith("[] ") and queued == plain["queued"] + 1, outputs
    assert "".join(outputs).strip().endswith("False")
