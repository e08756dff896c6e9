"""Monthly budgets (jobs.budgets, checked by services.training_job_create and training_job_rerun):
exactly at the limit passes, a cent over is refused with the figures and writes nothing; ended jobs
count their cost, active ones their estimate, last month's jobs nothing; a team's budget applies to
every member; two submissions at the edge at the same time make exactly one job (PostgreSQL, threads)."""

from __future__ import annotations

import datetime as dt
import threading
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.db import connection

from jobs import budgets, services
from jobs.models import JobStateChoices as S, TrainingJob, UserBudget


def _message(exc: pytest.ExceptionInfo) -> str:
    return " ".join(exc.value.message_dict["__all__"])


@pytest.mark.django_db
def test_exactly_at_the_limit_passes_a_cent_over_is_refused(user, submit):
    UserBudget.objects.create(user=user, monthly_budget_usd=Decimal("2.00"))
    first = submit(user, 1000)  # $1.00 estimate
    assert first.estimated_cost_usd == Decimal("1.0000")
    second = submit(user, 1000)  # $1.00 + $1.00 = $2.00: exactly the limit
    assert budgets.user_month_to_date_usd(user) == Decimal("2.00")

    with pytest.raises(ValidationError) as exc:
        submit(user, 10)  # $0.01 more

    assert _message(exc) == ("Monthly budget of $2.00 for alice would be exceeded: $2.00 spent or committed "
                             "this month + $0.01 estimate for this job.")
    assert list(TrainingJob.objects.values_list("pk", flat=True).order_by("pk")) == [first.pk, second.pk]


@pytest.mark.django_db
def test_ended_jobs_count_their_cost_active_ones_their_estimate_last_month_nothing(user, submit):
    UserBudget.objects.create(user=user, monthly_budget_usd=Decimal("100.00"))
    done, running, old = submit(user, 5000), submit(user, 3000), submit(user, 9000)
    TrainingJob.objects.filter(pk=done.pk).update(state=S.SUCCEEDED, cost_usd=Decimal("0.4200"))
    TrainingJob.objects.filter(pk=running.pk).update(state=S.RUNNING, cost_usd=Decimal("1.2500"))
    last_month = budgets.month_start() - dt.timedelta(days=3)
    TrainingJob.objects.filter(pk=old.pk).update(created_at=last_month, cost_usd=Decimal("9.0000"))

    # $0.42 (ended: its cost) + max($1.25, $3.00) (running: its estimate) + $0 (created last month)
    assert budgets.user_month_to_date_usd(user) == Decimal("3.42")
    TrainingJob.objects.filter(pk=running.pk).update(cost_usd=Decimal("3.5000"))  # past its estimate
    assert budgets.user_month_to_date_usd(user) == Decimal("3.92")
    assert budgets.month_start(dt.datetime(2026, 3, 31, 23, 59, tzinfo=dt.timezone(dt.timedelta(hours=-5)))) == \
        dt.datetime(2026, 4, 1, tzinfo=dt.timezone.utc)  # 23:59 at UTC−5 is already April in UTC


@pytest.mark.django_db
def test_team_budget_applies_to_every_member(user, other_user, team, submit):
    alices = submit(user, 1000, team=team)  # $1.00 of the team's $1.50
    assert alices.team == team

    with pytest.raises(ValidationError) as exc:
        submit(other_user, 1000, team=team.pk)  # bob, a member: $1.00 + $1.00 > $1.50

    assert _message(exc) == ("Monthly budget of $1.50 for team vision would be exceeded: $1.00 spent or "
                             "committed this month + $1.00 estimate for this job.")
    bobs = submit(other_user, 500, team=team)  # $1.00 + $0.50 = $1.50: at the limit
    assert (bobs.owner, bobs.team) == (other_user, team)
    assert budgets.team_month_to_date_usd(team) == Decimal("1.50")
    assert submit(other_user, 1000).team is None  # without the team: bob has no budget of his own

    with pytest.raises(ValidationError) as exc:
        submit(user, 10, team="not-a-number")
    assert exc.value.message_dict["team"] == [
        "Choose one of your teams; this one does not exist or you are not a member."]
    team.members.remove(user)
    with pytest.raises(ValidationError) as exc:
        submit(user, 10, team=team)
    assert "team" in exc.value.message_dict
    assert TrainingJob.objects.filter(owner=user).count() == 1


@pytest.mark.django_db
def test_rerun_is_checked_too(user, submit):
    UserBudget.objects.create(user=user, monthly_budget_usd=Decimal("1.50"))
    job = submit(user, 1000)
    with pytest.raises(ValidationError) as exc:
        services.training_job_rerun(job=job, owner=user)
    assert _message(exc) == ("Monthly budget of $1.50 for alice would be exceeded: $1.00 spent or committed "
                             "this month + $1.00 estimate for this job.")
    assert TrainingJob.objects.count() == 1
    TrainingJob.objects.filter(pk=job.pk).update(state=S.FAILED, cost_usd=Decimal("0.50"))
    rerun = services.training_job_rerun(job=job, owner=user)  # $0.50 + $1.00 = $1.50
    assert rerun.rerun_of == job


@pytest.mark.django_db(transaction=True)
def test_two_submissions_at_the_edge_at_once_make_exactly_one_job(user, submit):
    UserBudget.objects.create(user=user, monthly_budget_usd=Decimal("2.00"))
    submit(user, 1000)  # $1.00 committed; room for exactly one more $1.00 job
    barrier = threading.Barrier(2)
    created, refused, other = [], [], []

    def run():
        try:
            barrier.wait(timeout=10)
            created.append(submit(user, 1000))
        except ValidationError as exc:
            refused.append(" ".join(exc.message_dict["__all__"]))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            other.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)

    assert other == []
    assert len(created) == 1
    assert refused == ["Monthly budget of $2.00 for alice would be exceeded: $2.00 spent or committed this "
                       "month + $1.00 estimate for this job."]
    assert TrainingJob.objects.count() == 2
