"""What bounds a run, in one line (issue 30): from the per-rank timing the trainer records and the GPU
utilisation the launcher samples, e.g.

    input-bound: ranks wait for data 38 % of each step
    sync-bound: ranks spend 45 % of each step in the gradient sync and the optimizer, 30 % waiting for
        rank 3, the slowest to reach it
    compute-bound: forward and backward take 85 % of each step; GPU 2 of node 1 (rank 6) at 12 % while
        the others are at 95 %

**The timing** is each rank's latest record (``jobs.selectors.training_job_rank_throughput``: the
trainer's averages over the window since its previous record), in seconds per step. A rank's step is
``data_wait_s + step_time_s`` (``step_time_s`` = ``compute_s`` + ``sync_wait_s``: the trainer's step
time excludes waiting for the batch). The shares are over all ranks together: data share = Σ data wait
/ Σ step, and so on; waiting for the slowest = Σ (the slowest rank's data wait + compute − the rank's
own) / Σ step, the part of the sync wait a faster rank spends before the slowest arrives (the
trainer's ``wait_for_slowest_s`` per step).

- **input-bound** when the data share is at least :data:`INPUT_BOUND_PCT` and not below the sync share;
- else **sync-bound** when the sync share is at least :data:`SYNC_BOUND_PCT`;
- else **compute-bound**.

**The GPUs** are each GPU's mean ``sys/gpu_util_pct`` over its recent samples (the caller's window: the
last two 256-second buckets, :func:`jobs.selectors.training_job_bound`). A GPU is named when it is at
least :data:`GPU_BEHIND_POINTS` percentage points below the median of the others: the lowest such one,
by its node (rank // processes per node), its index on the node (rank % processes per node, the
``LOCAL_RANK`` that picks the device) and its rank. A run without timing (a user's script) is judged
from the GPUs alone: compute-bound when their mean is at least :data:`GPU_BUSY_PCT`, else
"GPUs underused".

Percentages are shown whole (``format(x, ".0f")``). A leaf module: it imports nothing from the project.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Mapping, Sequence

INPUT_BOUND_PCT = 20.0
"""A run whose ranks wait for data at least this % of each step is input-bound."""
SYNC_BOUND_PCT = 30.0
"""A run whose ranks spend at least this % of each step in the sync (and optimizer) is sync-bound."""
GPU_BEHIND_POINTS = 30.0
"""A GPU this many percentage points below the median of the others stands out."""
GPU_BUSY_PCT = 80.0
"""GPUs at least this busy on average bound a run that reports no timing (compute-bound)."""
WAITING_SHOWN_PCT = 1.0
"""The share of a step spent waiting for the slowest rank that a sync-bound line names (below: noise)."""


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else None


def _pct(value: float) -> str:
    return f"{value:.0f} %"


def timing_shares(ranks: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The shares of a step (module docstring) from rows of ``training_job_rank_throughput``:
    ``{"ranks": n, "data_pct", "compute_pct", "sync_pct", "waiting_pct", "slowest_rank"}`` (%, of
    the ranks' summed step; ``compute_pct``/``sync_pct``/``waiting_pct`` None when a rank lacks
    ``compute_s``, as an older trainer's records do; ``waiting_pct`` and ``slowest_rank`` None with
    one rank). None without a rank reporting its data wait and step time, or when every step took 0 s."""
    rows = [(r.get("rank"), data, step, _num(r.get("compute_s"))) for r in ranks
            if (data := _num(r.get("data_wait_s"))) is not None and (step := _num(r.get("step_time_s"))) is not None]
    total = sum(data + step for _, data, step, _ in rows)
    if not rows or total <= 0:
        return None
    out: dict[str, Any] = {"ranks": len(rows), "data_pct": 100.0 * sum(data for _, data, _, _ in rows) / total,
                           "compute_pct": None, "sync_pct": None, "waiting_pct": None, "slowest_rank": None}
    if any(compute is None for *_, compute in rows):
        return out
    timed = [(rank, data, step, float(compute or 0.0)) for rank, data, step, compute in rows]
    out["compute_pct"] = 100.0 * sum(compute for *_, compute in timed) / total
    out["sync_pct"] = 100.0 * sum(max(step - compute, 0.0) for _, _, step, compute in timed) / total
    if len(timed) > 1:
        ready = [(data + compute, rank) for rank, data, _, compute in timed]
        slowest_s, slowest = max(ready, key=lambda rr: (rr[0], -(rr[1] if isinstance(rr[1], int) else 0)))
        out["waiting_pct"] = 100.0 * sum(slowest_s - s for s, _ in ready) / total
        out["slowest_rank"] = slowest
    return out


