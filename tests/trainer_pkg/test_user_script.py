"""A user's own training script under ``python -m trainer_pkg.launch``: real processes (torchrun, gloo on
CPU), the script written by the test into tmp_path as an unpacked code archive would lie.

What is asserted: the ranks saw torchrun's variables and the job's directories, the script's own
arguments arrived as a list (no shell), its ``report.log`` records are on stdout (rank 0 only) and in
metrics.jsonl, its exit code is the job's, and a bad ``code`` section exits 2 naming the field.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_platforms import clean_env, write_npz
from trainer_helpers import REPO, python
from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.launch import UserScript, torchrun_command, torchrun_env, user_script
from trainer_pkg.metrics import parse_metric_line
from trainer_pkg.platforms import LaunchPlan
from user_scripts import DDP_SCRIPT, ENV_SCRIPT, seen_env, write_code

NOTE = "two words; echo $HOME `id` > /tmp/x"  # a shell would split, expand and redirect this


def job(tmp_path: Path, code_dir: Path, script: str, args: list[str], **sections) -> Path:
    cfg = {"data": {"format": "npz", "uri": str(write_npz(tmp_path / "data" / "tiny.npz"))},
           "output": {"output_dir": str(tmp_path / "out")},
           "code": {"dir": str(code_dir), "sha256": "ab" * 32, "script": script, "args": args}}
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(cfg))
    return path


def launch(config: Path, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The launcher on ``config``; a torchrun it starts is the torch-free one (trainer_helpers.python;
    the SIGTERM tests below start torch's own)."""
    cmd = [python(), "-m", "trainer_pkg.launch", "--config", str(config), *extra]
    return subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=timeout)


def metric_records(stdout: str) -> list[dict]:
    return [r for r in map(parse_metric_line, stdout.splitlines()) if r is not None]


def assert_ddp_run(tmp_path: Path, run: subprocess.CompletedProcess, code_dir: Path, env_out: Path) -> None:
    """What DDP_SCRIPT on 2 ranks with --lr 0.5 --steps 3 leaves behind."""
    assert run.returncode == 0, run.stderr[-3000:]
    seen = seen_env(env_out)
    assert sorted(seen) == [0, 1]
    for rank, env in seen.items():
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            str(rank), str(rank), "2", "2")
        assert env["MASTER_ADDR"] and env["MASTER_PORT"].isdigit()
        assert env["TRAINBOARD_MODEL_DIR"] == str(tmp_path / "out")
        assert env["TRAINBOARD_CHECKPOINT_DIR"] == str(tmp_path / "out" / "checkpoints")
        assert env["TRAINBOARD_DATA_DIR"] == str(tmp_path / "data" / "tiny.npz")
        assert env["TRAINBOARD_CODE_DIR"] == str(code_dir)
        assert env["TRAINBOARD_LAUNCH_PLATFORM"] is None  # our ranks' mark, not the script's business
        assert env["cwd"] == str(code_dir) and env["sys_path0"] == str(code_dir)
        assert env["argv"] == ["--lr", "0.5", "--steps", "3", "--env-out", str(env_out), "--note", NOTE]

    printed = metric_records(run.stdout)
    assert [r["step"] for r in printed] == [1, 2, 3]  # rank 0 only: one record per step
    assert all(r["event"] == "step" and r["user_metrics"] == ["my_loss", "tokens/s"] for r in printed)
    assert all(r["tokens/s"] == 96.0 for r in printed)  # 48 samples per rank × 2 ranks
    losses = [r["my_loss"] for r in printed]
    assert all(isinstance(v, float) for v in losses) and losses[2] < losses[0]
    stored = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert stored == printed

    state = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert state["weight"].shape == (4, 8)
    assert torch.load(tmp_path / "out" / "checkpoints" / "last.pt", weights_only=True) == {"step": 3}


def test_script_trains_with_ddp_on_two_ranks(tmp_path):
    code_dir = write_code(tmp_path / "code", DDP_SCRIPT)
    env_out = tmp_path / "seen"
    env_out.mkdir()
    config = job(tmp_path, code_dir, "train.py",
                 ["--lr", "0.5", "--steps", "3", "--env-out", str(env_out), "--note", NOTE])
    run = launch(config, "--standalone", "--nproc-per-node", "2")
    assert_ddp_run(tmp_path, run, code_dir, env_out)
    assert "[launch] running the user's script instead of the trainer: python train.py --lr 0.5 --steps 3 " \
           f"--env-out {env_out} --note '{NOTE}' (in {code_dir}, code sha256 {'ab' * 32})" in run.stdout


