"""jobs/lifecycle.py: submit (a failure, a transient error retried, a duplicate delivery)."""

from unittest import mock

import pytest

from cloud_adapters.base import CredentialsError, JobHandle, Throttled
from cloud_adapters.gpubox import GpuBoxBackend
from jobs import adapters, dispatch, lifecycle, services, tasks
from jobs.models import JobStateChoices as S
from taskkit import sent_tasks

pytestmark = pytest.mark.django_db


def _create(user, dataset, model, backend, **kw):
    args = dict(owner=user, dataset=dataset, model_spec=model, backend=backend, nodes=1,
                procs_per_node=2, epochs=3)
    args.update(kw)
    return services.training_job_create(**args)


def test_submit_failure_is_failed_with_message(user, digits_dataset, cnn_model, local_backend):
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = _create(user, digits_dataset, cnn_model, local_backend)
    with mock.patch.object(GpuBoxBackend, "submit", side_effect=CredentialsError("no key; run aws configure")):
        tasks.submit_job(job.pk)
    job.refresh_from_db()
    assert job.state == S.FAILED and job.failure_reason == "no key; run aws configure"
    assert list(job.events.values_list("to_state", flat=True)) == ["QUEUED", "SUBMITTING", "FAILED"]


def test_submit_transient_error_is_retried_not_failed(user, digits_dataset, cnn_model, local_backend):
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = _create(user, digits_dataset, cnn_model, local_backend)
    with mock.patch.object(GpuBoxBackend, "submit", side_effect=Throttled("slow down")), \
            mock.patch.object(tasks.submit_job, "retry", side_effect=RuntimeError("retry scheduled")) as retry:
        with pytest.raises(RuntimeError, match="retry scheduled"):
            tasks.submit_job(job.pk)
    assert retry.call_count == 1
    job.refresh_from_db()
    assert job.state == S.SUBMITTING and "slow down" in job.status_warning
    # The retry resumes the SUBMITTING job.
    with mock.patch.object(GpuBoxBackend, "submit", return_value=JobHandle("gpubox", job.provider_job_name)):
        lifecycle.training_job_submit(job=job, retrying=True)
    assert job.state == S.PENDING


def test_submit_delivered_twice_starts_one_torchrun(user, digits_dataset, cnn_model, local_backend, run_root,
                                                    wait_until, live_processes, trainer_standin):
    # The trainer stand-in (named on the staff owner's backend row), held before its first step: the
    # run's torchrun stays up until the test cancels it, however slow the machine.
    services.backend_update(backend=local_backend, config={**local_backend.config, "python": trainer_standin.python})
    trainer_standin.hold(steps=0)
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = _create(user, digits_dataset, cnn_model, local_backend, epochs=1)
    original = GpuBoxBackend.submit
    with mock.patch.object(GpuBoxBackend, "submit", autospec=True, side_effect=original) as submit:
        tasks.submit_job(job.pk)
        tasks.submit_job(job.pk)  # a duplicate delivery of the same message
    assert submit.call_count == 1
    job.refresh_from_db()
    assert job.state == S.PENDING
    assert job.provider_handle["job_name"] == job.provider_job_name
    run_dir = run_root / job.provider_job_name
    # One run directory (beside it .trainers/, the trainer snapshots jobs share).
    assert [p.name for p in run_root.iterdir() if not p.name.startswith(".")] == [job.provider_job_name]

    def argv(pid: int) -> list[bytes]:
        try:
            return open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            return []

    def supervisors():  # a submit starts the run's supervisor before it returns
        return [p for p in live_processes(str(run_dir)) if argv(p)[1:3] == [b"-m", b"cloud_adapters.gpubox.supervisor"]]

    def parent(pid: int) -> int | None:
        try:
            return int(open(f"/proc/{pid}/stat", "rb").read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return None

    def torchruns():  # torchrun itself (the stand-in's: its shebang's interpreter runs it), not the supervisor
        found = [p for p in live_processes(str(run_dir))
                 if argv(p)[1:4] == [trainer_standin.python.encode(), b"-m", b"torch.distributed.run"]]
        # A rank that torchrun has forked but not yet exec'd still shows torchrun's command line: not a second one.
        return [p for p in found if parent(p) not in found]

    try:
        assert len(supervisors()) == 1  # a second submit would have started its own by now
        wait_until(torchruns, timeout=30, what="torchrun to start")
        assert len(torchruns()) == 1 and len(supervisors()) == 1
        assert list(job.events.values_list("to_state", flat=True)) == ["QUEUED", "SUBMITTING", "PENDING"]
    finally:
        adapters.backend_adapter(local_backend).cancel(JobHandle.from_dict(job.provider_handle))
        wait_until(lambda: (run_dir / "exit.json").exists(), timeout=30, what="the run to stop")
        wait_until(lambda: not live_processes(str(run_dir)), timeout=30, what="processes to exit")


# --- datasets, models, backends ----------------------------------------------------------------
