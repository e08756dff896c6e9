"""The GPU box's inventory (cloud_adapters/gpubox/inventory.py): NVML through a stand-in ``pynvml``
module at the import seam (this machine has no NVIDIA driver), GPUs set by hand, CPU slots for real;
the never-fits refusal; and the devices a real job's ranks see (read from /proc; the ranks the box's
torchrun starts, here the trainer stand-in's, held before their first step)."""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path

import pytest

from cloud_adapters.base import InvalidSpec, JobSpec, MissingDependency
from cloud_adapters.gpubox import GpuBoxBackend, inventory
from cloud_adapters.gpubox._usercode import container_command, worker_user
from devicekit import rank_environments
from polling import wait_for

GIB = 1024**3


class _NvmlError(Exception):
    pass


def fake_pynvml(devices: list[tuple[str, int]] | None, *, init_error: bool = False) -> types.ModuleType:
    """A module with the five NVML calls the inventory makes, answering for ``devices`` (name, bytes);
    ``init_error``: ``nvmlInit`` raises, as nvidia-ml-py does without a driver. Records its calls."""
    module = types.ModuleType("pynvml")
    module.calls = []
    module.NVMLError = _NvmlError

    def init():
        module.calls.append("init")
        if init_error:
            raise _NvmlError("NVML Shared Library Not Found")

    module.nvmlInit = init
    module.nvmlShutdown = lambda: module.calls.append("shutdown")
    module.nvmlDeviceGetCount = lambda: len(devices)
    module.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    module.nvmlDeviceGetName = lambda h: devices[h[1]][0].encode() if h[1] == 0 else devices[h[1]][0]
    module.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=devices[h[1]][1], free=0, used=0)
    return module


@pytest.fixture
def run_root(tmp_path) -> Path:
    return tmp_path / "runs"


def box(run_root, **config) -> GpuBoxBackend:
    return GpuBoxBackend({"run_root": str(run_root), "max_procs_per_node": 4, **config})


