"""A running job whose cost reaches its budget is stopped within one sync and marked so: a real gpubox
job (supervisor + torchrun; the trainer stand-in held at its first step, so it runs until stopped,
however slow the machine) at $3,600 per node-hour ($1 a second) with a $1.00 budget, synced by
sync.backend_sync until the sync that prices it at $1.00 or more moves it to STOPPING with
budget_exceeded_at and "Stopped: budget of $1.0000 reached at $1.0238" (both at the precision of the
job's cost, kept to 4 decimals); the provider then reports it
CANCELLED and the job page shows the mark."""

from __future__ import annotations

import re
import time
from decimal import Decimal

import pytest
from django.urls import reverse

from cloud_adapters.base import JobHandle, JobState
from jobs import adapters, dispatch, lifecycle, services, sync
from jobs.cost import format_usd, usd_places
from jobs.models import JobStateChoices as S, TrainingJob


@pytest.fixture
def pricey_backend(user, run_root, settings, trainer_standin):
    """The box, its jobs run by the trainer stand-in held at their first step (RUNNING until stopped)."""
    settings.TRAINBOARD_RUN_ROOT = run_root
    settings.TRAINBOARD_GPUBOX_PYTHON = trainer_standin.python
    trainer_standin.hold(steps=1)
    return services.backend_create(owner=user, name="pricey", kind="gpubox", config={
        "hourly_rate_usd": 3600, "grace_period_s": 3.0})


@pytest.mark.django_db
def test_job_over_budget_is_stopped_in_the_sync_that_prices_it_and_marked(
        client, user, digits_dataset, cnn_model, pricey_backend, monkeypatch):
    monkeypatch.setattr(dispatch, "send_submit", lambda job_id, queue: None)
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                       backend=pricey_backend, epochs=1, max_runtime_s=600, budget_usd="1.00")
    lifecycle.training_job_submit(job=job)
    job.refresh_from_db()
    assert job.state == S.PENDING
    adapter = adapters.backend_adapter(pricey_backend)
    handle = JobHandle.from_dict(job.provider_handle)
    try:
        deadline = time.monotonic() + 60
        while True:
            before = TrainingJob.objects.get(pk=job.pk)
            sync.backend_sync(backend_id=pricey_backend.pk)
            job.refresh_from_db()
            if job.cost_usd >= Decimal("1.00"):
                break
            assert job.state in (S.PENDING, S.RUNNING) and job.budget_exceeded_at is None
            assert time.monotonic() < deadline, job.cost_usd
            time.sleep(0.3)

        # The very sync that priced it at $1.00 or more stopped it.
        assert before.state in (S.PENDING, S.RUNNING) and before.cost_usd < Decimal("1.00")
        assert job.state == S.STOPPING
        assert job.budget_exceeded_at is not None and job.cancel_requested_at == job.budget_exceeded_at
        places = usd_places(Decimal("1.00"), job.cost_usd)  # both at the precision of the job's cost
        assert job.failure_reason == (f"Stopped: budget of {format_usd(Decimal('1.00'), places)} reached at "
                                      f"{format_usd(job.cost_usd, places)}")
        assert re.fullmatch(r"Stopped: budget of \$1\.00(0{0,2}) reached at \$\d+\.\d\d\d{0,2}", job.failure_reason)
        assert job.events.last().message == job.failure_reason
        assert (adapters.backend_adapter(pricey_backend).run_root / job.provider_job_name / "cancel_requested").exists()

        deadline = time.monotonic() + 60
        while job.state != S.CANCELLED:
            assert time.monotonic() < deadline, job.state
            time.sleep(0.3)
            sync.backend_sync(backend_id=pricey_backend.pk)
            job.refresh_from_db()
        assert adapter.describe(handle).state == JobState.CANCELLED
        assert job.failure_reason.startswith(f"Stopped: budget of {format_usd(Decimal('1.00'), places)} reached at $")

        client.force_login(user)
        page = client.get(reverse("job-detail", args=[job.pk])).content.decode()
        assert 'id="budget-exceeded"' in page
        assert job.failure_reason in page
        listing = client.get(reverse("job-list")).content.decode()
        job.refresh_from_db()
        assert (f'<div class="small muted budget-stop">Stopped: budget of '
                f'{format_usd(Decimal("1.00"), job.money_places)} reached</div>') in listing
    finally:
        adapter.cancel(handle)
