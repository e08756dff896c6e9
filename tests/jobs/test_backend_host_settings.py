"""A GPU box's host settings: ``run_root``, ``python``, ``max_procs_per_node``, ``pip_args``, ``run_as``
and ``env_passthrough`` decide what runs on the worker's machine, where, how many processes at once and
as whom. They come from the installation (``TRAINBOARD_RUN_ROOT``, ``TRAINBOARD_GPUBOX_PYTHON``,
``TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE``, ``TRAINBOARD_GPUBOX_PIP_ARGS``, ``TRAINBOARD_GPUBOX_RUN_AS``,
``TRAINBOARD_GPUBOX_ENV_PASSTHROUGH``) or a staff user's backend, never from another user's row
(jobs.adapters.backend_adapter / _validate_backend; migration 0010 strips them from rows saved before the rule)."""

from __future__ import annotations

import importlib
import sys

import pytest
from django.apps import apps
from django.core.exceptions import ValidationError

from cloud_adapters.base import JobHandle
from jobs import adapters, dispatch, services, tasks
from jobs.models import ComputeBackend, JobStateChoices as S, TrainingJob
from taskkit import sent_tasks

pytestmark = pytest.mark.django_db

HOSTILE = {"run_root": "/tmp/anywhere-i-like", "python": "/bin/echo", "max_procs_per_node": 2**70,
           "run_as": "root", "pip_args": "--index-url http://127.0.0.1:9/simple", "env_passthrough": "DATABASE_URL",
           "job_uids": "none", "job_memory_limit": "none",
           "allowed_images": "*", "gpu_ids": "0,1,2,3,4,5,6,7", "slots": 1024, "max_concurrent_jobs": 10_000}


@pytest.fixture
def mallory(django_user_model):
    return django_user_model.objects.create_user(username="mallory", password="pw-mallory-Secret-1")


@pytest.fixture
def box_settings(settings, run_root):
    """This installation's box: run root ``run_root``, 2 processes per node, the worker's interpreter."""
    settings.TRAINBOARD_RUN_ROOT = run_root
    settings.TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE = 2
    settings.TRAINBOARD_GPUBOX_PYTHON = ""
    return settings


def _legacy_row(owner, config) -> ComputeBackend:
    """A row saved before the rule, written past the service as an old database holds it."""
    backend = services.backend_create(owner=owner, name="old", kind="gpubox", config={})
    ComputeBackend.objects.filter(pk=backend.pk).update(config=config)
    backend.refresh_from_db()
    return backend


def test_a_non_staff_user_cannot_set_any_host_setting_and_hears_about_each(mallory, box_settings):
    with pytest.raises(ValidationError) as excinfo:
        services.backend_create(owner=mallory, name="evil", kind="gpubox",
                                config={**HOSTILE, "hourly_rate_usd": -1})
    errors = excinfo.value.message_dict
    # One message per host setting, on that setting, worded with its label and where the operator
    # sets it, plus the other settings' problems.
    assert {key: [m.split(":", 1)[0] for m in messages] for key, messages in errors.items()} == {
        "config.max_procs_per_node": ["Max processes per node"], "config.python": ["Python interpreter"],
        "config.run_root": ["Run root"], "config.hourly_rate_usd": ["Hourly rate (USD)"],
        "config.run_as": ["Run jobs as"], "config.pip_args": ["pip options"],
        "config.job_uids": ["Job uids"], "config.job_memory_limit": ["Job memory limit"],
        "config.env_passthrough": ["Passed-through variables"], "config.allowed_images": ["Allowed images"],
        "config.gpu_ids": ["GPUs to hand out"], "config.slots": ["Process slots"],
        "config.max_concurrent_jobs": ["Max concurrent jobs"]}
    assert "only a backend owned by staff may set this" in errors["config.run_root"][0]
    assert "(TRAINBOARD_RUN_ROOT)" in errors["config.run_root"][0]
    assert "(TRAINBOARD_GPUBOX_PYTHON)" in errors["config.python"][0]
    assert "(TRAINBOARD_GPUBOX_RUN_AS)" in errors["config.run_as"][0]
    assert not ComputeBackend.objects.filter(name="evil").exists()

    backend = services.backend_create(owner=mallory, name="mine", kind="gpubox",
                                      config={"hourly_rate_usd": 1.5, "grace_period_s": 5})
    with pytest.raises(ValidationError) as excinfo:
        services.backend_update(backend=backend, config={"hourly_rate_usd": 1.5, "python": "/bin/echo"})
    assert excinfo.value.message_dict["config.python"][0].startswith("Python interpreter: only a backend owned by staff")
    backend.refresh_from_db()
    assert backend.config == {"hourly_rate_usd": 1.5, "grace_period_s": 5.0}


