"""The network preflight: before a run's first step, measure what its ranks' network does and stop the
run at once when it is slower than the backend allows (issue 30).

    TRAINBOARD_PREFLIGHT=1 TRAINBOARD_PREFLIGHT_MIN_BUSBW_GBPS=50 \\
        torchrun --nnodes 2 ... -m trainer_pkg.launch --config job.json

Every rank of a job runs it when :data:`ENABLE_VAR` is ``1``, before anything of its own: our trainer in
the launcher's in-process branch (:mod:`trainer_pkg.launch`), a user's script in
:mod:`trainer_pkg.rank_entry` before the script's first line. It uses ``torch.distributed`` with the
job's backend (nccl on GPUs, gloo on CPUs) in a process group of its own, destroyed before the run
starts its own, and measures, in a few seconds:

- **all-reduce bandwidth** at a few sizes (:data:`GLOO_SIZES` / :data:`NCCL_SIZES`), reported as
  nccl-tests does (its doc/PERFORMANCE.md): ``algbw = bytes / time``, ``busbw = algbw × 2(n−1)/n`` for
  an all-reduce of ``n`` ranks, in GB/s (10⁹ bytes), the time being the slowest rank's mean per
  operation; the largest size's ``busbw`` is the run's figure;
- **latency**: the slowest rank's mean time of a 4-byte all-reduce, µs;
- **pairs**: a send and a receive of :data:`GLOO_PAIR_BYTES` / :data:`NCCL_PAIR_BYTES` each way
  between every two nodes (their local rank 0; on one node, between every two ranks), in rounds of
  disjoint pairs (the circle method: at most :data:`MAX_PAIR_ROUNDS` rounds), each pair's
  ``2 × bytes / time`` in GB/s. A node in more slow pairs than any other is named.

Below the backend's minimum (:data:`MIN_BUSBW_VAR`: the bus bandwidth, and every pair's bandwidth, in
GB/s) or above its maximum latency (:data:`MAX_LATENCY_VAR`, µs), every rank reaches the same
verdict from the same all-reduced figures and exits :data:`FAILED_EXIT` before the run's first step.
Rank 0 prints one ``preflight`` record (:func:`preflight_record`; the dashboard stores it on the job and
shows it); one that stops the run is appended to ``<TRAINBOARD_MODEL_DIR>/metrics.jsonl`` too, and its
``reason`` becomes the job's failure reason. A preflight that cannot complete (a rank that never
joins, a collective that fails) stops the run with that error as its reason. One rank: nothing to
measure, skipped.

The process group's store: torch's ``env://`` store, under a prefix of its own so none of its keys is
the run's. Where rank 0 hosts that store itself (no torchrun agent store: Azure ML, the tests' torchrun),
it stays open for the life of the process: torch's store is multi-tenant, so the run's own
``init_process_group`` serves from the same one instead of binding the port a second time.

Torch-free to import: torch is imported when the preflight runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import math
import os
import socket
import time
from typing import Any, Callable, Mapping

from trainer_pkg.metrics import encode_record, format_metric_line, print_line

ENABLE_VAR = "TRAINBOARD_PREFLIGHT"
"""``1``: every rank runs the preflight before the run's first step; unset or ``0``: off."""
MIN_BUSBW_VAR = "TRAINBOARD_PREFLIGHT_MIN_BUSBW_GBPS"
"""The least bus bandwidth (and pair bandwidth) a run may start with, GB/s; unset: no minimum."""
MAX_LATENCY_VAR = "TRAINBOARD_PREFLIGHT_MAX_LATENCY_US"
"""The most a small all-reduce may take, µs; unset: no maximum."""
EVENT = "preflight"
"""The record's ``event``."""
FAILED_EXIT = 3
"""A rank's exit code when the preflight stops the run (under torchrun the job's code is torchrun's, 1)."""
TIMEOUT_S = 300
"""The preflight's process group timeout, seconds: its rendezvous and each collective."""
GLOO_SIZES = (1 << 20, 8 << 20, 32 << 20)
"""All-reduce sizes measured on gloo, bytes (float32 tensors)."""
NCCL_SIZES = (8 << 20, 64 << 20, 256 << 20)
"""All-reduce sizes measured on nccl, bytes (where a GPU link reaches its bandwidth)."""
GLOO_PAIR_BYTES, NCCL_PAIR_BYTES = 8 << 20, 64 << 20
"""Bytes of one pair message each way."""
WARMUP, ITERS, LATENCY_ITERS = 2, 5, 20
"""Untimed runs per size, timed runs per size, timed runs of the latency all-reduce."""
MAX_PAIR_ROUNDS = 15
"""Rounds of pairs at most: every pair of up to 16 nodes; on more, 15 rounds of disjoint pairs."""
MAX_RECORD_PAIRS = 24
"""Pairs a record lists, slowest first (the line stays short; ``pairs_measured`` counts them all)."""
GB = 1e9

