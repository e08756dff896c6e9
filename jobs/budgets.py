"""Monthly budgets: what a user or a team has spent or committed this calendar month, and the check
that refuses a submission past the limit.

The rule (USD, calendar month in UTC): month-to-date spend of a set of jobs = the sum, over the jobs
**created** since the first instant of this month (UTC), of

* ``cost_usd`` for a job that has ended (SUCCEEDED, FAILED, CANCELLED): what it cost;
* ``max(cost_usd, estimated_cost_usd)`` for a job still active (QUEUED … STOPPING): what it may still
  bill up to. The estimate, stored at submission (:func:`jobs.cost.estimate_cost_usd`), is the
  committed amount of a job not yet costed; a job whose cost so far passed its estimate counts its
  cost. Both figures are the job's stored columns: this module prices nothing itself.

A user's spend covers every job they own (any team); a team's spend covers every job whose ``team`` is
that team, whoever owns it. A job created last month that still runs counts toward last month.

:func:`check_monthly_budgets` is called by ``jobs.services`` inside the transaction that creates the
job, after locking the :class:`~jobs.models.UserBudget` row and the :class:`~jobs.models.Team` row
(``SELECT … FOR UPDATE``, in that order): a second submission of the same user or team waits for the
first to commit, then counts the first job, so two submissions at the edge cannot both pass.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

from django.core.exceptions import ValidationError
from django.db.models import Case, DecimalField, F, QuerySet, Sum, When
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from jobs.cost import format_usd, usd_places
from jobs.models import ACTIVE_STATE_VALUES, Team, TrainingJob, UserBudget

ZERO = Decimal("0")


def month_start(now: dt.datetime | None = None) -> dt.datetime:
    """The first instant of ``now``'s calendar month in UTC (aware). ``now`` defaults to the clock."""
    now = (now or timezone.now()).astimezone(dt.timezone.utc)
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def _spend(jobs: QuerySet[TrainingJob], now: dt.datetime | None) -> Decimal:
    amount = DecimalField(max_digits=14, decimal_places=4)
    total = jobs.filter(created_at__gte=month_start(now)).aggregate(
        total=Coalesce(Sum(Case(
            When(state__in=ACTIVE_STATE_VALUES, then=Greatest(F("cost_usd"), F("estimated_cost_usd"))),
            default=F("cost_usd"), output_field=amount)), ZERO, output_field=amount))["total"]
    return Decimal(total)


def user_month_to_date_usd(user, now: dt.datetime | None = None) -> Decimal:
    """USD ``user`` spent or committed this calendar month (UTC), by the module's rule. One query."""
    return _spend(TrainingJob.objects.filter(owner_id=user.pk), now)


def team_month_to_date_usd(team: Team, now: dt.datetime | None = None) -> Decimal:
    """USD the jobs of ``team`` spent or committed this calendar month (UTC). One query."""
    return _spend(TrainingJob.objects.filter(team_id=team.pk), now)


def _refuse(limit: Decimal, whom: str, spent: Decimal, estimate: Decimal) -> None:
    places = usd_places(limit, spent, estimate)
    raise ValidationError({"__all__": [
        f"Monthly budget of {format_usd(limit, places)} for {whom} would be exceeded: "
        f"{format_usd(spent, places)} spent or committed this month + {format_usd(estimate, places)} "
        f"estimate for this job."]})


def check_monthly_budgets(*, owner, team: Team | None, estimate: Decimal) -> None:
    """Refuse a new job of ``owner`` (optionally for ``team``) whose ``estimate`` (USD) would take the
    owner's or the team's month-to-date spend past its monthly budget; exactly at the limit passes.

    Must run inside ``transaction.atomic()``: it locks the owner's UserBudget row and the team's row
    (when they exist / have a budget) until the caller's transaction ends, so concurrent submissions
    are counted one after the other. Raises ValidationError (``__all__``) with the figures, e.g.
    "Monthly budget of $100.00 for alice would be exceeded: $92.50 spent or committed this month +
    $12.00 estimate for this job."
    """
    estimate = Decimal(estimate)
    budget = UserBudget.objects.select_for_update().filter(user_id=owner.pk).first()
    if budget is not None:
        spent = user_month_to_date_usd(owner)
        if spent + estimate > budget.monthly_budget_usd:
            _refuse(budget.monthly_budget_usd, owner.get_username(), spent, estimate)
    if team is not None:
        locked = Team.objects.select_for_update().get(pk=team.pk)
        if locked.monthly_budget_usd is not None:
            spent = team_month_to_date_usd(locked)
            if spent + estimate > locked.monthly_budget_usd:
                _refuse(locked.monthly_budget_usd, f"team {locked.name}", spent, estimate)
