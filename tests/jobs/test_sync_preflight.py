"""The network preflight end to end (trainer_pkg.preflight, jobs.preflight, issue 30): the real launcher
starts 2 ranks on gloo (real torch, torch's ``env://`` store hosted by rank 0) with the backend's
variables; its stdout, as a backend's log carries it, goes through the sync; the job keeps the figures and
its page and the API show them.

- A user's script: the ranks measure the network before the script's first line, then the script's own
  ``init_process_group`` and all-reduce work on the same store; the figures are positive and stored.
- Our trainer, with a minimum bus bandwidth above what loopback gives: every rank stops before the first
  step, and the job is FAILED with the preflight's reason naming the pair."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
from pathlib import Path

import pytest
from django.template.defaultfilters import floatformat
from django.urls import reverse
from rest_framework.test import APIClient

from cloud_adapters.base import JobState, JobStatus
from jobs import sync
from jobs.models import JobEvent, JobStateChoices as S
from test_sync import T0, ScriptedBackend, scripted_backend, submitted_job  # noqa: F401 (fixtures)
from trainer_pkg import preflight
from trainer_pkg.config import JobConfig
from trainer_pkg.launch import failure_message
from trainer_pkg.metrics import parse_metric_line

pytestmark = pytest.mark.django_db

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """\
import os

import torch
import torch.distributed as dist

from trainer_pkg import report

