"""Admission on a backend that shares its devices (a GPU box, ``Backend.allocates_devices``): which
QUEUED job starts next, with which GPUs (or, on a box without GPUs, which process slots), and why the
others wait. docs/gpu-boxes.md tells it for users.

A job needs one device per process (``procs_per_node``; a GPU box runs one node). The submit task,
on the box's own worker, asks :func:`training_job_admit` before it calls the adapter:

* The box's inventory (``Backend.inventory``: NVML's GPUs, the ``gpu_ids`` or ``slots`` host
  setting) is read first, outside any lock. A job that needs more devices than the box has in all is
  FAILED with the arithmetic (the job form refuses it already, when the web process sees the same box).
* Then, in one transaction holding the backend's row lock (``SELECT … FOR UPDATE`` on its
  ComputeBackend row, so admissions of one backend run one at a time, on any number of workers; on
  SQLite, the embedded default, every transaction is ``IMMEDIATE`` (webapp/settings.py) and takes the
  database's write lock at its start, which serializes them the same way):
  free devices = the inventory − the ``allocated_gpus`` of the backend's jobs that hold devices
  (:data:`HOLDING_STATES`: SUBMITTING, PENDING, RUNNING, STOPPING). The job starts when no waiting
  job comes before it (higher ``priority``, or the same priority and submitted earlier), the
  backend's ``max_concurrent_jobs`` allows one more, and enough devices are free: it is given the
  lowest free ones, its ``allocated_gpus`` written and its ``wait_reason`` cleared in the conditional
  QUEUED → SUBMITTING move (:func:`jobs.states.transition`), so a duplicate delivery moves nothing and
  two workers never give one device to two jobs. Otherwise it stays QUEUED with its ``wait_reason``,
  one of::

      waiting behind job #12 (priority 5)
      waiting: 3 jobs running, the limit of box-a is 3
      waiting for 4 GPUs on box-a (2 free)

  A job is *waiting* once it has a wait reason: a job whose submit message no worker has read yet
  holds back no one.
* Devices are free again once their job is terminal: the free set counts active jobs only, so
  there is nothing to release. What ends a job wakes the first waiting one (:func:`wake_waiting`):
  the sync that sees it end (:mod:`jobs.sync`), a submission that failed, a cancel of a waiting job,
  and each admission wakes the next in line, so a queue drains one start at a time. The recovery
  sweep wakes each backend's first waiting job too (:mod:`jobs.recovery`), should a wake-up be lost.

A leaf module: it imports no service.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Sequence

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from cloud_adapters.base import Backend, Inventory
from jobs import dispatch
from jobs.adapters import backend_allocates_devices, backend_queue
from jobs.models import HOLDING_STATES, QUEUE_ORDER, ComputeBackend, JobStateChoices as S, TrainingJob
from jobs.states import note, transition

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What :func:`decide` says about one QUEUED job."""

    devices: tuple[int, ...] = ()  # the devices it is given when it starts; () while it waits
    wait_reason: str = ""  # why it waits ("" when it starts)

    @property
    def admitted(self) -> bool:
        return not self.wait_reason


def needed_devices(job: TrainingJob) -> int:
    """Devices ``job`` needs: one per process on each of its nodes (a GPU box runs one node)."""
    return int(job.procs_per_node) * max(int(job.nodes), 1)


def free_devices(inventory: Inventory, held: Iterable[Sequence[int] | None]) -> tuple[int, ...]:
    """The inventory's devices that none of ``held`` (the ``allocated_gpus`` of the jobs holding
    devices) names, ascending."""
    taken = {int(d) for devices in held for d in (devices or ()) if isinstance(d, int) and not isinstance(d, bool)}
    return tuple(d for d in inventory.devices if d not in taken)


def never_fits(inventory: Inventory, need: int, backend_name: str) -> str | None:
    """The refusal for a job that needs more devices than the box has in all, or None."""
    if need <= inventory.capacity:
        return None
    return (f"The job needs {inventory.unit(need)} (one per process) but {backend_name} has "
            f"{inventory.unit(inventory.capacity)} in all ({inventory.source}), so it could never start; "
            f"re-run it with {inventory.capacity} or fewer processes per node.")