def gpu_outlier(utils: Mapping[int, float], procs_per_node: int) -> dict[str, Any] | None:
    """The GPU that stands out (module docstring) among ``utils`` ({rank: mean utilisation %}):
    ``{"rank", "node", "gpu", "util_pct", "others_pct": the others' median, "more": how many of the
    others are as far below that median}``; None with
    fewer than two GPUs or none :data:`GPU_BEHIND_POINTS` below the others' median. Ties: the lowest rank."""
    gpus = sorted((u, r) for r, u in utils.items() if _num(u) is not None)
    if len(gpus) < 2:
        return None
    util, rank = gpus[0]
    others = statistics.median(u for u, _ in gpus[1:])
    if others - util < GPU_BEHIND_POINTS:
        return None
    ppn = max(int(procs_per_node or 1), 1)
    more = sum(1 for u, _ in gpus[1:] if others - u >= GPU_BEHIND_POINTS)
    return {"rank": rank, "node": rank // ppn, "gpu": rank % ppn, "util_pct": util, "others_pct": others,
            "more": more}


def gpu_text(outlier: Mapping[str, Any]) -> str:
    """``GPU 2 of node 1 (rank 6) at 12 % while the others are at 95 %`` (their median), with
    ``; 2 more GPUs as far behind`` when there are."""
    text = (f"GPU {outlier['gpu']} of node {outlier['node']} (rank {outlier['rank']}) at "
            f"{_pct(outlier['util_pct'])} while the others are at {_pct(outlier['others_pct'])}")
    more = outlier.get("more") or 0
    if more:
        text += f" ({more} more GPU{'s' if more != 1 else ''} as far behind)"
    return text


def bound(ranks: Sequence[Mapping[str, Any]], gpu_utils: Mapping[int, float], procs_per_node: int
          ) -> dict[str, Any] | None:
    """What bounds the run: ``{"kind": "input" | "sync" | "compute" | "gpus-underused", "text": the
    line, "shares": :func:`timing_shares` or None, "gpu": :func:`gpu_outlier` or None, "gpu_mean_pct":
    the GPUs' mean utilisation % or None}``; None with neither timing nor a GPU figure. Pure."""
    shares = timing_shares(ranks)
    utils = {r: float(u) for r, u in gpu_utils.items() if _num(u) is not None}
    outlier = gpu_outlier(utils, procs_per_node)
    mean = sum(utils.values()) / len(utils) if utils else None
    if shares is None and mean is None:
        return None
    if shares is not None:
        data, sync = shares["data_pct"], shares["sync_pct"]
        if data >= INPUT_BOUND_PCT and (sync is None or data >= sync):
            kind, text = "input", f"input-bound: ranks wait for data {_pct(data)} of each step"
        elif sync is not None and sync >= SYNC_BOUND_PCT:
            kind = "sync"
            text = f"sync-bound: ranks spend {_pct(sync)} of each step in the gradient sync and the optimizer"
            waiting = shares["waiting_pct"]
            if waiting is not None and waiting >= WAITING_SHOWN_PCT:
                text += f", {_pct(waiting)} waiting for rank {shares['slowest_rank']}, the slowest to reach it"
        elif shares["compute_pct"] is not None:
            kind = "compute"
            text = f"compute-bound: forward and backward take {_pct(shares['compute_pct'])} of each step"
        else:  # an older trainer's records: no compute time to split the rest of the step by
            kind = "compute"
            text = f"not input-bound: ranks wait for data {_pct(data)} of each step"
    elif mean is not None and mean >= GPU_BUSY_PCT:
        kind, text = "compute", f"compute-bound: the GPUs are busy {_pct(mean)} of the time"
    else:
        kind = "gpus-underused"
        text = (f"GPUs underused: busy {_pct(mean or 0.0)} of the time on average; the run waits on something "
                "else (data, the CPU or communication)")
    if outlier is not None:
        text += f"; {gpu_text(outlier)}"
    return {"kind": kind, "text": text, "shares": shares, "gpu": outlier, "gpu_mean_pct": mean}
