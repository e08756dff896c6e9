"""The trainer's measured memory per rank (``rank_memory`` of its epoch and completed records) through
the sync: the last one is kept on the job and the job page shows it beside the plan."""

from __future__ import annotations

import pytest
from django.urls import reverse

from cloud_adapters.base import JobState, JobStatus
from jobs import sync
from jobs.models import JobStateChoices as S
from jobs.selectors import training_job_memory
from test_sync import T0, ScriptedBackend, rec, scripted_backend, submitted_job  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db


def ranks(*peaks: int, device: str = "cpu") -> list[dict]:
    return [{"peak_bytes": p, "params_bytes": p // 4, "grads_bytes": p // 4, "optimizer_bytes": p // 4,
             "activations_bytes": p - 3 * (p // 4), "device": device} for p in peaks]


def test_the_last_rank_memory_is_kept_and_shown_beside_the_plan(submitted_job, scripted_backend, client, user):
    job = submitted_job
    assert job.memory_plan["strategy"] == "ddp" and job.memory_plan["fits"] is None  # no GPU known: not checked
    ScriptedBackend.statuses = [JobStatus(JobState.RUNNING, raw_state="InProgress", started_at=T0, instance_count=2)]
    ScriptedBackend.log_chunks = [[
        rec("epoch", epoch=0, step=10, rank_memory=ranks(1000, 2000, 1500, 1200)),
        rec("epoch", epoch=1, step=20, rank_memory=ranks(1100, 2100, 1600, 1300)),
        rec("epoch", epoch=2, step=30, rank_memory="not a list"),  # a malformed one never replaces it
        rec("step", step=31, rank_memory=ranks(1)),  # a step record carries none
    ]]
    assert sync.backend_sync(backend_id=scripted_backend.pk) == 1
    job.refresh_from_db()
    assert job.state == S.RUNNING
    assert job.rank_memory == ranks(1100, 2100, 1600, 1300)

    memory = training_job_memory(job=job)
    assert (memory["busiest_rank"], memory["device"], memory["cpu"]) == (1, "cpu", True)
    rows = {r["label"]: r for r in memory["rows"]}
    assert rows["Parameters"]["measured"] == "525 B"  # rank 1's 2100 // 4
    planned = job.memory_plan
    cpu_peak = sum(planned[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes"))
    assert rows["Peak per rank (CPU: the four terms above)"]["ratio"] == f"{cpu_peak / 2100:.2f}"

    client.force_login(user)
    page = client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert "Memory per rank: plan and measurement" in page
    assert "Measured (rank 1, cpu)" in page
    assert "Measured peak by rank: 0: 1.1 KiB, 1: 2.1 KiB, 2: 1.6 KiB, 3: 1.3 KiB." in page


@pytest.mark.parametrize("record, kept", [
    ({"event": "completed", "rank_memory": ranks(5)}, ranks(5)),
    ({"event": "epoch", "rank_memory": [{"peak_bytes": -1, "params_bytes": True, "device": "tpu", "x": 1}]},
     [{"peak_bytes": None, "params_bytes": None, "grads_bytes": None, "optimizer_bytes": None,
       "activations_bytes": None, "device": ""}]),
    ({"event": "epoch", "rank_memory": [1, 2]}, None),
    ({"event": "epoch", "rank_memory": []}, None),
    ({"event": "started", "rank_memory": ranks(5)}, None),
])
def test_rank_memory_from_a_record(record, kept):
    assert sync.rank_memory_from_record(record) == kept


def test_on_cpu_the_offloaded_shards_are_planned_where_the_trainer_measures_them(submitted_job):
    """fsdp with cpu_offload measured on CPU: the plan's parameter, gradient and optimizer terms are 0 on
    a GPU but held in the host's memory, which is what the trainer measures there. The table adds them
    back (the new-user trial found 0 planned beside the measured shards); on a GPU it leaves them out."""
    job = submitted_job
    job.memory_plan = {**job.memory_plan, "params_bytes": 0, "grads_bytes": 0, "optimizer_bytes": 0,
                       "activations_bytes": 800, "host_bytes": 900,
                       "offloaded": {"params_bytes": 200, "grads_bytes": 200, "optimizer_bytes": 500}}
    job.rank_memory = ranks(2000)
    rows = {r["label"]: r for r in training_job_memory(job=job)["rows"]}
    assert rows["Parameters (offloaded to the host)"]["planned"] == "200 B"
    assert rows["Optimizer state (offloaded to the host)"]["planned"] == "500 B"
    assert rows["Activations"]["planned"] == "800 B"
    assert rows["Peak per rank (CPU: the four terms above)"]["planned"] == "1.7 KiB"  # 200 + 200 + 500 + 800
    assert rows["Peak per rank (CPU: the four terms above)"]["ratio"] == f"{1700 / 2000:.2f}"
    job.rank_memory = ranks(2000, device="cuda:0")
    rows = {r["label"]: r for r in training_job_memory(job=job)["rows"]}
    assert rows["Parameters"]["planned"] == "0 B"
    assert "Parameters (offloaded to the host)" not in rows