def test_staff_may_set_host_settings_on_their_own_backend_only(user, mallory, box_settings, tmp_path):
    mine = services.backend_create(owner=user, name="big", kind="gpubox",
                                   config={"run_root": str(tmp_path / "staff-runs"), "max_procs_per_node": 8,
                                           "python": sys.executable})
    adapter = adapters.backend_adapter(mine)
    assert adapter.config["run_root"] == str(tmp_path / "staff-runs")
    assert adapter.capabilities.max_procs_per_node == 8
    # A staff user editing someone else's backend: the rule is the row's owner, not the editor.
    theirs = services.backend_create(owner=mallory, name="theirs", kind="gpubox", config={})
    with pytest.raises(ValidationError) as excinfo:
        services.backend_update(backend=theirs, config={"max_procs_per_node": 8})
    assert excinfo.value.message_dict["config.max_procs_per_node"][0].startswith(
        "Max processes per node: only a backend owned by staff")


@pytest.mark.parametrize("config,message", [
    ({"max_procs_per_node": 2**70},
     "Max processes per node: must be 1 to 1024, got 1180591620717411303424."),
    ({"max_procs_per_node": 1025}, "Max processes per node: must be 1 to 1024, got 1025."),
    ({"grace_period_s": 601}, "Cancel grace period (s): must be 0 to 600 seconds, got 601."),
    ({"grace_period_s": 10**400}, "Cancel grace period (s): expected a finite number, got 10000000… (401 characters)."),
    ({"hourly_rate_usd": 100_001}, "Hourly rate (USD): must be 0 to 100,000 USD per node-hour, got 100001."),
])
def test_every_numeric_gpubox_setting_is_bounded_even_for_staff(user, box_settings, config, message):
    with pytest.raises(ValidationError) as excinfo:
        services.backend_create(owner=user, name="b", kind="gpubox", config=config)
    (key,) = config
    assert excinfo.value.message_dict == {f"config.{key}": [message]}


def test_a_stored_row_of_a_non_staff_owner_cannot_reach_the_host(mallory, user, box_settings, run_root):
    backend = _legacy_row(mallory, {**HOSTILE, "hourly_rate_usd": 2.0})
    config = adapters.backend_adapter(backend).config
    assert config == {"run_root": str(run_root), "python": sys.executable, "max_procs_per_node": 2,
                      "hourly_rate_usd": 2.0, "grace_period_s": 10.0, "pip_args": "", "run_as": "",
                      "job_uids": "", "job_memory_limit": "",
                      "env_passthrough": "", "allowed_images": "", "gpu_model": "", "gpu_memory_gib": 0.0,
                      "gpu_ids": "", "slots": None, "max_concurrent_jobs": None}
    # The same row owned by staff is staff's decision; once the owner is no longer staff it is not.
    ComputeBackend.objects.filter(pk=backend.pk).update(owner=user, config={"python": "/bin/echo",
                                                                            "max_procs_per_node": 4})
    backend.refresh_from_db()
    config = adapters.backend_adapter(backend).config
    assert (config["python"], config["max_procs_per_node"]) == ("/bin/echo", 4)
    type(user).objects.filter(pk=user.pk).update(is_staff=False)
    backend = ComputeBackend.objects.get(pk=backend.pk)
    assert adapters.backend_adapter(backend).config["python"] == sys.executable


