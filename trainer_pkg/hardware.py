"""Hardware utilisation of a job's ranks, sampled by the launcher off the training processes.

Every :data:`DEFAULT_EVERY_S` seconds (``--hardware-every-s`` or ``TRAINBOARD_HARDWARE_EVERY_S``; 0
turns it off) a thread of the node's launcher (:mod:`trainer_pkg.launch`) reads, from ``/proc``
through psutil and from the GPU driver through NVML, and prints one ``TRAINBOARD_METRIC`` record
(:mod:`trainer_pkg.metrics`) on stdout, so it reaches the dashboard the way every metric record does
on every backend, for the built-in trainer and a user's script alike::

    TRAINBOARD_METRIC {"event":"hardware","time":1765090000.1,"node_rank":0,"interval_s":5.0,
                       "ranks":[0,1],"sys/cpu_pct":[98.5,97.0],"sys/rss_mb":[412.3,409.8],
                       "gpu_ranks":[0,1],"sys/gpu_util_pct":[95.0,12.0],...,
                       "sys/net_recv_mb_s":0.01,...}

Fields (units are in the names; MB is 10**6 bytes):

``ranks``                 the ranks found on this node (each a process whose environment has torchrun's
                          ``RANK``, the topmost such process under the launcher: a DataLoader worker
                          counts for its rank), ascending; the per-rank lists below follow this order.
``sys/cpu_pct``           CPU time of the rank's process and its children over the last interval, %
                          of one core (200 = two cores busy); absent from a rank's first sample (the
                          interval needs two readings): ``None`` there.
``sys/rss_mb``            resident memory of the rank's process and its children, MB (pages shared
                          between them are counted in each).
``gpu_ranks``             the ranks whose GPU was read: rank r with ``LOCAL_RANK`` l uses the l-th
                          device of ``CUDA_VISIBLE_DEVICES`` (all of the node's GPUs when it is unset),
                          as the trainer picks its device.
``sys/gpu_util_pct``      % of the last sample period in which a kernel ran (NVML ``utilization.gpu``).
``sys/gpu_mem_used_mb``   device memory in use, MB (NVML ``nvmlDeviceGetMemoryInfo().used``, every process).
``sys/gpu_power_w``       board power draw, W (NVML reports mW).
``sys/gpu_temp_c``        GPU core temperature, °C.
``sys/gpu_sm_clock_mhz``  SM clock, MHz.
``sys/net_recv_mb_s``, ``sys/net_sent_mb_s``   the node's network bytes over the interval, MB/s,
                          every interface but loopback (``psutil.net_io_counters(pernic=True)``).
``sys/disk_read_mb_s``, ``sys/disk_write_mb_s``   the node's block-device bytes, MB/s; absent where
                          the machine exposes no disk counters (some containers).

A GPU figure the driver does not give is ``None``; without NVML (no ``pynvml``, no driver, no GPU)
the record has no ``gpu_*`` fields. The node fields are sent by one sampler per node (``node_fields``),
stored at index ``node_rank``. A record carries at most :data:`MAX_RANKS` ranks (a longer line than
4,096 bytes could be split by another writer of the same pipe).

Cost: one reading is a few ``/proc`` files per process and five NVML calls per GPU (about a
millisecond for 8 ranks), in a daemon thread of the launcher, never of a rank: bench/overhead.py
measures it (``--hardware-every-s``).

Torch-free, and psutil is imported only when sampling starts: without it the launcher logs one line
and trains unsampled.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from typing import Any, Callable, Mapping

from trainer_pkg.metrics import HARDWARE_PREFIX, format_metric_line, print_line

DEFAULT_EVERY_S = 5.0
"""Seconds between two samples unless configured: about 17,000 records a day per node."""
MIN_EVERY_S = 1.0
"""The shortest interval accepted: the dashboard stores a sample's time in whole seconds."""
EVERY_ENV = "TRAINBOARD_HARDWARE_EVERY_S"
"""Variable setting the interval in seconds (0: no sampling); ``--hardware-every-s`` overrides it."""
SAMPLED_ENV = "TRAINBOARD_HARDWARE_SAMPLED"
"""Set to ``1`` in the ranks of a torchrun whose launcher samples them, so they do not sample
themselves again. Ranks without it (torchrun started by another supervisor, as a GPU box's, or by
the platform) sample themselves: a thread of the rank's launcher process, the script's parent for a
script, the rank's own process for the built-in trainer."""
RESCAN_EVERY = 12
"""Samples between two listings of the process tree (one read of every process's ``/proc`` stat: most
of a sample's cost), unless a rank's process is gone first. A process that appears between two listings
(a DataLoader worker) is counted from the listing that finds it on."""
MAX_RANKS = 16
"""Ranks one record carries at most (the lowest ones of the node beyond that)."""
PREFIX = HARDWARE_PREFIX
"""Every hardware series' name starts with it (reserved: a script's ``report.log`` may not use it)."""
RANK_FIELDS = ("sys/cpu_pct", "sys/rss_mb")
GPU_FIELDS = ("sys/gpu_util_pct", "sys/gpu_mem_used_mb", "sys/gpu_power_w", "sys/gpu_temp_c", "sys/gpu_sm_clock_mhz")
NODE_FIELDS = ("sys/net_recv_mb_s", "sys/net_sent_mb_s", "sys/disk_read_mb_s", "sys/disk_write_mb_s")
EVENT = "hardware"
_MB = 1e6

