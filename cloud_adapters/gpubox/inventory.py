"""What a GPU box can hand out to jobs: its GPUs, or on a box without one, its process slots.

The dashboard gives each job exactly the devices it needs (one per process) and never one device to
two jobs (``jobs.admission``); this module only says which devices the box has. It runs in the box's
own worker (the submit task runs on the box's queue), because only there do NVML and the settings
describe the right machine. In order:

1. ``gpu_ids`` (host setting ``TRAINBOARD_GPUBOX_GPU_IDS``, e.g. ``"0,1,2,3"``), when set: the
   operator's own list, e.g. to keep GPU 0 for a display or another service. Indices as NVML and
   ``nvidia-smi`` number the GPUs (PCI bus order).
2. NVML (``nvidia-ml-py``, module ``pynvml``), when it finds a driver: ``nvmlDeviceGetCount``, and per
   device ``nvmlDeviceGetName`` and ``nvmlDeviceGetMemoryInfo(...).total`` (bytes). NVML numbers the
   GPUs in PCI bus order (NVML API reference, ``nvmlDeviceGetHandleByIndex``), while CUDA by default
   numbers them fastest first; the job's processes therefore get ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
   beside ``CUDA_VISIBLE_DEVICES`` (CUDA C++ Programming Guide, "CUDA Environment Variables"), so an
   index means the same GPU to both. When the worker itself runs with ``CUDA_VISIBLE_DEVICES`` of
   indices, only those GPUs are handed out; "" or "-1" hides every GPU, as in CUDA.
3. A box whose ``/dev/nvidia<N>`` device nodes show GPUs that NVML cannot list (nvidia-ml-py
   missing, a driver that does not answer) hands out nothing: every job would see every GPU, so the
   inventory raises :class:`~cloud_adapters.base.MissingDependency` saying to fix NVML or set ``gpu_ids``.
4. Slots, on a box without GPUs: ``slots`` (host setting ``TRAINBOARD_GPUBOX_SLOTS``), else the box's
   ``max_procs_per_node`` (its own default: the CPU count). A slot is a process's share of the CPUs,
   counted, not pinned.

``max_concurrent_jobs`` (host setting ``TRAINBOARD_GPUBOX_MAX_CONCURRENT_JOBS``; blank = no limit)
travels with the inventory: the most jobs the box runs at once, whatever their size.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import Any, Mapping

from cloud_adapters.base import InvalidSpec, Inventory, MissingDependency

MAX_DEVICE_INDEX = 1023  # far above any machine's GPU count; bounds what a setting may name
MAX_SLOTS = 1024  # as many as max_procs_per_node may be
MAX_CONCURRENT_JOBS = 10_000
DEV_DIR = "/dev"  # where the NVIDIA driver's device nodes are (a seam for the tests)


def parse_gpu_ids(text: Any) -> tuple[int, ...]:
    """``"0,1, 3"`` (commas or spaces) → ``(0, 1, 3)``, sorted. Raises :class:`InvalidSpec` naming
    every entry that is not a whole number 0–1023, and any repeated one; "" → ()."""
    if not isinstance(text, str):
        raise InvalidSpec(f"gpu_ids: expected GPU indices separated by commas, e.g. 0,1,2,3; got {str(text)[:40]!r}.")
    items = [t for t in re.split(r"[\s,]+", text.strip()) if t]
    bad = [t for t in items if not (t.isdigit() and int(t) <= MAX_DEVICE_INDEX)]
    if bad:
        raise InvalidSpec(f"gpu_ids: {', '.join(repr(t[:12]) for t in bad[:5])} "
                          f"{'is not a GPU index' if len(bad) == 1 else 'are not GPU indices'} (whole numbers "
                          f"0–{MAX_DEVICE_INDEX}, as nvidia-smi -L numbers the GPUs), e.g. 0,1,2,3.")
    ids = [int(t) for t in items]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise InvalidSpec(f"gpu_ids: GPU {', '.join(map(str, repeated))} is listed more than once; name each GPU once.")
    return tuple(sorted(ids))


def _pynvml():
    """The ``pynvml`` module of nvidia-ml-py, or None when it is not installed (the import seam the
    tests replace with a stand-in module in ``sys.modules``)."""
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


def nvml_gpus() -> list[tuple[int, str, int]] | None:
    """``[(index, name, total memory in bytes), ...]`` of the GPUs NVML reports, or None when NVML
    cannot be used here (nvidia-ml-py missing, no driver: ``NVMLError_LibraryNotFound``,
    ``NVMLError_DriverNotLoaded``, or any other NVML error). An empty list: a driver without GPUs."""
    nvml = _pynvml()
    if nvml is None:
        return None
    error = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except error:
        return None
    try:
        found = []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = nvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):  # releases before 11.515 return bytes
                name = name.decode("utf-8", errors="replace")
            memory = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
            found.append((index, str(name), memory))
        return found
    except error:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except error:
            pass


def _visible_indices(env: Mapping[str, str]) -> set[int] | None:
    """The worker's ``CUDA_VISIBLE_DEVICES`` as indices: None when unset or naming GPUs otherwise
    (UUIDs, MIG instances: not narrowed here), an empty set when it hides every GPU."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    items = [v.strip() for v in visible.split(",") if v.strip()]
    if not items or items[0] == "-1":
        return set()
    if not all(v.isdigit() for v in items):
        return None
    return {int(v) for v in items}


