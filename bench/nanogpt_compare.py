"""Our trainer beside nanoGPT's ``train.py``: the same GPT, tokens, batch and optimizer, CPU, 2 ranks, gloo.

    .venv/bin/python bench/nanogpt_compare.py --nanogpt /work/peers/nanoGPT     # KJV, 2 pairs x 100 steps (~4 min)
    .venv/bin/python bench/nanogpt_compare.py --nanogpt /work/peers/nanoGPT --reps 3 --steps 200
    .venv/bin/python bench/nanogpt_compare.py --nanogpt /work/peers/nanoGPT --corpus generated

nanoGPT is never part of this repository: fetch it yourself (``git clone
https://github.com/karpathy/nanoGPT /work/peers/nanoGPT``) and pass its folder. This script copies its
``train.py``, ``model.py`` and ``configurator.py`` into the work folder and changes two lines of the
copy (printed as a diff): in a torchrun run nanoGPT sets ``device = f'cuda:{LOCAL_RANK}'`` whatever
``--device`` says, and passes ``device_ids`` to DDP, which DDP refuses for a CPU model. Nothing else of
nanoGPT changes; its own command-line overrides do the rest.

One invocation runs ``--reps`` pairs, one program after the other (ours first in even pairs, nanoGPT
first in odd ones),

  A  ours:    torchrun --standalone --nproc_per_node 2 -m trainer_pkg.launch --config job.json
  B  nanoGPT: torchrun --standalone --nproc_per_node 2 train.py --backend=gloo --device=cpu
              --compile=False --dtype=float32 ...

both under :mod:`bench._rank_rss` (peak RSS per rank); with ``--together`` each pair's two run at the
same time (4 ranks on the machine's cores: on a machine shared with other work, load then slows both
in the same seconds; each program's tokens/s is its share, the ratio is the figure). With: the ``gpt`` model (``--layers 4 --heads 4
--embed-dim 128 --context 128``, dropout 0, biases, tied embeddings; nanoGPT's ``n_layer n_head n_embd
block_size``), the same tokens (one token dataset: by default the King James Bible, 1.0 M training
tokens with a 4,096-token byte-level BPE, made by ``scripts/corpus_kjv.py`` and ``prepare_text``; nanoGPT
reads the same train/val ids as ``data/bench/train.bin``/``val.bin``, uint16), ``--batch-size``
windows per rank per step, AdamW (betas 0.9/0.999, no weight decay, constant ``--lr``, no clipping, no
warmup; nanoGPT: ``--beta2=0.999 --weight_decay=0.0 --grad_clip=0.0 --decay_lr=False``), no compile,
fp32, ``OMP_NUM_THREADS=1`` per rank, ``--steps`` optimizer steps.

Timed window, the same steps in both: optimizer steps 2..S on rank 0, S = the step of our trainer's last
``step`` record (about one a second). Ours from its metric records (as ``bench/overhead.py``); nanoGPT
from the ``time …ms`` it prints per iteration (iteration k is step k + 1; iterations 0 and ``--steps``
also hold its evaluation, so both lie outside the window). tokens/s = (S − 1) × batch × context × 2 /
window. Prints each run, the medians, and tokens/s ours ÷ nanoGPT's (target ≥ 1.0; also the median of
the per-pair ratios and the fastest runs').

Loss after ``--steps`` steps: both final models (our ``model.pt``, nanoGPT's ``ckpt.pt``) are evaluated
here on the same ``--eval-windows`` validation windows (mean cross entropy over every token, nats), each
with its own model code. Our runs use seeds 0, 1, …; nanoGPT hard-codes its seed (1337 + rank), so its
runs repeat one trajectory and the spread of ours over seeds is the noise: nanoGPT's loss is "within
noise" when it lies inside ours' range widened by that range on each side. The same nanoGPT weights
are also loaded into our ``gpt`` class to check that the two are one architecture (parameter count and
the largest logit difference), and both models alone are timed in this process (one forward + backward +
AdamW step each, same weights and batch, alternating: the models' own cost, free of start-up, DDP and
drift between runs).

``--profile`` runs every program under cProfile (:mod:`bench._rank_rss`) and prints rank 0's top
functions by own time, to find where a slower side spends it (profiled timings are not the figure).

Never asserts: timings on a shared machine are reported, not judged.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import importlib.util
import json
import math
import os
import pickle
import re
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import (REPO, finish_job, fmt_list, generate_tokens, job_env, median, read_rss,  # noqa: E402
                           run_job, spread, start_job, torchrun, trainer_window, verdict, write_job)

SPEED_TARGET = 1.0
WORLD = 2
DATASET = "bench"  # nanoGPT's data/<dataset>/ folder name

# The two lines of nanoGPT's train.py that stop a torchrun run on the CPU, and what the copy gets.
NANOGPT_PATCH = (
    ("    device = f'cuda:{ddp_local_rank}'\n    torch.cuda.set_device(device)\n",
     "    if device.startswith('cuda'): device = f'cuda:{ddp_local_rank}'; torch.cuda.set_device(device)\n"),
    ("    model = DDP(model, device_ids=[ddp_local_rank])\n",
     "    model = DDP(model, device_ids=[ddp_local_rank] if device_type == 'cuda' else None)\n"),
)
NANOGPT_FILES = ("train.py", "model.py", "configurator.py")
ITER_LINE = re.compile(r"^iter (\d+): loss ([-+0-9.eEnaif]+), time ([0-9.]+)ms", re.M)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="our trainer vs nanoGPT's train.py: tokens/s and loss after N steps")
    p.add_argument("--nanogpt", required=True, help="folder of a nanoGPT checkout (train.py, model.py, configurator.py)")
    p.add_argument("--corpus", default="kjv",
                   help="kjv (default: the King James Bible from Debian's bible-kjv via scripts/corpus_kjv.py, then "
                        "prepare_text), generated (walk tokens), a text file (prepare_text), or a token dataset folder")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE or generated vocabulary (default 4096)")
    p.add_argument("--reps", type=int, default=2, help="A/B pairs (default 2); our seed is the pair's index")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per run (default 100)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per rank per step (default 8)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--embed-dim", type=int, default=128)
    p.add_argument("--context", type=int, default=128, help="tokens per window (default 128)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-windows", type=int, default=64, help="validation windows both final models are scored on")
    p.add_argument("--side", choices=["both", "ours", "nanogpt"], default="both",
                   help="run only one side (to profile it); no ratio is printed then")
    p.add_argument("--together", action="store_true",
                   help="run each pair's two programs at the same time (4 ranks on the machine's cores), so load "
                        "from other work slows both alike; tokens/s are then each program's share, the ratio the figure")
    p.add_argument("--profile", action="store_true",
                   help="also run every program under cProfile and print rank 0's top functions by own time "
                        "(a diagnostic: the profiler slows Python code, so the timings of such a run are not the figure)")
    p.add_argument("--workdir", help="keep data, configs, logs and outputs here (default: a temporary folder)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    args.load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.steps < 10:
        sys.exit("--steps must be at least 10")
    work = args.workdir or tempfile.mkdtemp(prefix="trainboard-bench-nanogpt-")
    os.makedirs(work, exist_ok=True)
    tokens, meta = _tokens(args, work)
    nano_dir = _nanogpt_copy(args.nanogpt, os.path.join(work, "nanogpt"))
    _nanogpt_data(tokens, meta, os.path.join(nano_dir, "data", DATASET))
    args.vocab = meta["vocab_size"]
    print(f"[nanogpt] {args.reps} pair(s); gpt layers {args.layers} heads {args.heads} embed {args.embed_dim} "
          f"context {args.context} vocab {args.vocab}; {WORLD} ranks x batch {args.batch_size} x {args.steps} steps; "
          f"AdamW lr {args.lr}; gloo, 1 thread/rank, fp32, no compile; data {tokens}; work dir {work}", flush=True)

    sides = ("ours", "nanogpt") if args.side == "both" else (args.side,)
    rows: dict[str, list[dict]] = {s: [] for s in sides}
    for rep in range(args.reps):
        jobs = {side: _prepare(side, rep, args, work, tokens, nano_dir) for side in sides}
        if args.together:  # both at once: whatever else loads the machine slows both in the same seconds
            started = {side: start_job(j["cmd"], j["env"], j["log"], cwd=j["cwd"]) for side, j in jobs.items()}
            walls = {side: finish_job(started[side], timeout_s=1800) for side in sides}
        else:  # one after the other, who goes first swapped every pair (a drift in the machine's speed cancels)
            order = list(jobs) if rep % 2 == 0 else list(jobs)[::-1]
            walls = {side: run_job(jobs[side]["cmd"], jobs[side]["env"], jobs[side]["log"], timeout_s=1800,
                                   cwd=jobs[side]["cwd"]) for side in order}
        for side, j in jobs.items():
            row = {"wall_s": walls[side], "rep": rep, "dir": j["dir"], "rss_mb": read_rss(os.path.join(j["dir"], "rss"))}
            if side == "ours":
                row.update(trainer_window(os.path.join(j["dir"], "out", "metrics.jsonl")))
            else:
                row["iters"] = _nanogpt_iters(j["log"])
            rows[side].append(row)
    # nanoGPT's window is cut at the step where ours ends (its own last step record), pair by pair.
    for rep in range(args.reps):
        last = rows["ours"][rep]["last_step"] if "ours" in rows else args.steps
        for side in sides:
            r = rows[side][rep]
            if side == "nanogpt":
                r["last_step"], r["loop_s"] = last, _nanogpt_window(r["iters"], last)
            r["tokens_per_s"] = (r["last_step"] - 1) * args.batch_size * args.context * WORLD / r["loop_s"]
            print(f"[nanogpt] pair {rep + 1}/{args.reps} {side:7s}: {r['tokens_per_s']:,.0f} tokens/s over steps "
                  f"2..{r['last_step']} ({r['loop_s']:.2f} s), process wall {r['wall_s']:.1f} s, peak RSS "
                  + ", ".join(f"rank {k} {v:.0f} MB" for k, v in sorted(r["rss_mb"].items())), flush=True)

    if args.profile:
        _print_profiles(rows)
    losses = _evaluate(args, tokens, nano_dir, rows)
    if _has_gpt():
        losses["model_step_ms"] = _model_step_times(args, nano_dir)
    report = _report(args, rows, losses)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "runs": rows, **report}, f, indent=2, default=str)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _prepare(side: str, rep: int, args: argparse.Namespace, work: str, tokens: str, nano_dir: str) -> dict:
    """The command, environment, working directory and paths of one run (a fresh run directory)."""
    run_dir = os.path.join(work, f"{rep:02d}-{side}")
    shutil.rmtree(run_dir, ignore_errors=True)  # a leftover checkpoint would make either resume
    os.makedirs(os.path.join(run_dir, "rss"))
    env = job_env(os.path.join(run_dir, "rss"))
    if args.profile:
        env["BENCH_PROFILE_DIR"] = os.path.join(run_dir, "rss")
    job = {"dir": run_dir, "env": env, "log": os.path.join(run_dir, "log.txt")}
    if side == "ours":
        job.update(cwd=REPO, cmd=torchrun(WORLD, ["-m", "trainer_pkg.launch", "--config",
                                                  _our_job(args, tokens, run_dir, seed=rep)]))
    else:
        job.update(cwd=nano_dir, cmd=torchrun(WORLD, [os.path.join(nano_dir, "train.py"), *_nanogpt_args(args, run_dir)]))
    return job


# -- data ------------------------------------------------------------------------------------------


def _tokens(args: argparse.Namespace, work: str) -> tuple[str, dict]:
    """The token dataset both read (see ``--corpus``). Exits when it is not uint16 (all nanoGPT reads)
    or holds too few training tokens for one epoch of ours to hold every step (an epoch's end would put
    a validation inside the timed window)."""
    need = int(1.25 * (args.steps + 2) * args.batch_size * WORLD * (args.context + 1))
    root = os.path.join(work, "tokens")
    if args.corpus == "generated":
        shutil.rmtree(root, ignore_errors=True)
        generate_tokens(root, train_tokens=need, val_tokens=max(200_000, args.eval_windows * (args.context + 1) * 2),
                        vocab_size=args.vocab_size, seed=1234, fill="walk")
    elif args.corpus == "kjv" or os.path.isfile(args.corpus):
        text = args.corpus
        if args.corpus == "kjv":
            text = os.path.join(work, "kjv.txt")
            run_job([sys.executable, os.path.join(REPO, "scripts", "corpus_kjv.py"), text], job_env(),
                    os.path.join(work, "corpus.log"), timeout_s=300)
        shutil.rmtree(root, ignore_errors=True)
        run_job([sys.executable, "-m", "trainer_pkg.prepare_text", text, "--out", root, "--vocab-size",
                 str(args.vocab_size)], job_env(), os.path.join(work, "prepare_text.log"), timeout_s=1800)
    else:
        root = os.path.abspath(args.corpus)
    with open(os.path.join(root, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("dtype") != "uint16":
        sys.exit(f"{root}: nanoGPT reads uint16 tokens only; this dataset is {meta.get('dtype')}")
    have = sum(os.path.getsize(os.path.join(root, rel)) // 2 for rel in meta["splits"]["train"])
    if have < need:
        most = int(have / 1.25 / (args.batch_size * WORLD * (args.context + 1))) - 2
        sys.exit(f"{root}: {have:,} training tokens; {args.steps} steps of {WORLD} x {args.batch_size} windows of "
                 f"{args.context + 1} tokens need about {need:,} in one epoch: use --steps {most} or less")
    return root, meta


def _nanogpt_data(tokens: str, meta: dict, data_dir: str) -> None:
    """``train.bin``/``val.bin`` (nanoGPT's names: one uint16 file per split) with our splits' ids,
    hard-linked when the split is one shard, else concatenated; ``meta.pkl`` gives the vocabulary."""
    os.makedirs(data_dir, exist_ok=True)
    for split in ("train", "val"):
        target = os.path.join(data_dir, f"{split}.bin")
        if os.path.exists(target):
            os.remove(target)
        shards = [os.path.join(tokens, rel) for rel in meta["splits"][split]]
        if len(shards) == 1 and shards[0].endswith(".bin"):
            try:
                os.link(shards[0], target)
                continue
            except OSError:
                pass
        with open(target, "wb") as out:
            for path in shards:
                if path.endswith(".npy"):
                    import numpy as np

                    out.write(np.load(path, mmap_mode="r").astype("uint16").tobytes())
                else:
                    with open(path, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 24)
    with open(os.path.join(data_dir, "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": meta["vocab_size"]}, f)


# -- the two programs ---------------------------------------------------------------------------------


def _gpt_params(args: argparse.Namespace) -> dict:
    return {"layers": args.layers, "heads": args.heads, "embed_dim": args.embed_dim, "context_length": args.context,
            "dropout": 0.0, "tied_embeddings": True, "bias": True}


def _our_job(args: argparse.Namespace, tokens: str, run_dir: str, seed: int) -> str:
    cfg = {"data": {"format": "tokens", "uri": tokens, "seq_len": args.context, "val_windows": args.eval_windows},
           "model": {"arch": "gpt", "params": _gpt_params(args)},
           "parallel": {"strategy": "ddp", "procs_per_node": WORLD, "dist_backend": "gloo"},
           "train": {"epochs": 1, "max_steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
                     "optimizer": "adamw", "weight_decay": 0.0, "seed": seed},
           "output": {"output_dir": os.path.join(run_dir, "out")}}
    return write_job(os.path.join(run_dir, "job.json"), cfg)


def _nanogpt_copy(src: str, dst: str) -> str:
    """nanoGPT's three files copied to ``dst`` with :data:`NANOGPT_PATCH` applied to ``train.py``;
    prints where they came from (sha256) and the diff. Exits when a file or a patched line is missing
    (another nanoGPT version: look at its DDP set-up and adapt the patch)."""
    os.makedirs(dst, exist_ok=True)
    for name in NANOGPT_FILES:
        path = os.path.join(src, name)
        if not os.path.isfile(path):
            sys.exit(f"{path} not found: --nanogpt must be a nanoGPT checkout")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        print(f"[nanogpt] {path} sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}", flush=True)
        if name == "train.py":
            original = text
            for old, new in NANOGPT_PATCH:
                if old not in text:
                    sys.exit(f"{path}: expected line(s) not found, so the CPU patch cannot be applied:\n{old}")
                text = text.replace(old, new)
            diff = difflib.unified_diff(original.splitlines(True), text.splitlines(True), "nanoGPT/train.py",
                                        "copy/train.py", n=0)
            print("[nanogpt] the copy's change (to run under torchrun on the CPU):\n" + "".join(diff), flush=True)
        with open(os.path.join(dst, name), "w", encoding="utf-8") as f:
            f.write(text)
    return dst


def _nanogpt_args(args: argparse.Namespace, run_dir: str) -> list[str]:
    """nanoGPT's own overrides (``configurator.py``: ``--key=value``) for the same run as ours. Its
    gradient_accumulation_steps is global and divided by the world size, so 2 = one micro-step per rank.
    ``eval_interval = max_iters = steps`` evaluates at iterations 0 and ``steps`` only and saves ``ckpt.pt``
    there, after ``steps`` optimizer steps (iteration k runs step k + 1; it then takes one step more, untimed)."""
    return [f"--dataset={DATASET}", "--backend=gloo", "--device=cpu", "--compile=False", "--dtype=float32",
            f"--out_dir={os.path.join(run_dir, 'out')}", f"--batch_size={args.batch_size}",
            f"--block_size={args.context}", f"--n_layer={args.layers}", f"--n_head={args.heads}",
            f"--n_embd={args.embed_dim}", "--dropout=0.0", "--bias=True", f"--learning_rate={args.lr!r}",
            "--weight_decay=0.0", "--beta1=0.9", "--beta2=0.999", "--grad_clip=0.0", "--decay_lr=False",
            f"--gradient_accumulation_steps={WORLD}", f"--max_iters={args.steps}",
            f"--eval_interval={args.steps}", "--eval_iters=2", "--log_interval=1",
            "--always_save_checkpoint=True", "--wandb_log=False"]


def _nanogpt_iters(log_path: str) -> dict[int, dict[str, float]]:
    """{iteration: {"loss", "ms"}} from rank 0's ``iter k: loss …, time …ms`` lines."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    iters = {int(m[1]): {"loss": float(m[2]), "ms": float(m[3])} for m in ITER_LINE.finditer(text)}
    if not iters:
        raise RuntimeError(f"{log_path}: no 'iter k: loss …, time …ms' line from nanoGPT")
    return iters


def _nanogpt_window(iters: dict[int, dict[str, float]], last_step: int) -> float:
    """Seconds of optimizer steps 2..``last_step``: iterations 1..last_step − 1 (iteration k's time
    runs from the end of step k to the end of step k + 1)."""
    missing = [k for k in range(1, last_step) if k not in iters]
    if missing:
        raise RuntimeError(f"nanoGPT printed no time for iteration(s) {missing[:5]}…")
    return sum(iters[k]["ms"] for k in range(1, last_step)) / 1e3


# -- loss after N steps, on the same windows ---------------------------------------------------------


def _eval_windows(tokens: str, count: int, context: int):
    """(x, y) int64 (count, context): the validation windows our trainer scores at an epoch's end
    (:func:`trainer_pkg.token_shard.validation_windows`, seed 0), y = x shifted by one token."""
    from trainer_pkg.token_shard import validation_windows
    from trainer_pkg.tokens import open_tokens

    return validation_windows(open_tokens(tokens), seq_len=context, count=count, seed=0)


def _load_nanogpt_model(nano_dir: str, ckpt_path: str):
    import torch

    spec = importlib.util.spec_from_file_location("nanogpt_model", os.path.join(nano_dir, "model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    model = module.GPT(module.GPTConfig(**ckpt["model_args"]))
    state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
    model.load_state_dict(state)
    return model.eval(), state, ckpt.get("iter_num")


_LEAF_MODULES = ("wte", "wpe", "ln_f", "lm_head")


def _canonical(name: str) -> str:
    """A parameter's name without its containers: from the block index or the top-level module on
    (``transformer.h.0.attn.c_attn.weight`` and ``blocks.0.attn.c_attn.weight`` → ``0.attn.c_attn.weight``;
    ``transformer.wte.weight`` and ``embedding.wte.weight`` → ``wte.weight``), so nanoGPT's names and ours
    meet whatever containers either model keeps its modules in."""
    parts = name.split(".")
    i = next((k for k, p in enumerate(parts) if p.isdigit() or p in _LEAF_MODULES), 0)
    return ".".join(parts[i:])


def _nanogpt_to_ours(state: dict, our_names: list[str]) -> dict:
    """nanoGPT's tensors under our parameter names (matched by :func:`_canonical`); a name of ours with
    no counterpart is left out (``load_state_dict(strict=False)`` then lists it as missing)."""
    by_canonical = {_canonical(k): v for k, v in state.items()}
    return {k: by_canonical[_canonical(k)] for k in our_names if _canonical(k) in by_canonical}


def _has_gpt() -> bool:
    from trainer_pkg.registry import ARCHITECTURES

    return "gpt" in ARCHITECTURES


def _evaluate(args: argparse.Namespace, tokens: str, nano_dir: str, rows: dict) -> dict:
    """Mean cross entropy (nats/token) of every run's final model on the same validation windows, and
    the architecture check (nanoGPT's weights in our class: same logits?)."""
    import torch
    import torch.nn.functional as F

    from trainer_pkg.models import build_model

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    x, y = _eval_windows(tokens, args.eval_windows, args.context)

    def ce(logits: torch.Tensor) -> float:
        return float(F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1)))

    def ours_model():
        return build_model("gpt", _gpt_params(args), (args.context,), args.vocab).eval()

    out: dict = {"eval_windows": args.eval_windows, "ours": [], "nanogpt": []}
    with torch.no_grad():
        for r in rows.get("ours", []):
            model = ours_model()
            model.load_state_dict(torch.load(os.path.join(r["dir"], "out", "model.pt"), map_location="cpu",
                                             weights_only=True))
            out["ours"].append(ce(model(x)))
        for r in rows.get("nanogpt", []):
            ckpt = os.path.join(r["dir"], "out", "ckpt.pt")
            model, state, iter_num = _load_nanogpt_model(nano_dir, ckpt)
            if iter_num != args.steps:
                raise RuntimeError(f"{ckpt} is from iteration {iter_num}, expected {args.steps}")
            # nanoGPT returns every position's logits only when given targets
            logits, loss = model(x, y)
            out["nanogpt"].append(float(loss))
            if "architecture" not in out and _has_gpt():
                ours = ours_model()
                mapped = _nanogpt_to_ours(state, list(ours.state_dict()))
                missing = ours.load_state_dict(mapped, strict=False).missing_keys
                left = sorted(set(map(_canonical, state)) - set(map(_canonical, mapped)))
                n_ours = sum(p.numel() for p in ours.parameters())
                n_nano = sum(p.numel() for p in model.parameters())
                out["architecture"] = {
                    "params_ours": n_ours, "params_nanogpt": n_nano, "missing": list(missing),
                    "unexpected": left,
                    "max_logit_diff": (float((ours(x) - logits).abs().max()) if not missing and not left
                                       else None)}
    return out


def _print_profiles(rows: dict, top: int = 25) -> None:
    """Rank 0's functions by own time (cProfile ``tottime``), the last run of each side."""
    import pstats

    for side, rs in rows.items():
        path = os.path.join(rs[-1]["dir"], "rss", "rank0.prof")
        print(f"\n=== {side}, rank 0: top {top} functions by own time ({path}) ===")
        pstats.Stats(path).sort_stats("tottime").print_stats(top)


def _model_step_times(args: argparse.Namespace, nano_dir: str, reps: int = 15) -> dict:
    """The two models alone, in this one process and one thread: nanoGPT's ``GPT`` and our ``gpt`` with
    the same weights, one forward + backward + AdamW step each on the same batch, alternating ``reps``
    times after two warm-up steps. Milliseconds, min and median: the model's own cost, without either
    training loop, DDP or start-up, and with the machine's drift hitting both alike."""
    import time

    import torch
    import torch.nn.functional as F

    from trainer_pkg.models import build_model

    spec = importlib.util.spec_from_file_location("nanogpt_model_ab", os.path.join(nano_dir, "model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    nano = module.GPT(module.GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.embed_dim,
                                       block_size=args.context, bias=True, vocab_size=args.vocab, dropout=0.0))
    ours = build_model("gpt", _gpt_params(args), (args.context,), args.vocab)
    ours.load_state_dict(_nanogpt_to_ours(nano.state_dict(), list(ours.state_dict())))
    x = torch.randint(0, args.vocab, (args.batch_size, args.context))
    y = torch.randint(0, args.vocab, (args.batch_size, args.context))
    opts = {"ours": torch.optim.AdamW(ours.parameters(), lr=args.lr, weight_decay=0.0),
            "nanogpt": torch.optim.AdamW(nano.parameters(), lr=args.lr, weight_decay=0.0)}

    def step(side: str) -> float:
        tick = time.perf_counter()
        if side == "ours":
            logits = ours(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        else:
            _, loss = nano(x, y)
        loss.backward()
        opts[side].step()
        opts[side].zero_grad(set_to_none=True)
        return time.perf_counter() - tick

    times: dict[str, list[float]] = {"ours": [], "nanogpt": []}
    for rep in range(reps + 2):
        for side in (("ours", "nanogpt") if rep % 2 == 0 else ("nanogpt", "ours")):
            t = step(side)
            if rep >= 2:
                times[side].append(t * 1e3)
    return {side: {"min_ms": min(v), "median_ms": median(v)} for side, v in times.items()}


# -- report ------------------------------------------------------------------------------------------


def _report(args: argparse.Namespace, rows: dict, losses: dict) -> dict:
    print()
    print("=== ours vs nanoGPT: same GPT, tokens, batch and AdamW; CPU, 2 ranks, gloo ===")
    tps = {side: [r["tokens_per_s"] for r in rs] for side, rs in rows.items()}
    for side, values in tps.items():
        print(f"tokens/s {side:8s} {fmt_list(values, 0)}  median {median(values):,.0f}  (spread {spread(values)})")
    for side, values in ((s, losses[s]) for s in ("ours", "nanogpt") if losses.get(s)):
        print(f"val loss after {args.steps} steps, {side:8s} {fmt_list(values, 4)} nats/token on {args.eval_windows} "
              f"windows of {args.context}")
    report: dict = {"tokens_per_s": tps, "val_loss": losses}
    if len(tps) == 2:
        ratio = median(tps["ours"]) / median(tps["nanogpt"])
        pairs = [a / b for a, b in zip(tps["ours"], tps["nanogpt"])]
        best = max(tps["ours"]) / max(tps["nanogpt"])
        print(f"  RATIO tokens/s ours/nanoGPT (medians) = {ratio:.3f}   target >= {SPEED_TARGET}: "
              f"{verdict(ratio, SPEED_TARGET, higher_is_better=True)}")
        print(f"  median of the per-pair ratios         = {median(pairs):.3f}   {fmt_list(pairs)}")
        print(f"  ratio of the fastest runs             = {best:.3f}")
        report.update(ratio_of_medians=ratio, median_pair_ratio=median(pairs), ratio_of_fastest=best)
        ours, nano = losses["ours"], losses["nanogpt"]
        width = max(ours) - min(ours)
        lo, hi = min(ours) - width, max(ours) + width
        within = all(lo <= v <= hi for v in nano)
        print(f"  loss: nanoGPT {median(nano):.4f} vs ours {median(ours):.4f} (difference "
              f"{median(ours) - median(nano):+.4f}); ours' spread over {len(ours)} seed(s) {width:.4f}, so within "
              f"noise means [{lo:.4f}, {hi:.4f}]: {'within noise' if within else 'OUTSIDE the noise'}"
              + ("  (one seed: no spread to compare with)" if len(ours) < 2 else ""))
        report.update(loss_within_noise=within, loss_noise_band=[lo, hi])
        for rank in sorted(set().union(*(r["rss_mb"] for r in rows["ours"] + rows["nanogpt"]))):
            a = median([r["rss_mb"][rank] for r in rows["ours"] if rank in r["rss_mb"]])
            b = median([r["rss_mb"][rank] for r in rows["nanogpt"] if rank in r["rss_mb"]])
            print(f"  peak RSS rank {rank}: ours {a:.0f} MB, nanoGPT {b:.0f} MB ({a - b:+.0f} MB)")
    arch = losses.get("architecture")
    if arch:
        same = not arch["missing"] and not arch["unexpected"] and arch["params_ours"] == arch["params_nanogpt"]
        print(f"architecture: parameters ours {arch['params_ours']:,}, nanoGPT {arch['params_nanogpt']:,}; "
              + (f"nanoGPT's weights in our class: max |logit difference| {arch['max_logit_diff']:.3g}" if same else
                 f"names do not map: missing {arch['missing'][:4]}, unexpected {arch['unexpected'][:4]}"))
    ab = losses.get("model_step_ms")
    if ab:
        print(f"the models alone (one process, one thread, same weights and batch, alternating): forward + backward + "
              f"AdamW ours {ab['ours']['median_ms']:.1f} ms (min {ab['ours']['min_ms']:.1f}), nanoGPT "
              f"{ab['nanogpt']['median_ms']:.1f} ms (min {ab['nanogpt']['min_ms']:.1f}); nanoGPT/ours "
              f"{ab['nanogpt']['median_ms'] / ab['ours']['median_ms']:.3f} (medians), "
              f"{ab['nanogpt']['min_ms'] / ab['ours']['min_ms']:.3f} (fastest)")
    print(f"cores available to this process: {len(os.sched_getaffinity(0))}; load average before: {args.load_before}")
    if not math.isfinite(sum(sum(v) for v in tps.values())):
        print("  (a run reported no time)")
    return report


if __name__ == "__main__":
    sys.exit(main())