def decide(*, need: int, inventory: Inventory, backend_name: str, holding: Sequence[Sequence[int] | None],
           ahead: TrainingJob | None) -> Decision:
    """Whether a job needing ``need`` devices starts now (the rules of the module docstring).

    ``holding``: the ``allocated_gpus`` of each job of the backend that holds devices (one entry per
    job, so its length is the number of active jobs); ``ahead``: the first waiting job that comes
    before this one, or None. Pure: no database access."""
    if ahead is not None:
        return Decision(wait_reason=f"waiting behind job #{ahead.pk} (priority {ahead.priority})")
    limit = inventory.max_concurrent_jobs
    if limit is not None and len(holding) >= limit:
        running = len(holding)
        return Decision(wait_reason=f"waiting: {running} job{'s' if running != 1 else ''} running, "
                                    f"the limit of {backend_name} is {limit}")
    free = free_devices(inventory, holding)
    if len(free) < need:
        return Decision(wait_reason=f"waiting for {inventory.unit(need)} on {backend_name} ({len(free)} free)")
    return Decision(devices=free[:need])


def _ahead_of(job: TrainingJob) -> TrainingJob | None:
    """The first waiting QUEUED job of ``job``'s backend that starts before it (:data:`QUEUE_ORDER`)."""
    before = (Q(priority__gt=job.priority)
              | Q(priority=job.priority, created_at__lt=job.created_at)
              | Q(priority=job.priority, created_at=job.created_at, id__lt=job.pk))
    return (TrainingJob.objects.filter(before, backend_id=job.backend_id, state=S.QUEUED)
            .exclude(wait_reason="").exclude(pk=job.pk).order_by(*QUEUE_ORDER).only("id", "priority").first())


def training_job_admit(*, job: TrainingJob, adapter: Backend) -> bool:
    """Start QUEUED ``job`` on its device-sharing backend if it may start now (module docstring):
    True when this call moved it QUEUED → SUBMITTING with its ``allocated_gpus`` (the caller then
    submits it); False when it waits (its ``wait_reason`` written, a JobEvent when the reason
    changed) or another delivery moved it first. ``adapter``: the backend's, built on the box's
    worker (its inventory is read here). The caller refuses a job that can never fit first
    (:func:`never_fits`)."""
    inventory = adapter.inventory()
    backend = job.backend
    need = needed_devices(job)
    with transaction.atomic():
        ComputeBackend.objects.select_for_update().filter(pk=backend.pk).first()  # one admission at a time
        job.refresh_from_db()
        if job.state != S.QUEUED:
            return False  # a duplicate delivery, or cancelled meanwhile
        holding = list(TrainingJob.objects.filter(backend_id=backend.pk, state__in=HOLDING_STATES)
                       .values_list("allocated_gpus", flat=True))
        decision = decide(need=need, inventory=inventory, backend_name=backend.name, holding=holding,
                          ahead=_ahead_of(job))
        if not decision.admitted:
            _wait(job, decision.wait_reason)
            return False
        given = inventory.unit(need) + " " + ",".join(map(str, decision.devices))
        moved = transition(job, S.SUBMITTING, submitted_at=timezone.now(), allocated_gpus=list(decision.devices),
                           wait_reason="", message=f"Submitting to backend {backend.name} with {given}")
        if moved:
            wake_waiting(backend, after=job)  # the next in line may fit in what is left
        return moved


def _wait(job: TrainingJob, reason: str) -> None:
    """Leave ``job`` QUEUED with ``reason`` (no stall flag: it waits for a reason); a JobEvent
    records each new reason."""
    if job.wait_reason == reason:
        return
    if TrainingJob.objects.filter(pk=job.pk, state=S.QUEUED).update(
            wait_reason=reason[:500], stalled_at=None, stalled_reason="", updated_at=timezone.now()):
        note(job.pk, S.QUEUED, f"Waiting: {reason}")
        job.wait_reason = reason[:500]


def first_waiting(backend: ComputeBackend, *, exclude: TrainingJob | None = None) -> TrainingJob | None:
    """The backend's waiting QUEUED job that starts next (:data:`QUEUE_ORDER`), or None."""
    waiting = TrainingJob.objects.filter(backend_id=backend.pk, state=S.QUEUED).exclude(wait_reason="")
    if exclude is not None:
        waiting = waiting.exclude(pk=exclude.pk)
    return waiting.order_by(*QUEUE_ORDER).only("id").first()


def wake_waiting(backend: ComputeBackend, *, after: TrainingJob | None = None) -> int | None:
    """Send ``submit_job`` for the backend's first waiting job (to the backend's queue, once the
    current transaction commits) so that it starts if it fits now; ``after``: a job just admitted,
    left out. Returns the job's id, None when none waits or the backend shares no devices."""
    if not backend_allocates_devices(backend):
        return None
    head = first_waiting(backend, exclude=after)
    if head is None:
        return None
    dispatch.submit_after_commit(head.pk, backend_queue(backend))
    return head.pk
