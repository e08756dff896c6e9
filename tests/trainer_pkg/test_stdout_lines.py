"""A node's ranks share torchrun's stdout pipe: every line the launcher, the trainer and
``report.log`` print reaches the file descriptor in ONE write, so another rank's line cannot land
between a record and its newline (a record was lost that way from a 2-rank run's log in CI).

stdout is built as ``python -u`` builds it (torchrun starts ranks so): a text layer that writes
through to an unbuffered raw file, here one that records each write it receives.
"""

from __future__ import annotations

import io
import json

from trainer_pkg import report
from trainer_pkg.metrics import format_metric_line, parse_metric_line, print_line


class _RawPipe(io.RawIOBase):
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.writes.append(bytes(data))
        return len(data)


def _unbuffered_stdout(monkeypatch) -> _RawPipe:
    raw = _RawPipe()
    monkeypatch.setattr("sys.stdout", io.TextIOWrapper(raw, encoding="utf-8", write_through=True))
    return raw


def test_print_line_is_one_write_where_print_is_two(monkeypatch):
    raw = _unbuffered_stdout(monkeypatch)
    print("[launch] rank 1", flush=True)
    assert raw.writes == [b"[launch] rank 1", b"\n"]  # why print_line exists
    raw.writes.clear()
    record = {"event": "step", "step": 40, "time": 1.5, "train_loss": 0.25}
    print_line(format_metric_line(record))
    assert len(raw.writes) == 1 and raw.writes[0].endswith(b"\n")
    assert parse_metric_line(raw.writes[0].decode()) == record


def test_report_log_prints_its_record_in_one_write(monkeypatch, tmp_path):
    raw = _unbuffered_stdout(monkeypatch)
    monkeypatch.setattr(report, "_last_step", -1)  # restored after the test
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TRAINBOARD_MODEL_DIR", str(tmp_path))
    report.log(step=7, my_loss=0.5)
    assert len(raw.writes) == 1
    printed = parse_metric_line(raw.writes[0].decode())
    assert (printed["step"], printed["my_loss"], printed["user_metrics"]) == (7, 0.5, ["my_loss"])
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["my_loss"] == 0.5


def test_finish_runs_the_atexit_handlers_flushes_and_exits_with_the_code():
    """``report.finish`` leaves without the interpreter's teardown (torch's gloo threads can abort
    it), after the script's atexit handlers and with its buffered output flushed."""
    import subprocess
    import sys

    from trainer_helpers import REPO, trainer_env

    script = ("import atexit, sys\nfrom trainer_pkg import report\n"
              "atexit.register(lambda: print('atexit handler ran'))\n"
              "sys.stdout.write('buffered, no newline')\nsys.stderr.write('err')\nreport.finish(3)\n"
              "print('never')\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=trainer_env(), capture_output=True,
                         text=True, timeout=60)
    assert (run.returncode, run.stdout, run.stderr) == (3, "buffered, no newlineatexit handler ran\n", "err")