with open(os.path.join(report.model_dir(), "script-rank%s" % os.environ["RANK"]), "w") as f:
    f.write("ran")
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
report.log(step=1, world=float(t.item()))
dist.destroy_process_group()
"""


def launch(tmp_path: Path, config: dict, **variables: str) -> tuple[int, list[str], str]:
    """``python -m trainer_pkg.launch --config job.json --standalone --nproc-per-node 2`` with the preflight
    on: (exit code, stdout lines, stderr)."""
    config_path = tmp_path / "job.json"
    config_path.write_text(json.dumps({"output": {"output_dir": str(tmp_path / "out")}, **config}))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DATABASE_URL")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TRAINBOARD_HARDWARE_EVERY_S="0",
               **{preflight.ENABLE_VAR: "1"}, **variables)
    from standins import torchrun_lite  # the real launcher and ranks; a torchrun that imports no torch

    result = subprocess.run([torchrun_lite.python(), "-m", "trainer_pkg.launch", "--config", str(config_path),
                             "--standalone", "--nproc-per-node", "2"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    return result.returncode, result.stdout.splitlines(), result.stderr


def sync_with(job, lines: list[str], status: JobStatus) -> None:
    ScriptedBackend.statuses = [status]
    ScriptedBackend.log_chunks = [lines]
    sync.backend_sync(backend_id=job.backend_id)
    job.refresh_from_db()


def test_a_script_jobs_ranks_measure_the_network_before_its_first_line_and_the_page_shows_it(
        tmp_path, client, user, submitted_job):
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(SCRIPT)
    rc, lines, stderr = launch(tmp_path, {"code": {"dir": str(code), "script": "train.py"}})
    assert rc == 0, stderr[-3000:]
    records = [r for line in lines if (r := parse_metric_line(line))]
    assert [r["event"] for r in records] == ["preflight", "step"]  # before the script's first record
    record, step = records
    assert step["world"] == 2.0  # the script's own process group, after the preflight's
    assert (tmp_path / "out" / "script-rank1").read_text() == "ran"
    # A passing record is in the log only: metrics.jsonl is the run's own (the hang watchdog reads it).
    assert [json.loads(line)["event"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()] == [
        "step"]
    assert (record["world_size"], record["nodes"], record["backend"], record["device"]) == (2, 1, "gloo", "cpu")
    assert (record["ok"], record["reason"], record["min_busbw_gbps"], record["max_latency_us"]) == (True, "", None, None)
    assert [s["bytes"] for s in record["sizes"]] == list(preflight.GLOO_SIZES)
    for size in record["sizes"]:
        assert size["time_us"] > 0 and size["algbw_gbps"] > 0
        assert size["busbw_gbps"] == size["algbw_gbps"]  # 2 ranks: 2(n-1)/n = 1
    assert record["busbw_gbps"] == record["sizes"][-1]["busbw_gbps"] > 0
    assert record["latency_us"] > 0
    [pair] = record["pairs"]
    assert (pair["units"], pair["ranks"], record["pair_unit"], record["pairs_measured"]) == ([0, 1], [0, 1], "rank", 1)
    assert pair["gbps"] > 0 and pair["hosts"][0] == pair["hosts"][1] != ""
    assert any(line.startswith("[preflight] passed") for line in lines)

    sync_with(submitted_job, lines, JobStatus(JobState.RUNNING, raw_state="InProgress", started_at=T0))
    job = submitted_job
    assert job.state == S.RUNNING
    stored = job.preflight
    assert (stored["busbw_gbps"], stored["latency_us"], stored["ok"]) == (record["busbw_gbps"], record["latency_us"], True)
    assert stored["pairs"][0]["gbps"] == pair["gbps"] and stored["time"] == record["time"]
    summary = (f"Preflight passed: all-reduce bus bandwidth {record['busbw_gbps']:.3g} GB/s, latency "
               f"{record['latency_us']:.0f} µs, slowest pair {pair['gbps']:.3g} GB/s (2 ranks on 1 node, gloo)")
    assert JobEvent.objects.filter(job=job, message=summary).count() == 1

    client.force_login(user)
    page = client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert "<strong>Network preflight passed.</strong>" in page
    # The page's rounding is Django's (floatformat: decimal, half up), not Python's.
    assert f'<span class="mono" id="preflight-busbw">{floatformat(record["busbw_gbps"], 3)} GB/s</span>' in page
    assert f'<span class="mono" id="preflight-latency">{floatformat(record["latency_us"], 0)} µs</span>' in page
    assert f'id="preflight-slowest-pair">{floatformat(pair["gbps"], 3)} GB/s</span>' in page
    assert f"<td>32 MiB</td><td class=\"mono\">{floatformat(record['sizes'][-1]['time_us'], 1)} µs</td>" in page
    api = APIClient()
    api.force_authenticate(user)
    body = api.get(f"/api/jobs/{job.pk}/").json()["preflight"]
    assert (body["busbw_gbps"], body["latency_us"], body["ok"], body["reason"]) == (
        record["busbw_gbps"], record["latency_us"], True, "")
    assert [s["bytes"] for s in body["sizes"]] == list(preflight.GLOO_SIZES)
    assert body["pairs"] == [{"units": [0, 1], "ranks": [0, 1], "hosts": pair["hosts"], "gbps": pair["gbps"]}]
    assert body["at"] == dt.datetime.fromtimestamp(record["time"], dt.timezone.utc).isoformat().replace("+00:00", "Z")


def test_a_network_below_the_backends_minimum_stops_the_trainer_before_its_first_step(
        tmp_path, client, user, submitted_job):
    # 100,000 GB/s: the ceiling of the setting, far above what loopback moves on any machine.
    rc, lines, stderr = launch(tmp_path, {"train": {"epochs": 1, "max_steps": 2}},
                               **{preflight.MIN_BUSBW_VAR: "100000"})
    assert rc == 1, stderr[-3000:]  # torchrun's code when a rank failed; each rank exited 3
    assert "exitcode  : 3" in stderr
    records = [r for line in lines if (r := parse_metric_line(line))]
    assert [r["event"] for r in records] == ["preflight"]  # no training record: stopped before step 1
    [record] = records
    host = record["pairs"][0]["hosts"][0]
    assert record["ok"] is False and record["min_busbw_gbps"] == 100000.0
    assert record["reason"] == (
        f"Preflight: all-reduce bus bandwidth {record['busbw_gbps']:.3g} GB/s is below the backend's minimum of "
        f"100000 GB/s (2 ranks on 1 node, gloo, 32 MiB); the pair rank 0 ({host}) ↔ rank 1 ({host}) "
        f"{record['pairs'][0]['gbps']:.3g} GB/s is below 100000 GB/s. The run was stopped before its first step.")
    assert not (tmp_path / "out" / "model.pt").exists()
    # The launcher's own failure message (SageMaker's failure file) is the preflight's reason too.
    last = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "preflight" and last["reason"] == record["reason"]
    cfg = JobConfig.from_dict({"output": {"output_dir": str(tmp_path / "out")}})
    assert failure_message(cfg, 1, since=record["time"] - 1) == f"{record['reason']} (exit code 1)"

    # The log read while the provider still says the job starts: the reason is on the page already.
    sync_with(submitted_job, lines, JobStatus(JobState.PENDING, raw_state="InProgress"))
    job = submitted_job
    assert job.state == S.PENDING and job.preflight["ok"] is False
    client.force_login(user)
    page = client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert '<span id="preflight-reason">Preflight: all-reduce bus bandwidth' in page
    sync_with(job, [], JobStatus(JobState.FAILED, raw_state="Failed", failure_reason="exit code 1",
                                 started_at=T0, ended_at=T0 + dt.timedelta(seconds=20)))
    assert job.state == S.FAILED
    assert job.failure_reason == f"{record['reason']} (the backend reported: exit code 1)"
    assert job.preflight["ok"] is False and job.preflight["busbw_gbps"] == record["busbw_gbps"]
    page = client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert "<strong>Network preflight failed.</strong>" in page
    assert "this backend's minimum 100000 GB/s, maximum latency none)" in page
    assert '<strong>Failed.</strong> Preflight: all-reduce bus bandwidth' in page
    assert 'id="preflight-reason"' not in page  # said once, in the failure's alert