def test_a_job_past_the_hosts_process_limit_is_refused_at_launch_with_the_arithmetic(
        mallory, box_settings):
    backend = _legacy_row(mallory, {"max_procs_per_node": 2**70})
    dataset = services.dataset_create(owner=mallory, name="d", format="builtin", builtin_name="digits")
    model = services.model_spec_create(owner=mallory, name="m", architecture="cnn", params={})
    with pytest.raises(ValidationError) as excinfo:
        services.training_job_create(owner=mallory, dataset=dataset, model_spec=model, backend=backend,
                                     nodes=1, procs_per_node=1000, epochs=1)
    assert excinfo.value.message_dict["procs_per_node"] == [
        "1 node × 1000 processes = 1000 ranks, but this GPU box runs at most 2 processes per node "
        "(max_procs_per_node); ask for 2 or fewer."]
    assert not TrainingJob.objects.exists()


def test_a_non_staff_job_runs_the_hosts_interpreter_in_the_hosts_run_root(
        mallory, box_settings, run_root, tmp_path, wait_until, live_processes, trainer_standin):
    # The host's interpreter is the trainer stand-in, held before its first step: its torchrun stays
    # up to be looked at (until the cancel), however slow the machine. (An empty TRAINBOARD_GPUBOX_PYTHON, the worker's own
    # interpreter, runs every real gpubox job of tests/e2e/.)
    box_settings.TRAINBOARD_GPUBOX_PYTHON = trainer_standin.python
    trainer_standin.hold(steps=0)
    elsewhere = tmp_path / "outside"
    backend = _legacy_row(mallory, {"run_root": str(elsewhere), "python": "/bin/echo", "hourly_rate_usd": 0})
    dataset = services.dataset_create(owner=mallory, name="d", format="builtin", builtin_name="digits")
    model = services.model_spec_create(owner=mallory, name="m", architecture="cnn", params={})
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = services.training_job_create(owner=mallory, dataset=dataset, model_spec=model, backend=backend,
                                           nodes=1, procs_per_node=1, epochs=1)
    tasks.submit_job(job.pk)
    job.refresh_from_db()
    assert job.state == S.PENDING, job.failure_reason
    run_dir = run_root / job.provider_job_name
    try:
        assert not elsewhere.exists()
        assert job.provider_handle["provider_job_id"] == str(run_dir)
        wait_until(lambda: (run_dir / "torchrun.json").exists(), timeout=30, what="torchrun to start")
        import json

        pid = json.loads((run_dir / "torchrun.json").read_text())["pid"]
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        # The stand-in is a script: the kernel runs its shebang's interpreter with the script's path first.
        assert argv[:4] == [sys.executable.encode(), trainer_standin.python.encode(), b"-m", b"torch.distributed.run"]
    finally:
        adapters.backend_adapter(backend).cancel(JobHandle.from_dict(job.provider_handle))
        wait_until(lambda: (run_dir / "exit.json").exists(), timeout=60, what="the run to stop")
        wait_until(lambda: not live_processes(str(run_dir)), timeout=30, what="processes to exit")


def test_migration_0010_strips_host_settings_from_non_staff_rows_only(mallory, user, box_settings):
    migration = importlib.import_module("jobs.migrations.0010_strip_user_host_settings")
    # The host settings the migration knew; a later one on such a row is ignored by backend_adapter.
    known = {k: HOSTILE[k] for k in ("run_root", "python", "max_procs_per_node")}
    theirs = _legacy_row(mallory, {**known, "hourly_rate_usd": 2.0})
    ours = services.backend_create(owner=user, name="staff-box", kind="gpubox",
                                   config={"max_procs_per_node": 4, "hourly_rate_usd": 1.0})
    untouched = services.backend_create(owner=mallory, name="plain", kind="gpubox", config={"grace_period_s": 3})
    cloud = ComputeBackend.objects.create(owner=mallory, name="sm", kind="sagemaker", config={
        "region": "eu-west-1", "endpoint_url": "http://127.0.0.1:9/", "profile": "operator"})
    migration.forwards(apps, None)
    for row in (theirs, ours, untouched, cloud):
        row.refresh_from_db()
    assert theirs.config == {"hourly_rate_usd": 2.0}
    assert cloud.config == {"region": "eu-west-1"}
    assert ours.config == {"max_procs_per_node": 4, "hourly_rate_usd": 1.0}
    assert untouched.config == {"grace_period_s": 3.0}
