"""The trainer's CUDA/NCCL path on a machine with a GPU: one run per case, each timed out, results in
a table and a JSON file. Needs a CUDA GPU; on a CPU-only machine it says so and exits 2.

    PYTHONPATH=. python3 bench/gpu_check.py --json gpu-check.json

Cases (digits, ``cnn`` registry defaults, batch 32, lr 0.05, seed 0, ``--stop-check-s 0``):

``cpu-ddp-1``        reference: world size 1, gloo, CPU (``CUDA_VISIBLE_DEVICES=""``), 2 epochs
``cuda-ddp-1``       world size 1, NCCL on the GPU, fp32; final parameters against ``cpu-ddp-1``
``cuda-fsdp-1``      FSDP2 on NCCL, world size 1; parameters against ``cuda-ddp-1``
``cuda-ddp-1-bf16``  bf16 autocast on the GPU
``cuda-ddp-2-nccl``  2 ranks on the one GPU over NCCL (NCCL refuses two ranks on one device: the
                     case records how the trainer fails, and whether it fails fast)
``cuda-ddp-2-gloo``  2 ranks sharing the GPU over gloo (CUDA tensors through gloo)
``cuda-pipeline-2-gloo``  2 pipeline stages sharing the GPU over gloo
``cuda-sigterm``     a 300-epoch run (auto: NCCL on the GPU) started by ``trainer_pkg.launch``, its
                     process group sent SIGTERM after the first epoch record: exit code, seconds
                     from the signal to exit, and the checkpoint it wrote
``cpu-resume``       that GPU checkpoint resumed on the CPU (``map_location``) for one more epoch

Figures are reported, never asserted: this is a check to run where a GPU is lent, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

BASE = ["--dataset", "digits", "--model", "cnn", "--batch-size", "32", "--lr", "0.05", "--seed", "0",
        "--stop-check-s", "0"]


def _env(cpu: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT", "TRAINBOARD_LAUNCH_PLATFORM")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _cmd(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "trainer_pkg.train", *args]


def _records(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _summary(out_dir: str, log: str) -> dict:
    recs = _records(out_dir)
    epochs = [r for r in recs if r["event"] == "epoch"]
    lines = [ln for ln in log.splitlines() if "world size" in ln or "error" in ln.lower()]
    return {"events": [r["event"] for r in recs if r["event"] != "step"],
            "step_records": sum(r["event"] == "step" for r in recs),
            "val_accuracy": epochs[-1].get("val_accuracy") if epochs else None,
            "val_loss": epochs[-1].get("val_loss") if epochs else None,
            "samples_per_s": next((r.get("samples_per_s") for r in reversed(recs) if "samples_per_s" in r), None),
            "log_lines": lines[:6]}


def run_case(name: str, work: str, nproc: int, args: list[str], cpu: bool, timeout_s: float) -> dict:
    out_dir = os.path.join(work, name)
    start = time.perf_counter()
    try:
        proc = subprocess.run(_cmd(nproc, [*BASE, *args, "--output-dir", out_dir]), env=_env(cpu), cwd=REPO,
                              capture_output=True, text=True, timeout=timeout_s)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    row = {"case": name, "rc": rc, "seconds": round(time.perf_counter() - start, 2), **_summary(out_dir, log)}
    if rc != 0:
        row["log_tail"] = log[-1500:]
    return row


def max_param_diff(a_dir: str, b_dir: str) -> float | None:
    import torch

    a_path, b_path = os.path.join(a_dir, "model.pt"), os.path.join(b_dir, "model.pt")
    if not (os.path.exists(a_path) and os.path.exists(b_path)):
        return None
    a = torch.load(a_path, map_location="cpu", weights_only=True)
    b = torch.load(b_path, map_location="cpu", weights_only=True)
    if set(a) != set(b):
        return float("inf")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel())


def _launch_config(work: str, out_dir: str, epochs: int, backend: str) -> str:
    cfg = {"data": {"format": "builtin", "name": "digits"}, "model": {"arch": "cnn", "params": {}},
           "parallel": {"strategy": "ddp", "procs_per_node": 1, "dist_backend": backend},
           "train": {"epochs": epochs, "batch_size": 32, "lr": 0.05, "seed": 0, "stop_check_s": 0},
           "output": {"output_dir": out_dir}}
    path = os.path.join(work, f"job-{epochs}-{backend}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return path


def _launch(config: str) -> list[str]:
    """The product's launcher, as every backend starts the trainer (it exits 0 after a clean stop)."""
    return [sys.executable, "-m", "trainer_pkg.launch", "--config", config, "--standalone", "--nproc-per-node", "1"]