def test_module_script_trains_with_ddp_on_two_ranks(tmp_path):
    code_dir = write_code(tmp_path / "code", DDP_SCRIPT, name="mypkg/train.py")
    env_out = tmp_path / "seen"
    env_out.mkdir()
    config = job(tmp_path, code_dir, "-m mypkg.train",
                 ["--lr", "0.5", "--steps", "3", "--env-out", str(env_out), "--note", NOTE])
    run = launch(config, "--standalone", "--nproc-per-node", "2")
    assert_ddp_run(tmp_path, run, code_dir, env_out)
    assert "python -m mypkg.train --lr 0.5" in run.stdout


def test_one_process_script_that_prints_nothing_succeeds(tmp_path):
    code_dir = write_code(tmp_path / "code", ENV_SCRIPT, name="src/run.py")
    env_out = tmp_path / "seen"
    env_out.mkdir()
    # An outer environment's TRAINBOARD_DATA_DIR must not reach a job whose dataset has no path.
    run = subprocess.run(
        [sys.executable, "-m", "trainer_pkg.launch", "--config",
         str(job(tmp_path, code_dir, "src/run.py", ["--env-out", str(env_out)],
                 data={"format": "builtin", "uri": ""}, output={"output_dir": "rel-out"}))],
        cwd=tmp_path, env=clean_env(TRAINBOARD_DATA_DIR="/elsewhere"),
        capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert metric_records(run.stdout) == [] and run.stderr == ""
    [(rank, env)] = seen_env(env_out).items()
    assert rank == 0
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("0", "0", "1", "1")
    assert env["MASTER_ADDR"] == "127.0.0.1" and 0 < int(env["MASTER_PORT"]) < 65536
    assert env["TRAINBOARD_DATA_DIR"] is None
    assert env["TRAINBOARD_MODEL_DIR"] == str(tmp_path / "rel-out")  # relative to where the launcher ran
    assert env["cwd"] == str(code_dir) and env["sys_path0"] == str(code_dir / "src")


def test_script_exit_code_is_the_jobs(tmp_path):
    code_dir = write_code(tmp_path / "code", "import sys\nprint('bye')\nsys.exit(3)\n")
    run = launch(job(tmp_path, code_dir, "train.py", []))
    assert run.returncode == 3 and "bye" in run.stdout


def test_script_that_raises_fails_with_its_traceback(tmp_path):
    # Rank 1 raises; rank 0 waits until torchrun stops it. (Were both to raise, the first failure
    # would make torchrun stop the other rank, perhaps before it printed its own traceback.)
    code_dir = write_code(tmp_path / "code", "import os, time\n\ndef train():\n"
                          "    raise RuntimeError('boom on rank ' + os.environ['RANK'])\n\n"
                          "if os.environ['RANK'] == '1':\n    train()\ntime.sleep(60)\n")
    started = time.monotonic()
    run = launch(job(tmp_path, code_dir, "train.py", []), "--standalone", "--nproc-per-node", "2")
    assert run.returncode != 0
    assert time.monotonic() - started < 50  # torchrun stopped the waiting rank: the job did not sit out its sleep
    assert "RuntimeError: boom on rank 1" in run.stderr
    assert "boom on rank 0" not in run.stderr
    assert "Traceback (most recent call last):" in run.stderr
    assert 'train.py", line 4, in train' in run.stderr


SIGTERM_SCRIPT = """
import os, signal, sys, time
def stop(signum, frame):
    open(os.path.join(os.environ["TRAINBOARD_MODEL_DIR"], "stopped"), "w").write(str(signum))
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(60)
sys.exit(1)
"""


def test_sigterm_reaches_the_script_and_its_exit_code_is_kept(tmp_path):
    code_dir = write_code(tmp_path / "code", SIGTERM_SCRIPT)
    (tmp_path / "out").mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "trainer_pkg.launch", "--config",
                             str(job(tmp_path, code_dir, "train.py", []))],
                            cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while "ready" not in proc.stdout.readline():
            assert proc.poll() is None, proc.stderr.read()
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - started < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (tmp_path / "out" / "stopped").read_text() == str(int(signal.SIGTERM))