def test_nvml_gpus_are_the_inventory_with_their_names_and_memory(run_root, monkeypatch):
    nvml = fake_pynvml([("NVIDIA H100 80GB HBM3", 80 * GIB), ("NVIDIA H100 80GB HBM3", 80 * GIB),
                        ("NVIDIA A10", 24 * GIB)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    found = box(run_root).inventory()
    assert (found.kind, found.devices, found.source) == ("gpu", (0, 1, 2), "nvml")
    # Device 0's name comes back as bytes (older nvidia-ml-py), the others as text: both read as text.
    assert found.names == ("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3", "NVIDIA A10")
    assert found.memory_bytes == (80 * GIB, 80 * GIB, 24 * GIB)
    assert (found.capacity, found.unit(3), found.unit(1)) == (3, "3 GPUs", "1 GPU")
    assert nvml.calls == ["init", "shutdown"]


def test_the_workers_cuda_visible_devices_narrows_what_nvml_found(run_root, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([("A10", GIB)] * 4))
    assert inventory.box_inventory({"max_procs_per_node": 4}, {"CUDA_VISIBLE_DEVICES": "1,3"}).devices == (1, 3)
    hidden = inventory.box_inventory({"max_procs_per_node": 4}, {"CUDA_VISIBLE_DEVICES": "-1"})
    assert (hidden.kind, hidden.devices) == ("slot", (0, 1, 2, 3))  # no GPU visible: a CPU box
    by_uuid = inventory.box_inventory({"max_procs_per_node": 4}, {"CUDA_VISIBLE_DEVICES": "GPU-5f2a"})
    assert by_uuid.devices == (0, 1, 2, 3)  # not indices: not narrowed


def test_without_a_driver_the_box_counts_slots(run_root, monkeypatch):
    nvml = fake_pynvml(None, init_error=True)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    found = box(run_root).inventory()
    assert (found.kind, found.devices, found.source, found.names) == ("slot", (0, 1, 2, 3), "max processes per node", ())
    assert found.unit(2) == "2 slots" and nvml.calls == ["init"]
    assert box(run_root, slots=3).inventory().devices == (0, 1, 2)
    assert box(run_root, slots=3).inventory().source == "slots setting"


def test_gpus_that_nvml_cannot_list_are_not_handed_out_as_slots(run_root, monkeypatch, tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    monkeypatch.setattr(inventory, "DEV_DIR", str(dev))
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(None, init_error=True))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(MissingDependency) as excinfo:
        box(run_root).inventory()
    assert str(excinfo.value) == (
        f"this GPU box has NVIDIA devices ({dev}/nvidia0, {dev}/nvidia1) but NVML cannot list them, so it cannot "
        f"give each job its own GPUs: install nvidia-ml-py (requirements.txt) and check the driver with nvidia-smi, "
        f"or set TRAINBOARD_GPUBOX_GPU_IDS to the GPUs to hand out (e.g. 0,1,2,3).")
    with pytest.raises(InvalidSpec, match="but NVML cannot list them"):  # the job form says so too
        box(run_root).validate(JobSpec(job_name="j", config={}, procs_per_node=1))
    assert box(run_root, gpu_ids="0,1").inventory().devices == (0, 1)  # the operator's list needs no NVML
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a worker that hides its GPUs is a CPU box
    assert box(run_root).inventory().kind == "slot"


def test_the_real_nvidia_ml_py_finds_no_driver_here_and_the_box_counts_its_slots(run_root):
    # nvidia-ml-py is installed (requirements.txt); this machine has no NVIDIA driver.
    import pynvml

    assert sys.modules["pynvml"] is pynvml and inventory.nvml_gpus() is None
    found = box(run_root, max_procs_per_node=2).inventory()
    assert (found.kind, found.devices) == ("slot", (0, 1))


def test_gpus_set_by_hand_are_handed_out_even_where_nvml_sees_more(run_root, monkeypatch):
    nvml = fake_pynvml([("A10", GIB)] * 8)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    found = box(run_root, gpu_ids="3, 1,2").inventory()
    assert (found.kind, found.devices, found.source) == ("gpu", (1, 2, 3), "gpu_ids setting")
    assert nvml.calls == []  # the operator's list is the answer: NVML is not asked
    assert box(run_root, gpu_ids="0,1", max_concurrent_jobs=3).inventory().max_concurrent_jobs == 3


def test_bad_sharing_settings_are_all_reported_at_once(run_root):
    with pytest.raises(InvalidSpec) as excinfo:
        box(run_root, gpu_ids="0,x,1,1", slots=0, max_concurrent_jobs=True)
    assert excinfo.value.errors == {
        "gpu_ids": ["GPUs to hand out: 'x' is not a GPU index (whole numbers 0–1023, as nvidia-smi -L "
                    "numbers the GPUs), e.g. 0,1,2,3."],
        "slots": ["Process slots: must be 1 to 1,024 (blank = max processes per node), got 0."],
        "max_concurrent_jobs": ["Max concurrent jobs: expected a whole number, got True."],
    }
    with pytest.raises(InvalidSpec, match="GPU 1 is listed more than once"):
        box(run_root, gpu_ids="1,1")


def test_a_job_that_needs_more_devices_than_the_box_has_is_refused_with_the_arithmetic(run_root):
    backend = box(run_root, gpu_ids="0,1")
    with pytest.raises(InvalidSpec) as excinfo:
        backend.validate(JobSpec(job_name="j", config={}, procs_per_node=4))
    assert str(excinfo.value) == (
        "4 processes need 4 GPUs (one per process), but this GPU box has 2 GPUs in all (gpu_ids setting), so the "
        "job could never start; ask for 2 or fewer processes per node.")
    backend.validate(JobSpec(job_name="j", config={}, procs_per_node=2, devices=(0, 1)))
    with pytest.raises(InvalidSpec, match=r"devices \[0, 5\]: a job of 2 processes is given 2 GPUs, each once"):
        backend.validate(JobSpec(job_name="j", config={}, procs_per_node=2, devices=(0, 5)))


def test_a_container_job_is_given_its_gpus_by_docker_and_sees_them_from_zero(run_root):
    argv = container_command("img:1", ["python"], name="tb-j", user=worker_user(), workdir="/w", mounts=[],
                             env_names=[], gpus=(2, 3))
    assert argv[argv.index("--gpus") + 1] == '"device=2,3"'
    backend = box(run_root, gpu_ids="0,1,2,3")
    assert backend._device_env(JobSpec(job_name="j", config={}, procs_per_node=2, devices=(2, 3), image="img:1")) == {
        "CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert backend._container_gpus(JobSpec(job_name="j", config={}, procs_per_node=2, devices=(2, 3))) == (2, 3)


def _ranks_of(backend, spec, standin) -> dict[int, dict[str, str]]:
    """Submit ``spec``, read its ranks' environments while they are held before their first step
    (``standin``: the trainer stand-in, the backend's interpreter), then stop it."""
    standin.hold(steps=0)
    handle = backend.submit(spec)
    try:
        return wait_for(lambda: (found := rank_environments(handle.provider_job_id)) and len(found) == 2 and found,
                        timeout=90, interval=0.05, what="the job's two ranks")
    finally:
        backend.cancel(handle)
        wait_for(lambda: backend.describe(handle).state.is_terminal, timeout=60, what="the job to stop")


def test_a_real_job_s_ranks_see_exactly_their_gpus_and_the_nvml_numbering(run_root, trainer_standin):
    backend = GpuBoxBackend({"run_root": str(run_root), "max_procs_per_node": 4, "gpu_ids": "0,1,2,3",
                             "grace_period_s": 2, "python": trainer_standin.python})
    config = {"train": {"epochs": 1}, "parallel": {"procs_per_node": 2}}
    ranks = _ranks_of(backend, JobSpec(job_name="gpus-2-3", config=config, procs_per_node=2, devices=(2, 3)),
                      trainer_standin)
    # Both ranks see GPUs 2 and 3 (rank i takes the i-th by LOCAL_RANK), numbered as NVML numbers them.
    assert {r: (e["CUDA_VISIBLE_DEVICES"], e["CUDA_DEVICE_ORDER"]) for r, e in ranks.items()} == {
        0: ("2,3", "PCI_BUS_ID"), 1: ("2,3", "PCI_BUS_ID")}


def test_a_real_job_on_a_cpu_box_records_its_slots(run_root, trainer_standin):
    backend = GpuBoxBackend({"run_root": str(run_root), "max_procs_per_node": 4, "grace_period_s": 2,
                             "python": trainer_standin.python})
    assert backend.inventory().kind == "slot"
    config = {"train": {"epochs": 1}, "parallel": {"procs_per_node": 2}}
    ranks = _ranks_of(backend, JobSpec(job_name="slots-1-2", config=config, procs_per_node=2, devices=(1, 2)),
                      trainer_standin)
    assert {r: e["TRAINBOARD_SLOTS"] for r, e in ranks.items()} == {0: "1,2", 1: "1,2"}
    assert all("CUDA_DEVICE_ORDER" not in e for e in ranks.values())


def test_a_job_may_not_set_the_devices_it_sees(run_root):
    backend = box(run_root)
    with pytest.raises(InvalidSpec, match="CUDA_VISIBLE_DEVICES"):
        backend.validate(JobSpec(job_name="j", config={}, procs_per_node=1, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}))
