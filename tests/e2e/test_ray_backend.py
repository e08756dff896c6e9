"""End to end on a Ray cluster: the real Celery worker (embedded beat, Redis, PostgreSQL) drives ``ray``
backend jobs over HTTP against a real Ray 2.60 head on this machine (tests/raykit.py, from the Ray test
venv; the worker itself has no ``ray``):

- a 1 × 2 digits DDP job reaches SUCCEEDED with its metrics read from the Ray job's log into the
  database and its cost at the cluster's internal rate per worker-hour; the adapter reads its log by
  cursor, and the lines the sync stored as the log grew are the log's, each once
  (tests/cloud_adapters/ray_cluster/ holds the adapter's other jobs against the same head);
- a cancel stops the Ray job: CANCELLED once Ray reports STOPPED.

The backend is a staff user's, so its dashboard address is its own setting (a non-staff backend takes
the installation's TRAINBOARD_RAY_ADDRESS).
"""

from __future__ import annotations

from decimal import Decimal

import pytest

from cloud_adapters.base import JobHandle
from cloud_adapters.registry import create_backend
from jobs import selectors, services
from jobs.models import JobLogLine, JobStateChoices as S, MetricPoint, TrainingJob
from jobs.services.prices import instance_price_save
from polling import read_whole_log
from raykit import head, ray_python  # noqa: F401 (fixtures: one head for the ray-backend group)
from trainer_pkg.metrics import parse_metric_line

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True),
              pytest.mark.xdist_group("ray-backend")]

RATE = Decimal("0.9")  # USD per worker-hour on cluster lab


@pytest.fixture(scope="module")
def worker(django_db_blocker, celery_worker_factory, tmp_path_factory):
    directory = tmp_path_factory.mktemp("ray-worker")
    with django_db_blocker.unblock():
        with celery_worker_factory(directory, directory / "runs", queues="celery") as running:
            yield running


@pytest.fixture
def ray_backend(head, user):
    instance_price_save(provider="ray", region="lab", instance_type="worker", usd_per_hour=RATE)
    return services.backend_create(owner=user, name="lab-ray", kind="ray", config={
        "address": head.address, "python": str(head.python), "cluster": "lab", "output_path": f"{head.temp_dir}/out"})


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


def _ended(worker, job, timeout=400):
    return worker.wait_for(lambda: (j := _reload(job)).is_terminal and j, timeout=timeout, what="the job to end")


def test_digits_on_two_ray_workers_succeeds_with_metrics_and_cost(worker, ray_backend, head, user, digits_dataset,
                                                                  cnn_model):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=ray_backend,
                                       nodes=1, procs_per_node=2, epochs=2)
    job = _ended(worker, job)
    assert job.state == S.SUCCEEDED, (job.failure_reason, worker.log()[-3000:])
    events = [e.to_state for e in selectors.training_job_events(job=job)]
    assert events[:2] == ["QUEUED", "SUBMITTING"] and events[-2:] == ["RUNNING", "SUCCEEDED"]
    assert job.provider_job_name and job.provider_handle["provider"] == "ray"

    val = list(MetricPoint.objects.filter(job=job, name="val_accuracy", rank__isnull=True)
               .order_by("step").values_list("epoch", flat=True))
    assert val == [0, 1]
    assert MetricPoint.objects.filter(job=job, name="rank_samples_per_s", rank=1).exists()  # 2 ranks

    run_s = (job.ended_at - job.started_at).total_seconds()
    assert run_s > 0
    # cost = elapsed × 2 workers × $0.90 per worker-hour
    assert float(job.cost_usd) == pytest.approx(2 * float(RATE) * run_s / 3600, rel=0.02, abs=0.0001)

    # The Ray job as the adapter reads it: both ranks under torchrun's environment, one completed record,
    # Ray's log dedup off; the log read from its end (State API tails) to its end by cursor, and again from
    # the start: the same lines and the same cursor.
    adapter = create_backend("ray", {"address": head.address})
    handle = JobHandle.from_dict(job.provider_handle)
    status = adapter.describe(handle)
    assert (status.raw_state, status.instance_count) == ("SUCCEEDED", 2)
    assert status.started_at is not None and status.ended_at > status.started_at
    lines, cursor = read_whole_log(adapter, handle)
    assert sorted(ln.split("[launch] rank ")[1][:1] for ln in lines if "[launch] rank " in ln) == ["0", "1"]
    assert any("[launch] platform: torchrun" in ln and "world size 2" in ln for ln in lines)
    records = [r for r in map(parse_metric_line, lines) if r is not None]
    completed = [r for r in records if r["event"] == "completed"]
    assert len(completed) == 1 and completed[0]["world_size"] == 2 and completed[0]["total_steps"] > 0
    assert not any("repeated" in ln and "across cluster" in ln for ln in lines)
    assert adapter.logs(handle, cursor) == ([], cursor)
    first, after_first = adapter.logs(handle, "")
    assert first and first == lines[: len(first)] and after_first.startswith("t1:")
    assert read_whole_log(adapter, handle) == (lines, cursor)
    assert not any(ln.startswith("[trainboard]") for ln in lines)  # no line skipped
    # What the sync stored while the log grew, read pass by pass from its tail: every line once, in order.
    plain = [ln for ln in lines if parse_metric_line(ln) is None]
    worker.wait_for(lambda: list(JobLogLine.objects.filter(job=job).order_by("seq")
                                 .values_list("text", flat=True)) == plain, timeout=60,
                    what="the stored log to be the Ray job's log")
    assert [p.name for p in adapter.list_tagged()] == []  # ended: not an orphan candidate


def test_cancel_stops_the_ray_job_and_gives_cancelled(worker, ray_backend, head, user, digits_dataset, cnn_model):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=ray_backend,
                                       nodes=1, procs_per_node=2, epochs=500)
    worker.wait_for(lambda: _reload(job).state == S.RUNNING, timeout=300, what="the job to run")
    services.training_job_cancel(job=_reload(job))
    job = _ended(worker, job, timeout=180)
    assert job.state == S.CANCELLED, (job.failure_reason, worker.log()[-3000:])
    adapter = create_backend("ray", {"address": head.address})
    status = adapter.describe(JobHandle.from_dict(job.provider_handle))
    assert status.raw_state == "STOPPED"
