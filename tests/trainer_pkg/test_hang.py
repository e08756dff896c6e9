"""Hang detection in the launcher (trainer_pkg/hang.py, issue 30): one real 2-rank run on gloo whose
rank 1 blocks before an all-reduce, and the pieces (deadline, dump parsing, where) without processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

from test_platforms import clean_env
from trainer_helpers import REPO, python
from trainer_pkg import hang
from trainer_pkg.metrics import parse_metric_line
from user_scripts import write_code

BLOCKING_SCRIPT = """\
import time

import torch
import torch.distributed as dist

from trainer_pkg import report

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
report.log(step=1, loss=float(t.item()))
if dist.get_rank() == 1:
    time.sleep(600)
dist.all_reduce(t)
report.log(step=2, loss=float(t.item()))
"""
SLEEP_LINE = BLOCKING_SCRIPT.splitlines().index("    time.sleep(600)") + 1  # 13
ALL_REDUCE_LINE = SLEEP_LINE + 1


def test_a_rank_blocked_before_an_all_reduce_is_reported_with_both_ranks_stacks(tmp_path):
    code_dir = write_code(tmp_path / "code", BLOCKING_SCRIPT)
    config = tmp_path / "job.json"
    config.write_text(json.dumps({"output": {"output_dir": str(tmp_path / "out")},
                                  "code": {"dir": str(code_dir), "script": "train.py"}}))
    # A 2 s deadline through the launcher's variable: the job itself is not slowed, only watched closely.
    proc = subprocess.Popen([python(), "-m", "trainer_pkg.launch", "--config", str(config), "--standalone",
                             "--nproc-per-node", "2"], cwd=REPO, env=clean_env(TRAINBOARD_HANG_DEADLINE_S="2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hangs, lines = {}, []
    # A safety net, not a timing: should no record come, the run is stopped and readline sees its end.
    guard = threading.Timer(180, proc.kill)
    guard.start()
    try:
        while len(hangs) < 2:
            line = proc.stdout.readline()
            assert line, f"the launcher ended before reporting the hang: {lines[-20:]} {proc.stderr.read()[-3000:]}"
            lines.append(line.rstrip("\n"))
            record = parse_metric_line(line)
            if record and record["event"] == "hang":
                hangs[record["rank"]] = record
        proc.send_signal(signal.SIGTERM)  # the job is cancelled as the dashboard would: torchrun stops the ranks
        proc.wait(timeout=60)
    finally:
        guard.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()

    one, zero = hangs[1], hangs[0]
    assert one["where"] == f"in <module>, train.py:{SLEEP_LINE}"
    assert zero["where"] == f"in all_reduce, train.py:{ALL_REDUCE_LINE}"
    for record in (zero, one):
        assert (record["step"], record["deadline_s"], record["world_size"]) == (1, 2.0, 2)
        assert record["time"] - record["step_time"] >= 2.0  # flagged after the deadline, not before
        main = record["threads"][0]
        assert main["main"] is True
        user = [f for f in main["frames"] if f["file"] == str(code_dir / "train.py")]
        assert user[0]["function"] == "<module>"
    assert zero["time"] == one["time"]  # one stall, one detection time for both ranks
    # time.sleep is C: rank 1's innermost Python frame is the script's own line.
    assert one["threads"][0]["frames"][0] == {"file": str(code_dir / "train.py"), "line": SLEEP_LINE,
                                               "function": "<module>"}
    assert f"[launch] rank 1: in <module>, train.py:{SLEEP_LINE}" in lines
    assert any(line.startswith("[launch] hang: no new step for ") and "after step 1" in line for line in lines)


DUMP = """\
Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 629 in wait
  File "/venv/lib/python3.11/site-packages/torch/utils/data/_utils/pin_memory.py", line 52 in _pin_memory_loop

Current thread 0x00007f0000000001 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1250 in _next_data
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 733 in __next__
  File "/code/train.py", line 212 in train
  File "/code/train.py", line 300 in <module>
"""


def test_parse_dump_puts_the_main_thread_first_and_where_names_the_own_line():
    threads = hang.parse_dump(DUMP, main_thread=0x7F0000000001)
    assert [(t["thread"], t["main"], len(t["frames"])) for t in threads] == [
        ("0x00007f0000000001", True, 4), ("0x00007f0000000002", False, 3)]
    assert threads[0]["frames"][2] == {"file": "/code/train.py", "line": 212, "function": "train"}
    assert hang.where(threads) == "in _next_data, train.py:212"
    assert hang.where([]) == "" and hang.parse_dump("garbage\n\x00") == []


def test_deadline_from_the_step_time_the_variable_and_its_floor():
    assert hang.deadline_s([], {}) == 600.0
    # 10 steps in 450 s: 45 s a step × 20 = 900 s (more than 3 × the 225 s between records).
    assert hang.deadline_s([(0, 1000.0), (5, 1225.0), (10, 1450.0)], {}) == 900.0
    # Records 1,000 s apart with steps between: 3 × the record interval.
    assert hang.deadline_s([(0, 0.0), (1000, 1000.0), (2000, 2000.0)], {}) == 3000.0
    assert hang.deadline_s([(0, 0.0)], {hang.DEADLINE_VAR: "2.5"}) == 2.5
    assert hang.deadline_s([], {hang.DEADLINE_VAR: "0"}) == 0.0
    assert hang.deadline_s([], {hang.DEADLINE_VAR: "soon"}) == 600.0
    assert hang.deadline_s([], {hang.DEADLINE_VAR: "nan"}) == 600.0


def test_watchdog_arms_at_the_first_step_reports_once_and_rearms(tmp_path):
    metrics, emitted, now = tmp_path / "metrics.jsonl", [], [100.0]
    metrics.write_text('{"event": "completed", "step": 2, "time": 10.0}\n')  # an earlier run's: not this one's
    dog = hang.Watchdog(str(metrics), str(tmp_path), world_size=1, env={hang.DEADLINE_VAR: "5"},
                        emit=emitted.append, clock=lambda: now[0])
    assert dog.check() is None  # no step of this run: not armed
    with metrics.open("a") as f:  # the 2nd line half written
        f.write('{"event": "step", "step": 3, "time": 99.5}\n{"event": "st')
    assert dog.check() == 5.0 and emitted == []
    now[0] = 105.0
    dog.check()
    assert emitted[0] == "[launch] hang: no new step for 5 s (deadline 5 s) after step 3; the ranks' stacks follow"
    assert len(emitted) == 1  # no rank announced itself in tmp_path: nothing signalled
    now[0] = 200.0
    dog.check()
    assert len(emitted) == 1  # once per stall
    with metrics.open("a") as f:
        f.write('ep", "step": 4, "time": 199.0}\n')
    dog.check()
    assert dog.recent == [(3, 99.5), (4, 199.0)] and not dog.reported


def test_a_pid_file_of_a_process_without_the_stack_file_open_is_never_signalled(tmp_path):
    # This test process announces itself as rank 0 without holding the stack file: a stale pid file
    # (the rank exited, its pid reused). SIGUSR1 would end pytest; it must not be sent.
    (tmp_path / "rank-0.pid").write_text(json.dumps({"pid": os.getpid(), "rank": 0, "main_thread": 1}))
    assert hang.dump_ranks(str(tmp_path), wait_s=0.2) == {0: []}
    with open(tmp_path / "rank-0.stack", "a") as f:
        assert hang.holds_open(os.getpid(), f.name)
    assert not hang.holds_open(os.getpid(), str(tmp_path / "rank-0.stack"))
