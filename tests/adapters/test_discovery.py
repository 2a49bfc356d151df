"""GPU discovery: spec parsing, the simulated NVML's calls and errors, and discover() over it."""

from __future__ import annotations

import logging

import pynvml
import pytest

from gpupool.core.inventory import model_key
from gpupool.core.mig import GEOMETRIES
from gpupool.discovery import SimulatedNVML, discover, parse_spec, simulated_inventory
from gpupool.discovery.spec import GRAMMAR, PRODUCTS
from gpupool.monitors.activity import DeviceMonitor

H100 = GEOMETRIES["H100-80GB"]
SPEC = "a: 8x H100-80GB, mig=2:3g.40gb+2g.20gb+1g.10gb, nvlink=4; b: 2x A100-40GB, mig=1"


@pytest.fixture
def sim() -> SimulatedNVML:
    nvml = SimulatedNVML(SPEC)
    nvml.nvmlInit()
    return nvml


# -- spec parsing ------------------------------------------------------------------------------


def test_parse_spec_reads_nodes_models_and_options() -> None:
    a, b = parse_spec(
        " a : 8x h100-80gb , mig=2:3g.40gb+2g.20gb+1g.10gb, nvlink=4 ; b: 2×A100-40GB, mig=1;"
    )
    assert (a.name, a.count, a.model, a.mig, a.nvlink) == ("a", 8, "H100-80GB", 2, 4)
    assert (a.product_name, a.memory_mib) == ("NVIDIA H100 80GB HBM3", 81559)
    assert [a.mig_enabled(i) for i in range(8)] == [False] * 6 + [True] * 2
    assert [a.island(i) for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert (b.name, b.count, b.model, b.mig, b.nvlink) == ("b", 2, "A100-40GB", 1, 0)
    assert b.layout is None and b.starts == ()
    assert b.island(0) is None


def test_fixed_layout_is_placed_by_geometry_fit() -> None:
    (node,) = parse_spec("n: 1x H100-80GB, mig=1:1g.10gb+4g.40gb+2g.20gb")
    expected = sorted(H100.fit(["1g.10gb", "4g.40gb", "2g.20gb"]) or [], key=lambda ps: ps[1])
    assert list(zip(node.layout or (), node.starts, strict=True)) == expected
    assert [(p.name, s) for p, s in expected] == [("4g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)]
    masks = [p.mask_at(s) for p, s in expected]
    assert sum(masks) == masks[0] | masks[1] | masks[2]  # no two instances share a slot


@pytest.mark.parametrize("model", [*PRODUCTS, "L4-24GB", "H100-94GB"])
def test_every_accepted_model_comes_back_from_model_key(model: str) -> None:
    (node,) = parse_spec(f"n: 1x {model}")
    assert model_key(node.product_name, node.memory_mib) == model


@pytest.mark.parametrize(
    ("spec", "quoted"),
    [
        ("", "''"),
        (" ; ", "' ; '"),
        ("node1 4x H100-80GB", "'node1 4x H100-80GB'"),
        ("node 1: 4x H100-80GB", "'node 1'"),
        ("n: four H100-80GB", "'four H100-80GB'"),
        ("n: 0x H100-80GB", "got 0"),
        ("n: 100x H100-80GB", "got 100"),
        ("n: 4x H100-40GB", "'H100-40GB'"),
        ("n: 4x H100", "'H100'"),
        ("n: 4x H100-80GB, mig=5", "mig=5"),
        ("n: 4x H100-80GB, mig=two", "'two'"),
        ("n: 2x V100-32GB, mig=1", "V100-32GB has no MIG"),
        ("n: 2x H100-80GB, mig=1:3g.50gb", "'3g.50gb'"),
        ("n: 2x H100-80GB, mig=1:4g.40gb+4g.40gb", "'4g.40gb+4g.40gb'"),
        ("n: 2x H100-80GB, mig=1:", "mig=N:"),
        ("n: 4x H100-80GB, nvlink=3", "nvlink=3"),
        ("n: 4x H100-80GB, nvlink=1", "nvlink=1"),
        ("n: 2x H100-80GB, colour=red", "'colour=red'"),
        ("n: 2x H100-80GB, mig=1, mig=2", "'mig' given twice"),
        ("a: 1x H100-80GB; a: 1x A30-24GB", "'a' appears twice"),
    ],
)
def test_bad_specs_name_the_bad_part_and_show_the_grammar(spec: str, quoted: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_spec(spec)
    message = str(info.value)
    assert quoted in message
    assert GRAMMAR in message and "e.g. 'node1: 4x H100-80GB" in message


# -- discover() over the simulated NVML --------------------------------------------------------


def test_simulated_inventory_has_the_spec_counts_models_modes_and_labels() -> None:
    inv = simulated_inventory(SPEC + "; c: 1x V100-32GB")
    assert (inv.simulated, inv.source, inv.label, inv.notes) == (
        True,
        "simulated",
        "11 GPUs (simulated)",
        (),
    )
    a, b, c = inv.nodes
    assert [n.name for n in inv.nodes] == ["a", "b", "c"]
    assert {g.model for g in a.gpus} == {"H100-80GB"} and len(a.gpus) == 8
    assert [g.mig_mode for g in a.gpus] == ["off"] * 6 + ["fixed"] * 2
    assert [g.mig_mode for g in b.gpus] == ["off", "dynamic"]
    assert all(g.mig_capable for g in a.gpus + b.gpus)
    assert b.gpus[1].instances == ()
    (v100,) = c.gpus
    assert (v100.model, v100.mig_capable, v100.mig_mode) == ("V100-32GB", False, "off")
    assert v100.product_name == "Tesla V100-SXM2-32GB"
    assert [g.index for g in a.gpus] == list(range(8))
    assert len({g.uuid for g in inv.gpus}) == 11 and all(
        g.uuid.startswith("GPU-") for g in inv.gpus
    )
    assert simulated_inventory(SPEC).gpus == simulated_inventory(SPEC).gpus  # deterministic


def test_fixed_instances_match_geometry_fit_and_carry_mig_uuids() -> None:
    gpu = simulated_inventory(SPEC).nodes[0].gpus[7]
    fit = sorted(H100.fit(["3g.40gb", "2g.20gb", "1g.10gb"]) or [], key=lambda ps: ps[1])
    assert [(m.profile, m.start) for m in gpu.instances] == [(p.name, s) for p, s in fit]
    assert all(m.uuid and m.uuid.startswith("MIG-") for m in gpu.instances)


def test_nvlink_islands_become_peer_sets() -> None:
    a, b = simulated_inventory(SPEC).nodes
    uuids = [g.uuid for g in a.gpus]
    assert a.gpus[0].nvlink_peers == frozenset(uuids[1:4])
    assert a.gpus[5].nvlink_peers == frozenset(uuids[4:5] + uuids[6:8])
    assert all(g.nvlink_peers == frozenset() for g in b.gpus)


def test_discover_shuts_nvml_down_again() -> None:
    nvml = SimulatedNVML(SPEC)
    assert len(discover(nvml).gpus) == 8
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()


@pytest.mark.parametrize("shown_as", ["3g.39gb", "3g.47gb"])
def test_a_drifted_profile_name_still_resolves_by_profile_id(shown_as: str) -> None:
    nvml = SimulatedNVML("n: 1x H100-80GB, mig=1:3g.40gb+3g.40gb")
    nvml.rename_profile("3g.40gb", shown_as)
    nvml.nvmlInit()
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(nvml.nvmlDeviceGetHandleByIndex(0), 0)
    assert nvml.nvmlDeviceGetName(mig) == f"NVIDIA H100 80GB HBM3 MIG {shown_as}"
    nvml.nvmlShutdown()
    (gpu,) = discover(nvml).gpus
    assert [(m.profile, m.start) for m in gpu.instances] == [("3g.40gb", 0), ("3g.40gb", 4)]


def test_without_root_placements_come_from_names_and_fit_with_a_note() -> None:
    spec = "n: 1x H100-80GB, mig=1:3g.40gb+2g.20gb+1g.10gb"
    nvml = SimulatedNVML(spec, privileged=False)
    inv = discover(nvml)
    assert inv.gpus[0].instances == simulated_inventory(spec).gpus[0].instances
    assert any("needs root" in note for note in inv.notes)


@pytest.mark.parametrize(
    ("code", "says"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "no NVIDIA driver found"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "no NVIDIA driver found"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "could not start"),
    ],
)
def test_without_a_driver_discover_returns_an_empty_inventory_and_warns_once(
    code: int, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    class NoDriver(SimulatedNVML):
        def nvmlInit(self) -> None:
            raise pynvml.NVMLError(code)

    with caplog.at_level(logging.INFO, logger="gpupool.discovery"):
        inv = discover(NoDriver("n: 1x H100-80GB"))
    assert inv.gpus == () and inv.nodes == ()
    (note,) = inv.notes
    assert note.startswith(f"NVML: {says} (") and "simulated:<spec>" in note
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [note]


def test_discover_with_the_real_pynvml_finds_gpus_or_says_why_not() -> None:
    inv = discover()
    assert inv.source == "nvml" and not inv.simulated
    if not inv.gpus:
        assert len(inv.notes) == 1 and "the pool has no GPUs" in inv.notes[0]


# -- the simulated NVML behaves like NVML ------------------------------------------------------


def test_calls_before_nvml_init_raise_uninitialized() -> None:
    nvml = SimulatedNVML(SPEC)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlShutdown()
    for call in (nvml.nvmlDeviceGetUUID, nvml.nvmlDeviceGetUtilizationRates):
        with pytest.raises(pynvml.NVMLError_Uninitialized):
            call(handle)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlShutdown()


def test_bad_indexes_and_foreign_handles_raise_nvml_errors(sim: SimulatedNVML) -> None:
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlDeviceGetHandleByIndex(8)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlDeviceGetHandleByIndex(-1)
    other = sim.for_node("b")
    other.nvmlInit()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlDeviceGetUUID(other.nvmlDeviceGetHandleByIndex(0))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlDeviceGetName("GPU-0")
    with pytest.raises(pynvml.NVMLError_NotFound):
        sim.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")


def test_mig_device_handles_and_gpu_instances(sim: SimulatedNVML) -> None:
    gpu = sim.nvmlDeviceGetHandleByIndex(7)
    assert sim.nvmlDeviceGetMigMode(gpu) == [pynvml.NVML_DEVICE_MIG_ENABLE] * 2
    assert sim.nvmlDeviceGetMaxMigDeviceCount(gpu) == 7
    mig = sim.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    assert sim.nvmlDeviceIsMigDeviceHandle(mig) and not sim.nvmlDeviceIsMigDeviceHandle(gpu)
    assert sim.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig) == gpu
    assert sim.nvmlDeviceGetName(mig) == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    info = sim.nvmlGpuInstanceGetInfo(
        sim.nvmlDeviceGetGpuInstanceById(gpu, sim.nvmlDeviceGetGpuInstanceId(mig))
    )
    assert (info.profileId, info.placement.start, info.placement.size) == (9, 0, 4)
    assert sim.nvmlDeviceGetMemoryInfo(mig).total == (81559 << 20) // 2
    with pytest.raises(pynvml.NVMLError_NotFound):
        sim.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 3)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 7)
    with pytest.raises(pynvml.NVMLError_NotFound):
        sim.nvmlDeviceGetGpuInstanceById(gpu, 99)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(gpu)
    whole = sim.nvmlDeviceGetHandleByIndex(0)
    assert sim.nvmlDeviceGetMigMode(whole) == [pynvml.NVML_DEVICE_MIG_DISABLE] * 2
    assert sim.nvmlDeviceGetMaxMigDeviceCount(whole) == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetMigDeviceHandleByIndex(whole, 0)


def test_gpu_instance_profile_info_uses_nvidia_profile_ids(sim: SimulatedNVML) -> None:
    gpu = sim.nvmlDeviceGetHandleByIndex(7)
    by_index = {
        pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: (19, 1, 7),
        pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: (20, 1, 1),
        pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2: (15, 1, 4),
        pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE: (14, 2, 3),
        pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE: (9, 3, 2),
        pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE: (5, 4, 1),
        pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE: (0, 7, 1),
    }
    for index, expected in by_index.items():
        info = sim.nvmlDeviceGetGpuInstanceProfileInfo(gpu, index)
        assert (info.id, info.sliceCount, info.instanceCount) == expected
    assert sim.nvmlDeviceGetGpuInstanceProfileInfo(gpu, 2).name == "MIG 3g.40gb"
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetGpuInstanceProfileInfo(gpu, pynvml.NVML_GPU_INSTANCE_PROFILE_8_SLICE)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlDeviceGetGpuInstanceProfileInfo(gpu, pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetGpuInstanceProfileInfo(sim.nvmlDeviceGetHandleByIndex(0), 2)


def test_utilisation_is_not_supported_on_mig_devices(sim: SimulatedNVML) -> None:
    whole, mig_gpu = sim.nvmlDeviceGetHandleByIndex(0), sim.nvmlDeviceGetHandleByIndex(7)
    mig = sim.nvmlDeviceGetMigDeviceHandleByIndex(mig_gpu, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetUtilizationRates(mig)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetUtilizationRates(mig_gpu)
    sim.set_utilisation(sim.nvmlDeviceGetUUID(whole), gpu=42, memory=7)
    rates = sim.nvmlDeviceGetUtilizationRates(whole)
    assert (rates.gpu, rates.memory) == (42, 7)
    monitor = DeviceMonitor({"a": sim})
    read = monitor.sample("a", [sim.nvmlDeviceGetUUID(whole), sim.nvmlDeviceGetUUID(mig)])
    assert [s.utilisation for s in read.values()] == [42, None]
    monitor.close()
    sim.nvmlDeviceGetCount()  # the monitor's session left our own init in place


def test_processes_show_on_their_device_and_its_parent(sim: SimulatedNVML) -> None:
    gpu = sim.nvmlDeviceGetHandleByIndex(7)
    mig = sim.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 1)
    mig_uuid, gpu_uuid = sim.nvmlDeviceGetUUID(mig), sim.nvmlDeviceGetUUID(gpu)
    monitor = DeviceMonitor({"a": sim})
    assert monitor.processes("a", [mig_uuid]) == {mig_uuid: []}
    sim.set_processes(mig_uuid, [4242], used_mib=512)
    running = monitor.processes("a", [mig_uuid, gpu_uuid])
    assert running == {mig_uuid: [(4242, 512 << 20)], gpu_uuid: [(4242, 512 << 20)]}
    (proc,) = sim.nvmlDeviceGetComputeRunningProcesses(mig)
    assert proc.gpuInstanceId == sim.nvmlDeviceGetGpuInstanceId(mig)
    assert sim.nvmlDeviceGetMemoryInfo(mig).used == 512 << 20
    whole = sim.nvmlDeviceGetUUID(sim.nvmlDeviceGetHandleByIndex(0))
    assert monitor.processes("a", [whole]) == {whole: []}


def test_nvlink_p2p_status_follows_the_islands(sim: SimulatedNVML) -> None:
    h = [sim.nvmlDeviceGetHandleByIndex(i) for i in (0, 3, 4)]
    nvlink = pynvml.NVML_P2P_CAPS_INDEX_NVLINK
    assert sim.nvmlDeviceGetP2PStatus(h[0], h[1], nvlink) == pynvml.NVML_P2P_STATUS_OK
    assert sim.nvmlDeviceGetP2PStatus(h[0], h[2], nvlink) == pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlDeviceGetP2PStatus(h[0], h[1], 9)