_store: Any = None  # the env:// store: kept open so the run's own init shares rank 0's server


@dataclasses.dataclass(frozen=True)
class Limits:
    """The backend's thresholds, from the rank's environment."""

    min_busbw_gbps: float | None = None
    max_latency_us: float | None = None


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether :data:`ENABLE_VAR` turns the preflight on (``1``, ``true``, ``yes``, ``on``)."""
    env = os.environ if env is None else env
    return env.get(ENABLE_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def limits(env: Mapping[str, str] | None = None) -> tuple[Limits, list[str]]:
    """The thresholds in ``env`` and a line for each variable that is not a positive finite number
    (that one is ignored: the dashboard checks the backend's values; a job's own environment may
    still garble them)."""
    env = os.environ if env is None else env
    values: dict[str, float | None] = {}
    problems = []
    for field, name in (("min_busbw_gbps", MIN_BUSBW_VAR), ("max_latency_us", MAX_LATENCY_VAR)):
        raw = env.get(name, "").strip()
        values[field] = None
        if not raw:
            continue
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value > 0:
            values[field] = value
        else:
            problems.append(f"{name}={raw[:40]!r} is not a positive number: no such limit is applied")
    return Limits(**values), problems


def bandwidth_gbps(nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s of an all-reduce of ``nbytes`` over ``world_size`` ranks that took
    ``seconds``: ``algbw = nbytes / seconds / 10⁹``, ``busbw = algbw × 2(n−1)/n`` (nccl-tests)."""
    algbw = nbytes / seconds / GB
    return algbw, algbw * 2 * (world_size - 1) / world_size


