"""jobs/admission.py on real PostgreSQL: a GPU box gives each job its own GPUs, holds back what does
not fit with the reason, starts waiting jobs in priority then submission order when GPUs free up,
keeps to its concurrency limit, refuses a job that can never fit, and two workers admitting at once
never give one GPU to two jobs.

The box is the conftest's "local" gpubox backend with four GPUs set by hand (``gpu_ids`` 0,1,2,3, the
host setting the installation gives it); ``GpuBoxBackend.submit`` is replaced by one that records the
spec it gets, so no torchrun starts (tests/cloud_adapters/gpubox/test_gpubox_inventory.py runs real
jobs on their devices, tests/e2e/test_gpubox_sharing.py the whole path through a worker)."""

from __future__ import annotations

import datetime as dt
import threading
from unittest import mock

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.utils import timezone

from cloud_adapters.base import JobHandle, JobState, JobStatus
from cloud_adapters.gpubox import GpuBoxBackend
from jobs import adapters, admission, deadlines, dispatch, lifecycle, recovery, services, sync
from jobs.models import JobStateChoices as S, TrainingJob
from taskkit import sent_tasks


@pytest.fixture
def box(settings, local_backend):
    """The "local" box with GPUs 0–3 to hand out, up to 4 processes per job."""
    settings.TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE = 4
    settings.TRAINBOARD_GPUBOX_GPU_IDS = "0,1,2,3"
    return local_backend


@pytest.fixture
def submitted():
    """Replaces the box's submit: records ``{job name: devices}`` of each spec it is given."""
    seen: dict[str, tuple[int, ...]] = {}

    def fake_submit(self, spec):
        self.validate(spec)
        seen[spec.job_name] = spec.devices
        return JobHandle("gpubox", spec.job_name, f"/nonexistent/{spec.job_name}")

    with mock.patch.object(GpuBoxBackend, "submit", autospec=True, side_effect=fake_submit):
        yield seen


def create(user, dataset, model, backend, procs: int, **kw) -> TrainingJob:
    with sent_tasks(dispatch.SUBMIT_JOB):
        return services.training_job_create(owner=user, dataset=dataset, model_spec=model, backend=backend,
                                            procs_per_node=procs, epochs=1, **kw)


def submit(job: TrainingJob, capture) -> list[int]:
    """Run the submit task's body for ``job`` as its worker would; returns the ids of the jobs whose
    ``submit_job`` it sent (the wake-ups), once its transactions commit."""
    with sent_tasks(dispatch.SUBMIT_JOB) as send, capture(execute=True):
        lifecycle.training_job_submit(job=TrainingJob.objects.select_related("backend").get(pk=job.pk))
    return [c.kwargs["args"][0] for c in send.call_args_list]


def state(job: TrainingJob) -> tuple[str, list[int], str]:
    job.refresh_from_db()
    return job.state, job.allocated_gpus, job.wait_reason


@pytest.mark.django_db
def test_jobs_get_disjoint_gpus_and_what_does_not_fit_waits_with_the_reason(
        user, digits_dataset, cnn_model, box, submitted, django_capture_on_commit_callbacks):
    capture = django_capture_on_commit_callbacks
    a = create(user, digits_dataset, cnn_model, box, 2)
    b = create(user, digits_dataset, cnn_model, box, 1)
    c = create(user, digits_dataset, cnn_model, box, 2)
    assert submit(a, capture) == [] and state(a) == (S.PENDING, [0, 1], "")
    assert submit(b, capture) == [] and state(b) == (S.PENDING, [2], "")
    assert submit(c, capture) == []
    assert state(c) == (S.QUEUED, [], "waiting for 2 GPUs on local (1 free)")
    # What each run was told to use: exactly its own GPUs.
    assert submitted == {a.provider_job_name: (0, 1), b.provider_job_name: (2,)}
    assert list(c.events.values_list("message", flat=True)) == ["Created", "Waiting: waiting for 2 GPUs on local (1 free)"]
    # The wait is a note made in QUEUED, not a move from QUEUED to QUEUED.
    assert list(c.events.values_list("from_state", "to_state")) == [("", S.QUEUED), (S.QUEUED, "")]
    assert [e.is_note for e in c.events.all()] == [False, True]
    assert a.events.filter(to_state=S.SUBMITTING).get().message == "Submitting to backend local with 2 GPUs 0,1"
    # A waiting job is neither lost nor stalled: no deadline, no re-send as a lost message.
    c.refresh_from_db()
    assert deadlines.state_deadline_s(c) is None
    later = timezone.now() + dt.timedelta(days=1)
    with sent_tasks(dispatch.SUBMIT_JOB):
        assert recovery.requeue_lost_submissions(now=later) == []
        assert c.pk not in recovery.flag_stalled_jobs(now=later)


