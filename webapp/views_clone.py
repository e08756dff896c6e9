"""Clone with edits, continue and fine-tune in the browser (docs/clone-continue.md).

"New job like this", "Continue" and "Fine-tune" on the job page open the job form at
``/jobs/new/?from=<id>`` (``&mode=continue|finetune``) prefilled by
``services.training_job_clone_data``; the form posts back to the same URL and the job is created
with ``cloned_from`` (and, for a mode, ``source_job``/``init_mode``). A job the user cannot see is
a 404, as everywhere; a teammate's team job may be cloned (the new job is the teammate's).
"""

from __future__ import annotations

import json
from typing import Any

from django.http import Http404, HttpRequest

from jobs import selectors, services
from jobs.models import TrainingJob
from jobs.services.clones import clone_name

MODES = {"": "", "continue": "continue", "finetune": "finetune"}
MODE_LABELS = {"": "New job like", "continue": "Continue", "finetune": "Fine-tune"}


def clone_source(request: HttpRequest) -> tuple[TrainingJob | None, str]:
    """The job named by ``?from=`` (404 when the user cannot see it or the id is no number) and the
    mode named by ``?mode=`` ("" / continue / finetune; another value is a 404 saying which modes there are)."""
    raw = request.GET.get("from")
    if raw in (None, ""):
        return None, ""
    mode = request.GET.get("mode", "")
    if not raw.isascii() or not raw.isdigit() or len(raw) > 18:
        raise Http404("No such job.")
    if mode not in MODES:
        raise Http404(f"No such mode {mode[:40]!r}: open the form with mode=continue (resume the job's last "
                      f"checkpoint) or mode=finetune (start from its trained weights), or without mode for a new "
                      f"job like it.")
    job = (selectors.training_job_list_for_user(user=request.user)
           .select_related("dataset", "model_spec", "backend", "team").filter(pk=int(raw)).first())
    if job is None:
        raise Http404("No such job.")
    return job, MODES[mode]


def clone_initial(job: TrainingJob, mode: str) -> dict[str, Any]:
    """The job form's initial values for a job like ``job`` (``training_job_clone_data`` as form
    values: pks, env lines, hyperparameters as JSON text; more epochs for continue)."""
    data = services.training_job_clone_data(job)
    initial = {k: v for k, v in data.items() if v is not None}
    for field in ("dataset", "model_spec", "backend", "team"):
        initial[field] = data[field].pk if data[field] is not None else None
    initial["env"] = "\n".join(f"{k}={v}" for k, v in data["env"].items())
    initial["hyperparameters"] = json.dumps(data["hyperparameters"], indent=2, sort_keys=True) \
        if data["hyperparameters"] else ""
    initial["name"] = clone_name(job, mode)
    if mode == "continue":
        initial["epochs"] = max(data["epochs"], selectors.training_job_checkpoint_epoch(job=job)) + 1
    return initial


def clone_kwargs(job: TrainingJob | None, mode: str) -> dict[str, Any]:
    """The lineage arguments ``training_job_create`` takes for a form opened from ``job``."""
    if job is None:
        return {}
    return {"cloned_from": job, "source_job": job if mode else None, "init_mode": mode}


def clone_notice(job: TrainingJob | None, mode: str) -> dict[str, Any] | None:
    """What the form says above its fields: which job it was prefilled from and how it starts."""
    if job is None:
        return None
    epochs = selectors.training_job_checkpoint_epoch(job=job) if mode == "continue" else None
    return {"job": job, "mode": mode, "label": MODE_LABELS[mode], "checkpoint_epoch": epochs}


def job_actions(job: TrainingJob) -> dict[str, Any]:
    """Which of "Continue" and "Fine-tune" the job page offers: continue once a checkpoint was
    written (an epoch validated), fine-tune once there are weights (a checkpoint, or a succeeded
    job's model.pt); ``ended`` False (an active job): both are shown disabled, as the create refuses
    them until the job has ended. The create checks the files themselves."""
    epochs = selectors.training_job_checkpoint_epoch(job=job) if job.provider_handle else 0
    return {"can_continue": epochs > 0, "can_finetune": epochs > 0 or (job.state == "SUCCEEDED" and bool(job.provider_handle)),
            "checkpoint_epoch": epochs, "ended": job.is_terminal}