RANKS_SIGTERM_SCRIPT = """
import os, signal, sys, time
out, rank = os.environ["TRAINBOARD_MODEL_DIR"], os.environ["RANK"]
def stop(signum, frame):
    open(os.path.join(out, "stopped-rank" + rank), "w").write(str(signum))
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
os.makedirs(out, exist_ok=True)
open(os.path.join(out, "ready-rank" + rank), "w").close()
time.sleep(60)
"""


def test_sigterm_reaches_every_rank_of_a_script_under_torchrun(tmp_path):
    code_dir = write_code(tmp_path / "code", RANKS_SIGTERM_SCRIPT)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "trainer_pkg.launch", "--config",
                             str(job(tmp_path, code_dir, "train.py", [])), "--standalone", "--nproc-per-node", "2"],
                            cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ((out / "ready-rank0").exists() and (out / "ready-rank1").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)  # torchrun's own code after a signal (it does not report the ranks')
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [(out / f"stopped-rank{r}").read_text() for r in (0, 1)] == [str(int(signal.SIGTERM))] * 2


@pytest.mark.parametrize("code, message", [
    ({"script": "train.py"}, "code.script is 'train.py' but code.dir is empty"),
    ({"dir": "{code}", "script": "missing.py"}, "code.script 'missing.py': no such file in code.dir {code}"),
    ({"dir": "{code}/nope", "script": "train.py"}, "code.dir {code}/nope is not a directory"),
    ({"dir": "{code}", "script": "../train.py"}, "code.script '../train.py' points outside code.dir {code}"),
    ({"dir": "{code}", "script": "/etc/passwd"}, "code.script '/etc/passwd' must be a path relative to code.dir"),
    ({"dir": "{code}", "script": "-m my-pkg.train"}, "code.script '-m my-pkg.train': after -m give a dotted module name"),
    ({"dir": "{code}", "script": "-m"}, "code.script '-m': after -m give a dotted module name"),
])
def test_bad_code_section_exits_2_naming_the_field(tmp_path, code, message):
    code_dir = write_code(tmp_path / "code", ENV_SCRIPT)
    (tmp_path / "train.py").write_text("print('outside')\n")
    section = {k: v.replace("{code}", str(code_dir)) for k, v in code.items()}
    config = tmp_path / "job.json"
    config.write_text(json.dumps({"code": section}))
    started = time.monotonic()
    run = launch(config, "--standalone", "--nproc-per-node", "2", timeout=30)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert time.monotonic() - started < 10
    assert run.stderr.startswith("trainer error: invalid config ")
    assert message.replace("{code}", str(code_dir)) in run.stderr
    assert "outside" not in run.stdout


def test_user_script_parses_both_forms(tmp_path):
    code_dir = write_code(tmp_path / "code", ENV_SCRIPT, name="src/train.py")
    cfg = JobConfig.from_dict({"code": {"dir": str(code_dir), "script": "src/train.py", "args": ["-x", "a b"]}})
    script = user_script(cfg)
    assert script == UserScript(code_dir=str(code_dir), path=str(code_dir / "src" / "train.py"), args=("-x", "a b"))
    assert script.argv() == [str(code_dir / "src" / "train.py"), "-x", "a b"]
    assert script.describe() == "python src/train.py -x 'a b'"
    cfg = JobConfig.from_dict({"code": {"dir": str(code_dir), "script": "  -m  src.train ", "args": ["--lr", "1"]}})
    assert user_script(cfg).argv() == ["-m", "src.train", "--lr", "1"]
    assert user_script(JobConfig()) is None
    with pytest.raises(ConfigError, match="code.dir is empty"):
        user_script(JobConfig.from_dict({"code": {"script": "-m src.train"}}))


def test_script_in_ranks_that_torchrun_started_with_our_launcher(tmp_path):
    # The GPU box's command: torchrun_command/torchrun_env without a script, so each rank is this
    # launcher, which runs the script as its child with the rank's variables.
    code_dir = write_code(tmp_path / "code", ENV_SCRIPT)
    env_out = tmp_path / "seen"
    env_out.mkdir()
    config = job(tmp_path, code_dir, "train.py", ["--env-out", str(env_out)])
    plan = LaunchPlan(platform="local", nnodes=1, node_rank=0, nproc_per_node=2, reason="GPU box")
    run = subprocess.run(torchrun_command(str(config), plan), cwd=REPO, env=torchrun_env(plan, clean_env()),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = seen_env(env_out)
    assert sorted(seen) == [0, 1]
    for rank, env in seen.items():
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(rank), str(rank), "2", "2")
        assert env["TRAINBOARD_MODEL_DIR"] == str(tmp_path / "out") and env["cwd"] == str(code_dir)
        assert env["TRAINBOARD_LAUNCH_PLATFORM"] is None