def sigterm_case(work: str, timeout_s: float) -> dict:
    out_dir = os.path.join(work, "cuda-sigterm")
    proc = subprocess.Popen(_launch(_launch_config(work, out_dir, 300, "auto")), env=_env(False), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None and not any(
            r["event"] == "epoch" for r in _records(out_dir)):
        time.sleep(0.2)
    signalled = time.perf_counter()
    os.killpg(proc.pid, signal.SIGTERM)  # the whole process group, as a container stop or spot reclaim does
    try:
        log, _ = proc.communicate(timeout=60)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, rc = proc.communicate()[0], "timeout"
    ckpt = os.path.join(out_dir, "checkpoints")
    row = {"case": "cuda-sigterm", "rc": rc, "seconds_signal_to_exit": round(time.perf_counter() - signalled, 2),
           "checkpoints": sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else [], **_summary(out_dir, log)}
    if rc != 0:
        row["log_tail"] = log[-1500:]
    return row


def resume_on_cpu(work: str, timeout_s: float) -> dict:
    """The GPU run's checkpoint resumed on the CPU (gloo), for 2 epochs more than it had finished."""
    out_dir = os.path.join(work, "cuda-sigterm")
    done = max((r["epoch"] for r in _records(out_dir) if r["event"] == "epoch"), default=0) + 1
    start = time.perf_counter()
    proc = subprocess.run(_launch(_launch_config(work, out_dir, done + 2, "gloo")), env=_env(True), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)
    log = proc.stdout + proc.stderr
    row = {"case": "cpu-resume", "rc": proc.returncode, "seconds": round(time.perf_counter() - start, 2),
           "epochs_before": done, **_summary(out_dir, log)}
    row["resumed_line"] = next((ln for ln in log.splitlines() if "resuming from" in ln), None)
    if proc.returncode != 0:
        row["log_tail"] = log[-1500:]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/trainboard-gpu-check")
    p.add_argument("--json", help="write the rows here too")
    p.add_argument("--timeout-s", type=float, default=120, help="per case (default 120)")
    p.add_argument("--cases", help="comma-separated case names to run (default: all)")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to check")
        return 2
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, "
          f"bf16 {torch.cuda.is_bf16_supported()}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    os.makedirs(args.work, exist_ok=True)
    w = args.work
    rows = []

    wanted = set(args.cases.split(",")) if args.cases else None

    def case(name, nproc, extra, cpu=False):
        if wanted is not None and name not in wanted:
            return None
        row = run_case(name, w, nproc, extra, cpu, args.timeout_s)
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    case("cpu-ddp-1", 1, ["--epochs", "2", "--dist-backend", "gloo"], cpu=True)
    if case("cuda-ddp-1", 1, ["--epochs", "2", "--dist-backend", "nccl"]):
        rows[-1]["max_param_diff_vs_cpu"] = max_param_diff(os.path.join(w, "cpu-ddp-1"),
                                                           os.path.join(w, "cuda-ddp-1"))
    if case("cuda-fsdp-1", 1, ["--epochs", "2", "--dist-backend", "nccl", "--strategy", "fsdp"]):
        rows[-1]["max_param_diff_vs_cuda_ddp"] = max_param_diff(os.path.join(w, "cuda-ddp-1"),
                                                                os.path.join(w, "cuda-fsdp-1"))
    case("cuda-ddp-1-bf16", 1, ["--epochs", "2", "--dist-backend", "nccl", "--precision", "bf16"])
    case("cuda-ddp-2-nccl", 2, ["--epochs", "1", "--dist-backend", "nccl", "--timeout-s", "60"])
    case("cuda-ddp-2-gloo", 2, ["--epochs", "2", "--dist-backend", "gloo"])
    case("cuda-pipeline-2-gloo", 2, ["--epochs", "2", "--dist-backend", "gloo", "--strategy", "pipeline",
                                     "--model", "mlp"])
    for name, fn in (("cuda-sigterm", sigterm_case), ("cpu-resume", resume_on_cpu)):
        if wanted is None or name in wanted:
            rows.append(fn(w, args.timeout_s))
            print(json.dumps(rows[-1]), flush=True)

    print("\n| case | rc | seconds | val_accuracy | notes |\n|---|---|---|---|---|")
    for r in rows:
        notes = {k: v for k, v in r.items() if k.startswith(("max_param", "seconds_signal", "checkpoints"))}
        if r["rc"] != 0:
            notes["error"] = next((ln for ln in r.get("log_tail", "").splitlines()[::-1] if "rror" in ln), "")[:200]
        print(f"| {r['case']} | {r['rc']} | {r.get('seconds', '')} | {r.get('val_accuracy')} | {notes} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
