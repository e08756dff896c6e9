"""What a user's script receives of its job beyond the directories (docs/user-code.md): the config's
``train`` values as ``TRAINBOARD_HPARAMS`` (``report.hparams()``) and as ``{train.<field>}``
placeholders in its arguments (a sweep trial's sampled values reach it there), and the file a continue
or fine-tune starts from as ``TRAINBOARD_INIT_FROM``/``TRAINBOARD_INIT_MODE`` (``report.init_from()``),
under the real launcher (one process, and torchrun with 2 ranks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_platforms import clean_env
from test_user_script import job, launch
from trainer_helpers import REPO
from trainer_pkg import launch as launcher, objstore, report
from trainer_pkg.config import ConfigError, JobConfig, expand_script_args, script_hparam_keys, script_hparams
from user_scripts import write_code

# Writes what it received, per rank: its argv, report.hparams(), report.init_from()/init_mode() and,
# when there is an init file, the sum of the tensor it holds (loaded as a script would).
RECEIVER = '''
import json, os, sys
from trainer_pkg import report

seen = {"argv": sys.argv[1:], "hparams": report.hparams(), "init_from": report.init_from(),
        "init_mode": report.init_mode()}
if report.init_from() is not None:
    import torch
    seen["loaded_sum"] = float(torch.load(report.init_from(), weights_only=True)["w"].sum())
with open(os.path.join(report.model_dir(), "seen-rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(seen, f)
'''


def _seen(out: Path) -> dict[int, dict]:
    return {int(p.stem.rsplit("rank", 1)[1]): json.loads(p.read_text()) for p in sorted(out.glob("seen-rank*.json"))}


def test_a_script_gets_its_train_values_as_json_and_in_its_arguments(tmp_path):
    code_dir = write_code(tmp_path / "code", RECEIVER)
    args = ["--lr", "{train.lr}", "--tag=e{train.epochs}-{train.optimizer}", '{"a": 1}', "{train.augment}"]
    config = job(tmp_path, code_dir, "train.py", args, train={"lr": 1e-6, "epochs": 2, "optimizer": "adamw"})
    # An outer environment's values never reach the job (another job's, or a stale shell's).
    run = subprocess.run([sys.executable, "-m", "trainer_pkg.launch", "--config", str(config)], cwd=REPO,
                         env=clean_env(TRAINBOARD_HPARAMS='{"train.lr": 9}', TRAINBOARD_INIT_FROM="/elsewhere",
                                       TRAINBOARD_INIT_MODE="continue"),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    [(rank, seen)] = _seen(tmp_path / "out").items()
    assert seen["argv"] == ["--lr", "1e-06", "--tag=e2-adamw", '{"a": 1}', "false"]  # 5 arguments, as given
    cfg = JobConfig.from_json(config.read_text())
    assert seen["hparams"] == script_hparams(cfg)
    assert (seen["hparams"]["train.lr"], seen["hparams"]["train.epochs"], seen["hparams"]["train.batch_size"]) == (
        1e-6, 2, 32)
    assert sorted(seen["hparams"]) == sorted(script_hparam_keys())
    assert "train.init_from" not in seen["hparams"] and "train.init_mode" not in seen["hparams"]
    assert seen["init_from"] is None and seen["init_mode"] is None
    assert "python train.py --lr 1e-06 --tag=e2-adamw" in run.stdout  # the log shows what ran


def test_an_unknown_placeholder_exits_2_naming_it(tmp_path):
    code_dir = write_code(tmp_path / "code", RECEIVER)
    run = launch(job(tmp_path, code_dir, "train.py", ["--lr", "{train.lrr}", "{train.seed}"]))
    assert run.returncode == 2
    assert "code.args: {train.lrr} in argument '{train.lrr}' names no field a script receives" in run.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("seen-*"))


def test_every_rank_of_a_script_receives_the_init_file_and_loads_it(tmp_path):
    source = tmp_path / "source-job" / "model.pt"
    source.parent.mkdir()
    torch.save({"w": torch.tensor([1.5, 2.5])}, source)
    code_dir = write_code(tmp_path / "code", RECEIVER)
    config = job(tmp_path, code_dir, "train.py", [], train={"init_from": str(source), "init_mode": "finetune"})
    run = launch(config, "--standalone", "--nproc-per-node", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    seen = _seen(tmp_path / "out")
    assert sorted(seen) == [0, 1]
    for rank_seen in seen.values():
        assert rank_seen["init_from"] == str(source) and rank_seen["init_mode"] == "finetune"
        assert rank_seen["loaded_sum"] == 4.0
    assert f"[launch] the script starts from {source}: TRAINBOARD_INIT_FROM, TRAINBOARD_INIT_MODE=finetune" \
        in run.stdout


class _FakeStore(objstore.Store):
    """One object in memory; counts the ranged reads."""

    scheme = "s3"

    def __init__(self, data: bytes) -> None:
        super().__init__("bucket")
        self.data, self.reads = data, []

    def size(self, key: str) -> int:
        if key != "runs/job-4/model.pt":
            raise FileNotFoundError(key)
        return len(self.data)

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        self.reads.append((offset, length))
        return self.data[offset:offset + length]


def test_an_object_store_init_file_is_fetched_to_a_local_file_in_chunks(tmp_path, monkeypatch):
    data = bytes(range(256)) * 40  # 10,240 bytes
    fake = _FakeStore(data)
    monkeypatch.setattr(objstore, "store", lambda uri: (fake, uri.split("/", 3)[3]))
    monkeypatch.setattr(launcher, "INIT_FETCH_CHUNK", 4096)
    cfg = JobConfig.from_dict({"train": {"init_from": "s3://bucket/runs/job-4/model.pt", "init_mode": "finetune"}})
    local = launcher.fetch_init_file(cfg, str(tmp_path)).train.init_from
    assert Path(local).parent.parent == tmp_path and Path(local).name == "model.pt"
    assert Path(local).read_bytes() == data
    assert fake.reads == [(0, 4096), (4096, 4096), (8192, 2048)]
    env = launcher.trainboard_env(launcher.fetch_init_file(cfg, str(tmp_path)))
    assert Path(env[report.INIT_FROM]).read_bytes() == data and env[report.INIT_MODE] == "finetune"

    missing = JobConfig.from_dict({"train": {"init_from": "s3://bucket/runs/job-5/model.pt", "init_mode": "finetune"}})
    with pytest.raises(ConfigError, match=r"train.init_from s3://bucket/runs/job-5/model.pt: no such object"):
        launcher.fetch_init_file(missing, str(tmp_path))
    local_cfg = JobConfig.from_dict({"train": {"init_from": "/runs/model.pt", "init_mode": "continue"}})
    assert launcher.fetch_init_file(local_cfg) is local_cfg  # a local file is read where it lies


def test_report_reads_the_values_and_says_what_is_missing(monkeypatch):
    monkeypatch.delenv(report.HPARAMS, raising=False)
    with pytest.raises(RuntimeError, match="TRAINBOARD_HPARAMS is not set: run the script under Trainboard's launcher"):
        report.hparams()
    monkeypatch.setenv(report.HPARAMS, "[1]")
    with pytest.raises(ValueError, match="must hold a JSON object, got list"):
        report.hparams()
    monkeypatch.setenv(report.HPARAMS, '{"train.lr": 0.01}')
    assert report.hparams() == {"train.lr": 0.01}
    monkeypatch.delenv(report.INIT_FROM, raising=False)
    monkeypatch.delenv(report.INIT_MODE, raising=False)
    assert report.init_from() is None and report.init_mode() is None


def test_placeholders_stay_inside_their_argument():
    values = {"train.lr": 0.5, "train.epochs": 3, "train.optimizer": "sgd", "train.augment": True}
    assert expand_script_args(["--lr={train.lr}", "{train.epochs}{train.epochs}", "{train.optimizer} x", "{train.augment}",
                               "{model.params.x}", "{{train}}"], values) == [
        "--lr=0.5", "33", "sgd x", "true", "{model.params.x}", "{{train}}"]
    with pytest.raises(ConfigError) as exc:
        expand_script_args(["{train.a}", "{train.init_from}"], values)
    assert str(exc.value).count("names no field a script receives") == 2  # every one at once