def pair_rounds(n: int, max_rounds: int = MAX_PAIR_ROUNDS) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs ``(a, b)``, ``a < b``, of ``n`` units by the circle method: ``n − 1``
    rounds (``n`` even; ``n`` odd: ``n`` rounds, one unit resting in each) cover every pair once; at
    most ``max_rounds`` of them."""
    if n < 2:
        return []
    slots = list(range(n)) + ([None] if n % 2 else [])
    m = len(slots)
    rounds = []
    for _ in range(m - 1):
        pairs = [(slots[i], slots[m - 1 - i]) for i in range(m // 2)]
        rounds.append(sorted((min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None))
        slots = [slots[0], slots[-1], *slots[1:-1]]
    return rounds[:max_rounds]


def slow_unit(pairs: list[tuple[int, int, float]], minimum: float | None) -> int | None:
    """The unit (node, or rank on one node) to blame among ``pairs`` (``(a, b, GB/s)``): the one in
    more pairs below ``minimum`` than any other unit (with no minimum: in more pairs at or under half
    the median pair's bandwidth); None when no pair is slow, or no unit stands out (two units: the
    pair alone is named)."""
    if len(pairs) < 2:
        return None
    speeds = sorted(p[2] for p in pairs)
    cut = minimum if minimum is not None else speeds[len(speeds) // 2] / 2
    counts: dict[int, int] = {}
    for a, b, gbps in pairs:
        if gbps < cut or (minimum is None and gbps <= cut):
            counts[a] = counts.get(a, 0) + 1
            counts[b] = counts.get(b, 0) + 1
    if not counts:
        return None
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        return None
    return ranked[0][0]


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes} B"


def _gbps(value: float) -> str:
    return f"{value:.3g} GB/s"


def verdict(figures: Mapping[str, Any], lim: Limits, unit_names: list[str]) -> str:
    """The reason the run is stopped (``""``: it may start), from the measured ``figures`` (the
    record's ``busbw_gbps``, ``latency_us``, ``sizes`` and ``pairs``) and ``lim``; ``unit_names``
    names each pair's unit, e.g. ``node 1 (ip-10-0-0-7)``. Every rank computes the same verdict."""
    problems = []
    nodes = figures.get("nodes", 1)
    shape = (f"{figures.get('world_size')} ranks on {nodes} node{'s' if nodes != 1 else ''}, "
             f"{figures.get('backend')}")
    if lim.min_busbw_gbps is not None and figures["busbw_gbps"] < lim.min_busbw_gbps:
        largest = figures["sizes"][-1]["bytes"] if figures.get("sizes") else 0
        problems.append(f"all-reduce bus bandwidth {_gbps(figures['busbw_gbps'])} is below the backend's minimum "
                        f"of {lim.min_busbw_gbps:g} GB/s ({shape}, {_size(largest)})")
    if lim.max_latency_us is not None and figures["latency_us"] > lim.max_latency_us:
        problems.append(f"all-reduce latency {figures['latency_us']:.0f} µs is above the backend's maximum of "
                        f"{lim.max_latency_us:g} µs ({shape})")
    pairs = [(p["units"][0], p["units"][1], p["gbps"]) for p in figures.get("pairs", [])]
    if lim.min_busbw_gbps is not None:
        slow = sorted((p for p in pairs if p[2] < lim.min_busbw_gbps), key=lambda p: p[2])
        if slow:
            blamed = slow_unit(pairs, lim.min_busbw_gbps)
            named = ", ".join(f"{unit_names[a]} ↔ {unit_names[b]} {_gbps(g)}" for a, b, g in slow[:3])
            more = f" and {len(slow) - 3} more" if len(slow) > 3 else ""
            if blamed is not None:
                problems.append(f"{unit_names[blamed]} is slow: it is in {sum(blamed in p[:2] for p in slow)} of "
                                f"the {len(slow)} pairs below {lim.min_busbw_gbps:g} GB/s ({named}{more})")
            elif len(pairs) == 1:
                problems.append(f"the pair {named} is below {lim.min_busbw_gbps:g} GB/s")
            else:
                problems.append(f"{len(slow)} of {len(pairs)} pairs are below {lim.min_busbw_gbps:g} GB/s "
                                f"({named}{more})")
    if not problems:
        return ""
    return "Preflight: " + "; ".join(problems) + ". The run was stopped before its first step."


def preflight_record(figures: Mapping[str, Any], lim: Limits, reason: str) -> dict[str, Any]:
    """The ``preflight`` record rank 0 prints: ``figures`` (``time``, ``world_size``, ``nodes``,
    ``backend``, ``device``, ``busbw_gbps``, ``algbw_gbps``, ``latency_us``, ``sizes``: [{``bytes``,
    ``time_us``, ``algbw_gbps``, ``busbw_gbps``}], ``pairs``: [{``units``, ``ranks``, ``hosts``,
    ``gbps``}] slowest first, at most :data:`MAX_RECORD_PAIRS`, ``pairs_measured``, ``pair_unit``
    "node" | "rank", ``slow_unit``, ``duration_s``), the thresholds (None: none), ``ok`` and
    ``reason``."""
    record = {"event": EVENT, **figures, "min_busbw_gbps": lim.min_busbw_gbps,
              "max_latency_us": lim.max_latency_us, "ok": not reason, "reason": reason}
    record["pairs"] = sorted(record.get("pairs", []), key=lambda p: p["gbps"])[:MAX_RECORD_PAIRS]
    return record


def _emit(record: dict[str, Any], env: Mapping[str, str]) -> None:
    """Rank 0: the record on stdout (the job's log, which the dashboard reads) and, when it stops the
    run, in ``<TRAINBOARD_MODEL_DIR>/metrics.jsonl`` too, where the launcher finds its reason
    (:func:`trainer_pkg.launch.failure_message`). A passing record stays out of that file: our trainer
    starts a fresh run's file anew, and the hang watchdog reads it from the offset it saw at the start."""
    print_line(format_metric_line(record))
    directory = env.get("TRAINBOARD_MODEL_DIR", "").strip()
    if record["reason"] and directory and "://" not in directory:
        try:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, "metrics.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps(encode_record(record), sort_keys=True, allow_nan=False) + "\n")
        except OSError:
            pass  # the log has it


def maybe_run(dist_backend: str = "auto", env: Mapping[str, str] | None = None) -> int | None:
    """In a rank: run the preflight when :data:`ENABLE_VAR` asks for it and there are several ranks.
    Returns None when the run may start (or the preflight is off), :data:`FAILED_EXIT` when it must
    stop (rank 0 printed the record with the reason; the caller exits with the code).
    ``dist_backend``: "auto" (nccl where CUDA is, else gloo), "nccl" or "gloo"."""
    env = os.environ if env is None else env
    if not enabled(env):
        return None
    rank, world_size = int(env.get("RANK", "0") or 0), int(env.get("WORLD_SIZE", "1") or 1)
    if world_size < 2:
        if rank == 0:
            print_line("[preflight] one rank: no network to measure, skipped")
        return None
    lim, problems = limits(env)
    for problem in problems if rank == 0 else ():
        print_line(f"[preflight] {problem}")
    started = time.time()
    try:
        figures, names = measure(dist_backend, env)
        reason = verdict(figures, lim, names)
    except Exception as exc:  # a rank that never joined, a collective that failed: no network to train on
        figures, names = {"time": round(started, 3), "world_size": world_size}, []
        reason = (f"Preflight: the network check could not complete on rank {rank}: {type(exc).__name__}: "
                  f"{str(exc).strip()[:400]}. The run was stopped before its first step.")
        print_line(f"[preflight] rank {rank}: {reason}")
    if rank == 0:
        record = preflight_record(figures, lim, reason)
        if "busbw_gbps" in figures:
            print_line(f"[preflight] {figures['world_size']} ranks on {figures['nodes']} node(s), "
                       f"{figures['backend']}: all-reduce bus bandwidth {_gbps(figures['busbw_gbps'])}, latency "
                       f"{figures['latency_us']:.0f} µs; slowest pair "
                       + (f"{record['pairs'][0]['gbps']:.3g} GB/s" if record["pairs"] else "none")
                       + f" ({figures['duration_s']:.1f} s)")
        print_line(f"[preflight] {reason}" if reason else "[preflight] passed: the run starts")
        _emit(record, env)
    return FAILED_EXIT if reason else None


def measure(dist_backend: str, env: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    """The figures of :func:`preflight_record` measured across every rank of the job, and the pair
    units' names; every rank returns the same ones. Collective: every rank must call it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.rendezvous import rendezvous

    global _store
    started = time.time()
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_world = int(env.get("LOCAL_WORLD_SIZE") or world_size)
    local_rank = int(env.get("LOCAL_RANK") or rank % local_world)
    cuda = torch.cuda.is_available()
    backend = ("nccl" if cuda else "gloo") if dist_backend == "auto" else dist_backend
    device = (torch.device("cuda", local_rank % torch.cuda.device_count()) if backend == "nccl"
              else torch.device("cpu"))
    timeout = dt.timedelta(seconds=TIMEOUT_S)
    if _store is None:
        _store, _, _ = next(rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    store = dist.PrefixStore(f"trainboard-preflight-{int(env.get('TORCHELASTIC_RESTART_COUNT') or 0)}", _store)
    nodes = max(1, world_size // local_world) if world_size % local_world == 0 else 1
    node_of = [r // local_world if nodes > 1 else 0 for r in range(world_size)]
    units = [r for r in range(world_size) if nodes == 1 or r % local_world == 0]  # pair units' ranks
    store.set(f"host/{rank}", socket.gethostname()[:100])

    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            figures = _measure_in_group(torch, dist, device, backend, world_size, units)
        hosts = [store.get(f"host/{r}").decode("utf-8", "replace") for r in range(world_size)]
    finally:
        dist.destroy_process_group()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    unit = "node" if nodes > 1 else "rank"
    names = [f"{unit} {node_of[r] if nodes > 1 else r} ({hosts[r]})" for r in units]
    for pair in figures["pairs"]:
        a, b = pair["ranks"]
        pair["hosts"] = [hosts[a], hosts[b]]
    pairs = [(p["units"][0], p["units"][1], p["gbps"]) for p in figures["pairs"]]
    blamed = slow_unit(pairs, None)
    figures.update(time=round(started, 3), world_size=world_size, nodes=nodes, backend=backend,
                   device=device.type, pair_unit=unit,
                   slow_unit=None if blamed is None else {"unit": blamed, "name": names[blamed]},
                   duration_s=round(time.time() - started, 3))
    return figures, names


def _timed(torch: Any, dist: Any, device: Any, body: Callable[[], None], iters: int) -> float:
    """The slowest rank's mean seconds per call of ``body`` (after :data:`WARMUP` untimed calls)."""
    for _ in range(WARMUP):
        body()
    _sync(torch, device)
    fence = torch.zeros(1, device=device)
    dist.all_reduce(fence)  # every rank starts the clock together
    _sync(torch, device)
    t0 = time.perf_counter()
    for _ in range(iters):
        body()
    _sync(torch, device)
    took = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took.item())


def _sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure_in_group(torch: Any, dist: Any, device: Any, backend: str, world_size: int,
                      units: list[int]) -> dict[str, Any]:
    rank = dist.get_rank()
    small = torch.ones(1, dtype=torch.float32, device=device)
    latency_s = _timed(torch, dist, device, lambda: dist.all_reduce(small), LATENCY_ITERS)
    sizes = []
    for nbytes in (NCCL_SIZES if backend == "nccl" else GLOO_SIZES):
        tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        seconds = _timed(torch, dist, device, lambda: dist.all_reduce(tensor), ITERS)
        algbw, busbw = bandwidth_gbps(nbytes, seconds, world_size)
        sizes.append({"bytes": nbytes, "time_us": round(seconds * 1e6, 1), "algbw_gbps": round(algbw, 4),
                      "busbw_gbps": round(busbw, 4)})
        del tensor

    # Pairs: the lower unit of each pair times a message each way; the others wait at the round's fence.
    pair_bytes = NCCL_PAIR_BYTES if backend == "nccl" else GLOO_PAIR_BYTES
    rounds = pair_rounds(len(units))
    flat = [pair for round_ in rounds for pair in round_]
    took = torch.zeros(max(len(flat), 1), dtype=torch.float64, device=device)
    message = torch.ones(pair_bytes // 4, dtype=torch.float32, device=device)
    index = 0
    for round_ in rounds:
        for a, b in round_:
            ra, rb = units[a], units[b]
            if rank in (ra, rb):
                peer = rb if rank == ra else ra

                def exchange() -> None:
                    if rank == ra:
                        dist.send(message, peer)
                        dist.recv(message, peer)
                    else:
                        dist.recv(message, peer)
                        dist.send(message, peer)

                for _ in range(WARMUP):
                    exchange()
                _sync(torch, device)
                t0 = time.perf_counter()
                for _ in range(ITERS):
                    exchange()
                _sync(torch, device)
                if rank == ra:
                    took[index] = (time.perf_counter() - t0) / ITERS
            index += 1
        dist.all_reduce(torch.zeros(1, device=device))  # the round's fence
    dist.all_reduce(took)  # each pair's time from its lower rank, to every rank
    pairs = [{"units": [a, b], "ranks": [units[a], units[b]],
              "gbps": round(2 * pair_bytes / float(took[i].item()) / GB, 4)}
             for i, (a, b) in enumerate(flat)]
    largest = sizes[-1]
    return {"busbw_gbps": largest["busbw_gbps"], "algbw_gbps": largest["algbw_gbps"],
            "latency_us": round(latency_s * 1e6, 1), "sizes": sizes, "pairs": pairs,
            "pairs_measured": len(pairs)}
