"""Fixtures for the budget tests: alice's gpubox backend at $3.60 per node-hour (so a job's estimate is
max_runtime_s / 1000 dollars), a team with alice and bob sharing alice's backend, dataset and model,
and a ``submit`` helper around services.training_job_create whose submit messages are recorded
instead of sent (no broker is needed to test the refusal)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from jobs import dispatch, services
from jobs.models import Team


@pytest.fixture
def sent(monkeypatch):
    """Job ids whose submit message would have been sent (after commit)."""
    ids: list[int] = []
    monkeypatch.setattr(dispatch, "send_submit", lambda job_id, queue: ids.append(job_id))
    return ids


@pytest.fixture
def team(user, other_user, local_backend, digits_dataset, cnn_model):
    team = Team.objects.create(name="vision", monthly_budget_usd=Decimal("1.50"))
    team.members.add(user, other_user)
    for obj in (local_backend, digits_dataset, cnn_model):
        obj.team = team
        obj.save(update_fields=["team"])
    return team


@pytest.fixture
def submit(digits_dataset, cnn_model, local_backend, sent):
    """``submit(owner, runtime_s, **kw)``: a 1-node job on the local backend; estimate = runtime_s × $0.001."""

    def _submit(owner, runtime_s: int, **kw):
        return services.training_job_create(owner=owner, dataset=digits_dataset, model_spec=cnn_model,
                                            backend=local_backend, max_runtime_s=runtime_s, **kw)

    return _submit
