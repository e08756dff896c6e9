"""trainer_pkg.report in process: the record ``log`` prints and appends, its checks, the directories."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from trainer_helpers import REPO
from trainer_pkg import report
from trainer_pkg.metrics import parse_metric_line


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """Each test starts as a new script would: no step logged yet, no launcher variables."""
    monkeypatch.setattr(report, "_last_step", -1)
    monkeypatch.setattr(report, "_total_steps", 0)
    for name in ("RANK", report.MODEL_DIR, report.CHECKPOINT_DIR, report.DATA_DIR, report.CODE_DIR):
        monkeypatch.delenv(name, raising=False)


def printed(capsys) -> list[dict]:
    out = capsys.readouterr().out
    assert all(line.startswith("TRAINBOARD_METRIC {") for line in out.splitlines())
    return [parse_metric_line(line) for line in out.splitlines()]


def test_log_prints_one_record_and_appends_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(report.MODEL_DIR, str(tmp_path / "model"))
    monkeypatch.setenv("RANK", "0")
    report.log(step=10, loss=0.42, my_metric=3)
    report.log(**{"tokens/s": np.float32(812.5), "eval.top-1": torch.tensor(0.25), "loss": np.int64(2)})
    first, second = printed(capsys)
    assert first["event"] == "step" and first["step"] == 10 and abs(first["time"] - time.time()) < 5
    assert {k: first[k] for k in ("loss", "my_metric", "user_metrics")} == {
        "loss": 0.42, "my_metric": 3.0, "user_metrics": ["loss", "my_metric"]}
    assert isinstance(first["my_metric"], float)
    assert second["step"] == 11  # one more than the previous call's
    assert {k: second[k] for k in ("tokens/s", "eval.top-1", "loss", "user_metrics")} == {
        "tokens/s": 812.5, "eval.top-1": 0.25, "loss": 2.0, "user_metrics": ["tokens/s", "eval.top-1", "loss"]}
    lines = (tmp_path / "model" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [first, second]


def test_step_starts_at_0_and_follows_the_last_given(capsys):
    report.log(a=1)
    report.log(a=2)
    report.log(step=7, a=3)
    report.log(a=4)
    assert [r["step"] for r in printed(capsys)] == [0, 1, 7, 8]


def test_nonfinite_values_are_null_and_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(report.MODEL_DIR, str(tmp_path))
    report.log(step=1, loss=math.nan, grad=torch.tensor(math.inf), ok=1.5)
    [record] = printed(capsys)
    assert (record["loss"], record["grad"], record["ok"]) == (None, None, 1.5)
    assert record["nonfinite"] == ["grad", "loss"] and record["user_metrics"] == ["loss", "grad", "ok"]
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == record  # valid JSON: no NaN literal


def test_other_ranks_validate_but_print_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(report.MODEL_DIR, str(tmp_path / "model"))
    report.log(step=3, loss=1.0)
    assert capsys.readouterr().out == "" and not (tmp_path / "model").exists()
    with pytest.raises(ValueError, match="metric 'loss' must be a real number"):
        report.log(step=4, loss="1.0")


@pytest.mark.parametrize("kwargs, message", [
    ({"step": -1, "a": 1}, "step must be 0 or more, got -1"),
    ({"step": 1.5, "a": 1}, "step must be an int (the optimizer step), got 1.5"),
    ({"step": True, "a": 1}, "step must be an int"),
    ({"loss": "0.3"}, "metric 'loss' must be a real number (int, float, numpy scalar or one-element tensor), got str '0.3'"),
    ({"flag": True}, "metric 'flag' must be a real number"),
    ({"loss": [1.0, 2.0]}, "metric 'loss' must be a real number (int, float, numpy scalar or one-element tensor), got list"),
    ({"loss": torch.ones(3)}, "metric 'loss' must be a real number"),
    ({"loss": None}, "got NoneType None"),
    ({"1st": 1.0}, "metric name '1st' is not allowed: use 1-100 letters, digits or _ . / -"),
    ({"a b": 1.0}, "metric name 'a b' is not allowed"),
    ({"x" * 101: 1.0}, "is not allowed"),
    ({"time": 1.0}, "metric name 'time' is a field of the record itself"),
    ({"user_metrics": 1.0}, "is a field of the record itself"),
])
def test_bad_calls_raise_naming_the_problem(kwargs, message, capsys):
    with pytest.raises(ValueError) as info:
        report.log(**kwargs)
    assert message in str(info.value) and str(info.value).startswith("report.log: ")
    assert capsys.readouterr().out == ""


def test_every_bad_metric_is_named_at_once():
    with pytest.raises(ValueError) as info:
        report.log(step=1, good=1.0, **{"bad name": 1.0, "worse": "x"})
    assert "'bad name'" in str(info.value) and "'worse'" in str(info.value)


def test_at_most_50_metrics_per_call(capsys):
    report.log(**{f"m{i}": float(i) for i in range(50)})
    assert len(printed(capsys)[0]["user_metrics"]) == 50
    with pytest.raises(ValueError, match="at most 50 metrics per call, got 51"):
        report.log(**{f"m{i}": float(i) for i in range(51)})
    report.log(**{"x" * 100: 1.0})  # the longest name
    assert printed(capsys)[0]["user_metrics"] == ["x" * 100]


def test_progress_prints_the_length_and_later_records_carry_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(report.MODEL_DIR, str(tmp_path))
    report.progress(total=1000)
    report.log(step=10, loss=0.5)
    report.progress(done=20)
    report.progress(total=1200, done=30)  # a corrected length
    records = printed(capsys)
    assert [{k: v for k, v in r.items() if k != "time"} for r in records] == [
        {"event": "step", "step": 0, "total_steps": 1000},
        {"event": "step", "step": 10, "loss": 0.5, "user_metrics": ["loss"], "total_steps": 1000},
        {"event": "step", "step": 20, "total_steps": 1000},
        {"event": "step", "step": 30, "total_steps": 1200}]
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == records


def test_progress_checks_its_arguments(monkeypatch, capsys):
    with pytest.raises(ValueError, match=r"give total .* in the first call"):
        report.progress(done=3)
    for bad in (0, -1, True, 2.5, "10"):
        with pytest.raises(ValueError, match="total must be an int of at least 1"):
            report.progress(total=bad)
    with pytest.raises(ValueError, match="done must be 0 or more"):
        report.progress(total=10, done=-1)
    assert capsys.readouterr().out == ""
    report.progress(total=10)
    report.log(step=4, loss=1.0)
    monkeypatch.setenv("RANK", "1")
    report.progress(done=5)  # another rank: checked, not printed
    printed = [line for line in capsys.readouterr().out.splitlines()]
    assert len(printed) == 2 and '"total_steps":10' in printed[0] and '"total_steps":10' in printed[1]


def test_directories(tmp_path, monkeypatch):
    for call, variable in ((report.model_dir, report.MODEL_DIR), (report.checkpoint_dir, report.CHECKPOINT_DIR)):
        target = tmp_path / variable / "nested"
        monkeypatch.setenv(variable, str(target))
        assert call() == str(target) and target.is_dir()
    monkeypatch.setenv(report.DATA_DIR, str(tmp_path / "data.npz"))
    assert report.data_dir() == str(tmp_path / "data.npz") and not (tmp_path / "data.npz").exists()


@pytest.mark.parametrize("call, variable", [(report.model_dir, report.MODEL_DIR),
                                            (report.checkpoint_dir, report.CHECKPOINT_DIR),
                                            (report.data_dir, report.DATA_DIR)])
def test_directories_outside_the_launcher_say_so(call, variable):
    with pytest.raises(RuntimeError) as info:
        call()
    assert str(info.value).startswith(f"{variable} is not set: run the script under Trainboard's launcher")


def test_importing_report_imports_no_torch():
    code = ("import sys; from trainer_pkg import report; import trainer_pkg; "
            "assert trainer_pkg.report is report; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