@pytest.mark.django_db
def test_waiting_jobs_start_in_priority_then_submission_order_as_jobs_end(
        user, digits_dataset, cnn_model, box, submitted, django_capture_on_commit_callbacks, monkeypatch):
    capture = django_capture_on_commit_callbacks
    running = create(user, digits_dataset, cnn_model, box, 4)
    low = create(user, digits_dataset, cnn_model, box, 2)
    high = create(user, digits_dataset, cnn_model, box, 4, priority=5)
    high_later = create(user, digits_dataset, cnn_model, box, 2, priority=5)
    submit(running, capture)
    for job in (low, high, high_later):
        assert submit(job, capture) == []
    assert state(low)[2] == "waiting for 2 GPUs on local (0 free)"
    assert state(high)[2] == "waiting for 4 GPUs on local (0 free)"
    assert state(high_later)[2] == f"waiting behind job #{high.pk} (priority 5)"

    # The sync sees the running job end: its GPUs are free, and the first in line is woken.
    ended = {running.provider_job_name: JobStatus(JobState.SUCCEEDED, raw_state="exited 0")}
    monkeypatch.setattr(GpuBoxBackend, "describe_many", lambda self, handles, changed_since=None: ended)
    monkeypatch.setattr(GpuBoxBackend, "logs", lambda self, handle, cursor="": ([], cursor))
    with sent_tasks(dispatch.SUBMIT_JOB) as send, capture(execute=True):
        sync.backend_sync(backend_id=box.pk)
    assert state(running)[0] == S.SUCCEEDED
    send.assert_called_once_with(args=[high.pk], queue=adapters.backend_queue(box))
    # The woken job starts on the freed GPUs (the ended job's allocation no longer counts) and wakes
    # the next in line, which waits: nothing is left.
    assert submit(high, capture) == [high_later.pk] and state(high) == (S.PENDING, [0, 1, 2, 3], "")
    assert submit(high_later, capture) == []
    assert state(high_later) == (S.QUEUED, [], "waiting for 2 GPUs on local (0 free)")
    # Cancelling a waiting job wakes the next: `low` is behind `high_later` no more once that is gone.
    with sent_tasks(dispatch.SUBMIT_JOB) as send, capture(execute=True):
        services.training_job_cancel(job=high_later)
    send.assert_called_once_with(args=[low.pk], queue=adapters.backend_queue(box))
    assert state(high_later) == (S.CANCELLED, [], "")  # a job out of the queue waits no more


@pytest.mark.django_db
def test_the_concurrency_limit_holds_jobs_that_would_fit(user, digits_dataset, cnn_model, box, submitted, settings,
                                                        django_capture_on_commit_callbacks):
    capture = django_capture_on_commit_callbacks
    settings.TRAINBOARD_GPUBOX_MAX_CONCURRENT_JOBS = 2
    jobs = [create(user, digits_dataset, cnn_model, box, 1) for _ in range(3)]
    for job in jobs:
        submit(job, capture)
    assert [state(j)[:2] for j in jobs[:2]] == [(S.PENDING, [0]), (S.PENDING, [1])]
    assert state(jobs[2]) == (S.QUEUED, [], "waiting: 2 jobs running, the limit of local is 2")


@pytest.mark.django_db
def test_a_job_that_can_never_fit_is_refused_at_create_and_failed_at_submit(
        user, digits_dataset, cnn_model, box, submitted, settings, django_capture_on_commit_callbacks):
    settings.TRAINBOARD_GPUBOX_GPU_IDS = "0,1"
    with pytest.raises(ValidationError) as excinfo:
        create(user, digits_dataset, cnn_model, box, 4)
    assert excinfo.value.message_dict["procs_per_node"] == [
        "4 processes need 4 GPUs (one per process), but this GPU box has 2 GPUs in all (gpu_ids setting), so the "
        "job could never start; ask for 2 or fewer processes per node."]
    # Accepted while the box had four GPUs, then the operator took two away: refused, not queued forever.
    settings.TRAINBOARD_GPUBOX_GPU_IDS = "0,1,2,3"
    job = create(user, digits_dataset, cnn_model, box, 4)
    settings.TRAINBOARD_GPUBOX_GPU_IDS = "0,1"
    submit(job, django_capture_on_commit_callbacks)
    job.refresh_from_db()
    assert job.state == S.FAILED and submitted == {}
    assert job.failure_reason == ("The job needs 4 GPUs (one per process) but local has 2 GPUs in all (gpu_ids "
                                  "setting), so it could never start; re-run it with 2 or fewer processes per node.")


@pytest.mark.django_db
def test_a_duplicate_delivery_of_an_admitted_job_is_given_nothing_more(
        user, digits_dataset, cnn_model, box, submitted, django_capture_on_commit_callbacks):
    job = create(user, digits_dataset, cnn_model, box, 2)
    stale = TrainingJob.objects.select_related("backend").get(pk=job.pk)  # read before the first delivery ran
    submit(job, django_capture_on_commit_callbacks)
    lifecycle.training_job_submit(job=stale)
    assert state(job) == (S.PENDING, [0, 1], "") and len(submitted) == 1