sampling_cpu_s = 0.0
"""CPU seconds this process's samplers have spent taking samples (``time.thread_time`` around each
:meth:`Sampler.sample`): the sampling's own cost, read by bench/overhead.py through bench/_rank_rss.py."""


def every_s(flag: float | None, env: Mapping[str, str]) -> float:
    """The sampling interval in seconds: ``flag`` (``--hardware-every-s``) if given, else
    :data:`EVERY_ENV`, else :data:`DEFAULT_EVERY_S`; 0 means off. Raises ValueError naming the
    source for a value that is not a number, is negative, or lies between 0 and :data:`MIN_EVERY_S`."""
    source, text = ("--hardware-every-s", flag) if flag is not None else (EVERY_ENV, env.get(EVERY_ENV, ""))
    if isinstance(text, str) and not text.strip():
        return DEFAULT_EVERY_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{source} must be a number of seconds (0: off), got {text!r}") from None
    if value != value or value < 0 or 0 < value < MIN_EVERY_S or value == float("inf"):
        raise ValueError(f"{source} must be 0 (off) or at least {MIN_EVERY_S:g} seconds, got {text!r}")
    return value


def _visible_devices(env: Mapping[str, str]) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as a list of indices or UUIDs; None when unset (every GPU)."""
    text = env.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return None
    return [d.strip() for d in text.split(",") if d.strip()]


class _Gpus:
    """The node's GPUs through NVML (``pynvml``; ``module`` for a test's stand-in)."""

    def __init__(self, nvml: Any, visible: list[str] | None) -> None:
        self.nvml = nvml
        self.error = getattr(nvml, "NVMLError", Exception)
        nvml.nvmlInit()
        count = int(nvml.nvmlDeviceGetCount())
        if visible is None:
            self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        else:
            self.handles = []
            for device in visible:
                if device.isdigit() and int(device) < count:
                    self.handles.append(nvml.nvmlDeviceGetHandleByIndex(int(device)))
                elif device.startswith("GPU-"):
                    self.handles.append(nvml.nvmlDeviceGetHandleByUUID(device))
                else:  # CUDA stops at the first device it cannot parse; so do we
                    break

    def read(self, local_rank: int) -> list[float | None] | None:
        """:data:`GPU_FIELDS` of the ``local_rank``-th visible GPU; None when there is no such GPU."""
        if not 0 <= local_rank < len(self.handles):
            return None
        h, nvml = self.handles[local_rank], self.nvml
        readers: tuple[Callable[[], float], ...] = (
            lambda: float(nvml.nvmlDeviceGetUtilizationRates(h).gpu),
            lambda: nvml.nvmlDeviceGetMemoryInfo(h).used / _MB,
            lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
            lambda: float(nvml.nvmlDeviceGetTemperature(h, getattr(nvml, "NVML_TEMPERATURE_GPU", 0))),
            lambda: float(nvml.nvmlDeviceGetClockInfo(h, getattr(nvml, "NVML_CLOCK_SM", 1))),
        )
        out: list[float | None] = []
        for read in readers:
            try:
                out.append(round(read(), 2))
            except self.error:
                out.append(None)  # NVML_ERROR_NOT_SUPPORTED on some boards (power on a GeForce)
        return out

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.error:
            pass


def open_gpus(env: Mapping[str, str], module: str = "pynvml") -> _Gpus | None:
    """The node's GPUs (the ones ``env``'s ``CUDA_VISIBLE_DEVICES`` shows), or None without NVML:
    ``module`` not installed, no driver, no GPU."""
    try:
        nvml = importlib.import_module(module)
    except ImportError:
        return None
    try:
        gpus = _Gpus(nvml, _visible_devices(env))
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: a machine without GPUs
        return None
    if not gpus.handles:
        gpus.close()
        return None
    return gpus


class Sampler:
    """Samples the ranks under the process ``root_pid`` (itself included) every ``interval_s`` and
    prints one record per sample (:func:`record` documents it) with ``emit``.

    ``node_rank``: this node's index (where the node fields are stored); ``node_fields``: whether
    this sampler sends them (one per node); ``self_rank``: the rank ``root_pid`` is when it is this
    process and its environment carries no ``RANK`` (a one-process job trained in the launcher).
    ``gpus``: :func:`open_gpus`'s answer (None: no GPU fields). :meth:`start` starts a daemon thread;
    :meth:`stop` ends it and closes NVML.
    """

    def __init__(self, root_pid: int, *, interval_s: float, node_rank: int = 0, node_fields: bool = True,
                 self_rank: int | None = None, gpus: _Gpus | None = None,
                 emit: Callable[[str], None] = print_line, clock: Callable[[], float] = time.time) -> None:
        import psutil  # a trainer dependency; the caller handles its absence

        self.psutil = psutil
        self.root_pid = root_pid
        self.interval_s = interval_s
        self.node_rank = node_rank
        self.node_fields = node_fields
        self.self_rank = self_rank
        self.gpus = gpus
        self.emit = emit
        self.clock = clock
        self._ranks: dict[int, tuple[int, int]] = {}  # pid -> (rank, local rank) of a rank's process
        self._cpu: dict[int, float] = {}  # pid -> its CPU seconds at the previous sample
        self._prev_rank_pids: dict[int, int] = {}  # rank -> pid at the previous sample
        self._prev_time: float | None = None
        self._tree: dict[int, tuple[Any, int, list[Any]]] = {}  # _find_ranks()'s last answer
        self._since_scan = RESCAN_EVERY
        self._prev_node: tuple[float, float, float | None, float | None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples = 0

    # -- one sample ----------------------------------------------------------------------------

    def _rank_of(self, proc: Any) -> tuple[int, int] | None:
        pid = proc.pid
        if pid not in self._ranks:
            try:
                env = proc.environ()
            except (self.psutil.Error, OSError):
                return None
            rank, local = env.get("RANK", ""), env.get("LOCAL_RANK", "")
            if not rank.isdigit() and pid == os.getpid() and self.self_rank is not None:
                rank, local = str(self.self_rank), local or "0"
            if not rank.isdigit():
                # Not cached: a rank torchrun has forked but not yet exec'd still shows torchrun's
                # environment, without RANK; the next sample reads it again.
                return None
            self._ranks[pid] = (int(rank), int(local) if local.isdigit() else 0)
        return self._ranks[pid]

    def _find_ranks(self) -> dict[int, tuple[Any, int, list[Any]]]:
        """``{rank: (its process, local rank, its descendants)}``: the topmost processes under the
        root whose environment carries ``RANK``."""
        try:
            root = self.psutil.Process(self.root_pid)
            tree = [root, *root.children(recursive=True)]
        except self.psutil.Error:
            return {}
        parents: dict[int, int] = {}
        for p in tree[1:]:
            try:
                parents[p.pid] = p.ppid()
            except self.psutil.Error:
                continue
        out: dict[int, tuple[Any, int, list[Any]]] = {}
        owner: dict[int, int] = {}  # pid -> the rank whose process it is or descends from
        for p in tree:  # children() lists parents before their children
            parent = parents.get(p.pid)
            if parent in owner:
                owner[p.pid] = owner[parent]
                out[owner[p.pid]][2].append(p)
                continue
            found = self._rank_of(p)
            if found is not None and found[0] not in out:
                owner[p.pid] = found[0]
                out[found[0]] = (p, found[1], [])
        return out

    def _cpu_and_rss(self, procs: list[Any]) -> tuple[float, float]:
        """(CPU seconds since each process's previous reading, RSS bytes) over ``procs``. A process
        first seen counts from its start when it started after the previous sample, else from now on
        (a process a listing found late must not put its whole past into one interval); one gone
        since the tree was listed counts nothing."""
        busy, rss = 0.0, 0.0
        for p in procs:
            try:
                with p.oneshot():
                    times = p.cpu_times()
                    mem = p.memory_info().rss
                    born = p.create_time()
            except self.psutil.Error:
                continue
            total = times.user + times.system
            if p.pid in self._cpu:
                busy += total - self._cpu[p.pid]
            elif self._prev_time is not None and born >= self._prev_time:
                busy += total
            self._cpu[p.pid] = total
            rss += mem
        return busy, rss

    def _node(self) -> tuple[float, float, float | None, float | None]:
        sent = recv = 0.0
        try:
            for nic, c in self.psutil.net_io_counters(pernic=True).items():
                if nic != "lo":
                    sent += c.bytes_sent
                    recv += c.bytes_recv
        except (OSError, self.psutil.Error):
            pass
        try:
            disk = self.psutil.disk_io_counters()
        except (OSError, self.psutil.Error, RuntimeError):
            disk = None
        return (recv, sent, None if disk is None else float(disk.read_bytes),
                None if disk is None else float(disk.write_bytes))

    def record(self) -> dict[str, Any]:
        """Read everything once and return the record (not printed): ``event`` ``hardware``,
        ``time`` (Unix s), ``node_rank``, ``interval_s`` (seconds since the previous reading; 0 at
        the first), ``ranks`` and the fields of the module docstring."""
        now = self.clock()
        elapsed = None if self._prev_time is None else max(now - self._prev_time, 1e-6)
        self._since_scan += 1
        if self._since_scan >= RESCAN_EVERY or not self._tree or not all(
                entry[0].is_running() for entry in self._tree.values()):
            self._tree, self._since_scan = self._find_ranks(), 0
        ranks = self._tree
        chosen = sorted(ranks)[:MAX_RANKS]
        cpu_pct: list[float | None] = []
        rss_mb: list[float | None] = []
        for rank in chosen:
            proc, _, children = ranks[rank]
            seen_before = self._prev_rank_pids.get(rank) == proc.pid
            busy, rss = self._cpu_and_rss([proc, *children])
            cpu_pct.append(round(100.0 * busy / elapsed, 2) if elapsed and seen_before else None)
            rss_mb.append(round(rss / _MB, 3))
        self._prev_rank_pids = {rank: ranks[rank][0].pid for rank in chosen}
        live = {p.pid for rank in chosen for p in (ranks[rank][0], *ranks[rank][2])}
        self._cpu = {pid: t for pid, t in self._cpu.items() if pid in live}
        out: dict[str, Any] = {"event": EVENT, "time": round(now, 3), "node_rank": self.node_rank,
                               "interval_s": round(elapsed or 0.0, 3), "ranks": chosen,
                               RANK_FIELDS[0]: cpu_pct, RANK_FIELDS[1]: rss_mb}
        if self.gpus is not None:
            gpu_ranks, columns = [], [[] for _ in GPU_FIELDS]
            for rank in chosen:
                figures = self.gpus.read(ranks[rank][1])
                if figures is None:
                    continue
                gpu_ranks.append(rank)
                for column, value in zip(columns, figures):
                    column.append(value)
            if gpu_ranks:
                out["gpu_ranks"] = gpu_ranks
                out.update(zip(GPU_FIELDS, columns))
        if self.node_fields:
            node = self._node()
            if self._prev_node is not None and elapsed:
                for name, now_v, then_v in zip(NODE_FIELDS, node, self._prev_node):
                    if now_v is not None and then_v is not None:
                        out[name] = round(max(now_v - then_v, 0.0) / _MB / elapsed, 4)
            self._prev_node = node
        self._prev_time = now
        return out

    def sample(self) -> None:
        """Take one sample and print its record (never raises: sampling must not fail a job); its CPU
        time is added to :data:`sampling_cpu_s`."""
        global sampling_cpu_s
        started = time.thread_time()
        try:
            self._sample()
        finally:
            sampling_cpu_s += time.thread_time() - started

    def _sample(self) -> None:
        try:
            record = self.record()
            line = format_metric_line(record)
        except Exception as exc:  # a /proc race, a driver hiccup: skip this sample, say why once
            if not getattr(self, "_warned", False):
                self._warned = True
                print_line(f"[launch] hardware sample skipped: {type(exc).__name__}: {exc}")
            return
        if not record["ranks"]:
            return  # none started yet (or all gone): the reading was a baseline for the next one
        self.emit(line)
        self.samples += 1

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        self.sample()  # the baseline: RSS at once, CPU and rates from the next one on
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, name="trainboard-hardware", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread (waiting for a sample under way) and close NVML."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10)
            self._thread = None
        if self.gpus is not None:
            self.gpus.close()
            self.gpus = None


def start(root_pid: int, *, interval_s: float, env: Mapping[str, str], node_rank: int = 0,
          node_fields: bool = True, self_rank: int | None = None) -> Sampler | None:
    """A started :class:`Sampler` of the ranks under ``root_pid``, GPUs from ``env``'s
    ``CUDA_VISIBLE_DEVICES``; None when ``interval_s`` is 0 or psutil is missing (one log line)."""
    if interval_s <= 0:
        return None
    try:
        importlib.import_module("psutil")
    except ImportError:
        print_line("[launch] hardware sampling is off: psutil is not installed (pip install psutil)")
        return None
    return Sampler(root_pid, interval_s=interval_s, node_rank=node_rank, node_fields=node_fields,
                   self_rank=self_rank, gpus=open_gpus(env)).start()