def device_nodes(env: Mapping[str, str]) -> list[str]:
    """The ``/dev/nvidia<N>`` GPU device nodes of this machine, none when the worker's
    ``CUDA_VISIBLE_DEVICES`` hides every GPU ("" or "-1")."""
    if _visible_indices(env) == set():
        return []
    try:
        return sorted(e for e in os.listdir(DEV_DIR) if re.fullmatch(r"nvidia\d+", e))
    except OSError:
        return []


def box_inventory(config: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Inventory:
    """The box's :class:`~cloud_adapters.base.Inventory` from its cleaned settings (``gpu_ids``,
    ``slots``, ``max_procs_per_node``, ``max_concurrent_jobs``) and this machine (NVML, the worker's
    ``CUDA_VISIBLE_DEVICES`` in ``env``, default ``os.environ``), in the order of the module docstring.
    Raises :class:`InvalidSpec` for a malformed ``gpu_ids`` and :class:`MissingDependency` for GPUs
    that NVML cannot list (point 3)."""
    env = os.environ if env is None else env
    limit = config.get("max_concurrent_jobs") or None
    gpu_ids = parse_gpu_ids(config.get("gpu_ids") or "")
    if gpu_ids:
        return Inventory(kind="gpu", devices=gpu_ids, source="gpu_ids setting", max_concurrent_jobs=limit)
    gpus = nvml_gpus()
    visible = _visible_indices(env)
    if gpus and visible is not None:
        gpus = [g for g in gpus if g[0] in visible]
    if gpus:
        return Inventory(kind="gpu", devices=tuple(g[0] for g in gpus), source="nvml",
                         names=tuple(g[1] for g in gpus), memory_bytes=tuple(g[2] for g in gpus),
                         max_concurrent_jobs=limit)
    if gpus is None and (nodes := device_nodes(env)):
        raise MissingDependency(
            f"this GPU box has NVIDIA devices ({', '.join(f'{DEV_DIR}/{n}' for n in nodes[:4])}"
            f"{' …' if len(nodes) > 4 else ''}) but NVML cannot list them, so it cannot give each job its own GPUs: "
            f"install nvidia-ml-py (requirements.txt) and check the driver with nvidia-smi, or set "
            f"TRAINBOARD_GPUBOX_GPU_IDS to the GPUs to hand out (e.g. 0,1,2,3).")
    if config.get("slots"):
        count, source = int(config["slots"]), "slots setting"
    else:
        count, source = int(config.get("max_procs_per_node") or os.cpu_count() or 1), "max processes per node"
    return Inventory(kind="slot", devices=tuple(range(count)), source=source, max_concurrent_jobs=limit)