def test_decide_is_the_rule_of_the_module_docstring():
    from cloud_adapters.base import Inventory

    four = Inventory(kind="gpu", devices=(0, 1, 2, 3), source="nvml", max_concurrent_jobs=3)
    assert admission.decide(need=2, inventory=four, backend_name="box-a", holding=[[1], [3]], ahead=None).devices == (0, 2)
    assert admission.decide(need=4, inventory=four, backend_name="box-a", holding=[[1], [3]],
                            ahead=None).wait_reason == "waiting for 4 GPUs on box-a (2 free)"
    assert admission.decide(need=1, inventory=four, backend_name="box-a", holding=[[0], [1], [2]],
                            ahead=None).wait_reason == "waiting: 3 jobs running, the limit of box-a is 3"
    ahead = TrainingJob(pk=12, priority=5)
    assert admission.decide(need=1, inventory=four, backend_name="box-a", holding=[],
                            ahead=ahead).wait_reason == "waiting behind job #12 (priority 5)"
    slots = Inventory(kind="slot", devices=(0, 1), source="max processes per node")
    assert admission.decide(need=2, inventory=slots, backend_name="local", holding=[[0, 1]],
                            ahead=None).wait_reason == "waiting for 2 slots on local (0 free)"


@pytest.mark.django_db(transaction=True)
def test_two_workers_admitting_at_once_never_give_one_gpu_to_two_jobs(user, digits_dataset, cnn_model, box, settings,
                                                                      submitted):
    """Two threads, each on its own PostgreSQL session, admit two jobs of 2 GPUs on a box of 3. Each
    waits for the other inside the admission decision: without the backend's row lock both would
    decide on the same free GPUs; with it the second decides only after the first committed."""
    settings.TRAINBOARD_GPUBOX_GPU_IDS = "0,1,2"
    jobs = [create(user, digits_dataset, cnn_model, box, 2) for _ in range(2)]
    inside = threading.Barrier(2)
    decide = admission.decide
    overlapped = []

    def decide_together(**kwargs):
        try:
            inside.wait(timeout=3)  # the other thread gets in too only if nothing serializes them
            overlapped.append(True)
        except threading.BrokenBarrierError:
            pass
        return decide(**kwargs)

    errors = []

    def worker(job_id):
        try:
            with sent_tasks(dispatch.SUBMIT_JOB):
                lifecycle.training_job_submit(job=TrainingJob.objects.select_related("backend").get(pk=job_id))
        except Exception as exc:  # reported below, with the thread's own error
            errors.append(exc)
        finally:
            connection.close()

    with mock.patch.object(admission, "decide", side_effect=decide_together):
        threads = [threading.Thread(target=worker, args=(job.pk,)) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert overlapped == []  # the two decisions never ran at the same time
    results = sorted(state(job) for job in jobs)
    assert results == [(S.PENDING, [0, 1], ""), (S.QUEUED, [], "waiting for 2 GPUs on local (1 free)")]


@pytest.mark.django_db
def test_the_recovery_sweep_wakes_each_boxs_first_waiting_job_should_a_wake_up_be_lost(
        user, digits_dataset, cnn_model, box, submitted, django_capture_on_commit_callbacks):
    capture = django_capture_on_commit_callbacks
    holder = create(user, digits_dataset, cnn_model, box, 4)
    first, second = (create(user, digits_dataset, cnn_model, box, 2) for _ in range(2))
    for job in (holder, first, second):
        submit(job, capture)
    # The holder ended, but the message that would have woken `first` was lost.
    TrainingJob.objects.filter(pk=holder.pk).update(state=S.SUCCEEDED)
    with sent_tasks(dispatch.SUBMIT_JOB) as send, capture(execute=True):
        assert recovery.recovery_sweep()["woken"] == 1
    send.assert_called_once_with(args=[first.pk], queue=adapters.backend_queue(box))
    assert submit(first, capture) == [second.pk] and state(first) == (S.PENDING, [0, 1], "")
    assert submit(second, capture) == [] and state(second) == (S.PENDING, [2, 3], "")


@pytest.mark.django_db
def test_a_box_whose_gpus_nvml_cannot_list_fails_the_job_saying_what_to_fix(
        user, digits_dataset, cnn_model, local_backend, submitted, django_capture_on_commit_callbacks, monkeypatch,
        tmp_path):
    import sys
    import types

    from cloud_adapters.gpubox import inventory

    job = create(user, digits_dataset, cnn_model, local_backend, 2)
    # On the box: GPU device nodes, but no NVML (nvidia-ml-py without a driver that answers).
    (tmp_path / "nvidia0").touch()
    monkeypatch.setattr(inventory, "DEV_DIR", str(tmp_path))
    broken = types.ModuleType("pynvml")
    broken.NVMLError = RuntimeError
    broken.nvmlInit = lambda: (_ for _ in ()).throw(RuntimeError("Driver Not Loaded"))
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    submit(job, django_capture_on_commit_callbacks)
    job.refresh_from_db()
    assert job.state == S.FAILED and submitted == {}
    assert job.failure_reason.startswith(f"Backend local cannot say which devices it has: this GPU box has NVIDIA "
                                         f"devices ({tmp_path}/nvidia0) but NVML cannot list them")