def test_a_relative_code_dir_is_relative_to_the_directory_holding_trainer_pkg(tmp_path):
    # SageMaker and Azure ML set code.dir "." (the files beside trainer_pkg/), Vertex the code package's
    # directory name: not relative to where the launcher was started.
    code_dir = write_code(tmp_path / "code", ENV_SCRIPT)
    env_out = tmp_path / "seen"
    env_out.mkdir()
    config = job(tmp_path, Path(os.path.relpath(code_dir, REPO)), "train.py", ["--env-out", str(env_out)])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = subprocess.run([sys.executable, "-m", "trainer_pkg.launch", "--config", str(config)], cwd=elsewhere,
                         env=clean_env(), capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    [env] = seen_env(env_out).values()
    assert env["cwd"] == env["TRAINBOARD_CODE_DIR"] == str(code_dir)

    for given, resolved in ((".", REPO), ("trainboard_code_0123456789abcdef", REPO / "trainboard_code_0123456789abcdef"),
                            (str(code_dir), code_dir), ("", None)):
        cfg = LaunchPlan(platform="local", nnodes=1, node_rank=0, nproc_per_node=1).resolve(
            JobConfig.from_dict({"code": {"dir": given}}))
        assert cfg.code.dir == (str(resolved) if resolved else "")


RECORDING_MODEL = '''
import json, math, os
from torch import nn

def build(num_classes, input_shape):
    seen = {name: os.environ.get(name) for name in
            ("RANK", "WORLD_SIZE", "TRAINBOARD_MODEL_DIR", "TRAINBOARD_CHECKPOINT_DIR", "TRAINBOARD_DATA_DIR",
             "TRAINBOARD_CODE_DIR")}
    with open(os.path.join(os.environ["SEEN_DIR"], "rank%s.json" % os.environ["RANK"]), "w") as f:
        json.dump(seen, f)
    return nn.Sequential(nn.Linear(math.prod(input_shape), num_classes))
'''


def test_our_trainers_ranks_see_the_directories_too(tmp_path):
    code_dir = write_code(tmp_path / "code", RECORDING_MODEL, name="recorder.py")
    seen_dir = tmp_path / "seen"
    seen_dir.mkdir()
    config = job(tmp_path, code_dir, "", [], model={"arch": "custom", "entry_point": "recorder:build"},
                 train={"epochs": 1, "batch_size": 16}, parallel={"timeout_s": 60})
    run = subprocess.run([python(), "-m", "trainer_pkg.launch", "--config", str(config), "--standalone",
                          "--nproc-per-node", "2"], cwd=REPO, env=clean_env(SEEN_DIR=str(seen_dir)),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "out" / "model.pt").is_file()  # our trainer trained it
    assert sorted(seen_env(seen_dir)) == [0, 1]
    for rank, seen in seen_env(seen_dir).items():
        assert seen == {"RANK": str(rank), "WORLD_SIZE": "2", "TRAINBOARD_MODEL_DIR": str(tmp_path / "out"),
                        "TRAINBOARD_CHECKPOINT_DIR": str(tmp_path / "out" / "checkpoints"),
                        "TRAINBOARD_DATA_DIR": str(tmp_path / "data" / "tiny.npz"),
                        "TRAINBOARD_CODE_DIR": str(code_dir)}


def test_a_framework_other_than_torch_needs_a_script_and_a_known_name():
    """``code.framework`` (issue 33): torch by default; another needs ``code.script`` (the trainer is
    PyTorch); an unknown name is refused by from_dict with the choices."""
    assert JobConfig.from_dict({}).code.framework == "torch"
    errors = JobConfig.from_dict({"code": {"framework": "tensorflow"}}).field_errors()
    assert errors["code.framework"] == "tensorflow runs a training script (code.script): Trainboard's own trainer is PyTorch"
    assert "code.framework" not in JobConfig.from_dict(
        {"code": {"framework": "ray", "script": "train.py"}}).field_errors()
    with pytest.raises(ConfigError) as excinfo:
        JobConfig.from_dict({"code": {"framework": "jax", "script": "train.py"}})
    assert excinfo.value.errors == {"code.framework": "must be one of 'torch', 'tensorflow', 'ray', 'mpi', got 'jax'"}
