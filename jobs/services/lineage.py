"""Continue and fine-tune: where a new job's starting point comes from, and whether the trainer can
start from it (docs/clone-continue.md).

A job created with ``init_mode`` continue starts from its source job's last checkpoint
(``checkpoints/last.pt``: model, optimizer, lr schedule, epoch, step, RNG) and trains on to its own
``epochs``; with ``finetune`` from the source's trained weights (``model.pt``, or the model of its
last checkpoint when it ended before saving one) in the same architecture, at epoch 0 with a new
optimizer. The trainer reads the file named by ``train.init_from`` (trainer_pkg/train.py
``load_init``) only while the job has no checkpoint of its own.

The file is found through the source backend's artifacts (``Backend.artifacts`` /
``Backend.artifact_uri``) and passed in place: a local path only to a job on the same backend row
(the same GPU box or cluster), an Azure ML datastore path (``azureml://datastores/...``) only to a job
on the same Azure ML backend row (its submit mounts the file as an input and hands the trainer the
mounted path), an ``s3://``/``gs://``/``az://`` URI to any backend that reads that scheme
(``Backend.dataset_schemes``). Anything else is refused with the backend to choose; no copy is made
between backends.

A job of a user's script gets the same file as ``TRAINBOARD_INIT_FROM`` (``TRAINBOARD_INIT_MODE``
continue | finetune; trainer_pkg/launch.py): the source's ``checkpoints/last.pt`` or ``model.pt`` as
its script saved them in ``report.checkpoint_dir()`` / ``report.model_dir()``. Every backend that runs
a script does so through the launcher, so each can hand it over; a source whose script saved neither
is refused, saying what to save. What a script does with the file (and whether it keeps the source's
optimizer) is its own: only the model and code are checked for a continue.
"""

from __future__ import annotations

from typing import Any

from cloud_adapters import registry
from cloud_adapters.base import BackendError, JobHandle, uri_scheme, with_article
from jobs.adapters import backend_adapter
from jobs.models import ComputeBackend, TrainingJob
from jobs.selectors import training_job_checkpoint_epoch
from jobs.validation import ALL, Errors
from trainer_pkg.config import JobConfig
from trainer_pkg.objstore import is_remote

CHECKPOINT_ARTIFACT = "checkpoints/last.pt"
MODEL_ARTIFACT = "model.pt"
INIT_MODES = ("continue", "finetune")

# What a continued job takes from its checkpoint as it is: the optimizer's state holds its settings
# (torch's load_state_dict restores each parameter group's lr, momentum and weight decay), so a
# changed value would be silently overwritten by the source's. Refused instead, naming the field.
_CONTINUE_KEEPS = (("train.optimizer", "Optimizer"), ("train.lr", "Learning rate"),
                   ("train.momentum", "Momentum"), ("train.weight_decay", "Weight decay"),
                   ("train.lr_schedule", "Learning-rate schedule"), ("train.warmup_steps", "Warmup steps"))
_FIELD_OF = {"train.lr": "lr", "train.epochs": "epochs"}
_MODE_VERB = {"continue": "continue", "finetune": "fine-tune"}


def _get(config: dict[str, Any], dotted: str) -> Any:
    section, name = dotted.split(".")
    return (config.get(section) or {}).get(name)


def lineage_text(job: TrainingJob) -> str:
    """:attr:`TrainingJob.lineage_text`: ``continued from #12 (checkpoint epoch 3)``,
    ``fine-tuned from #12``, ``cloned from #12``, or ""."""
    return job.lineage_text


def _kind_label(backend: ComputeBackend) -> str:
    return registry.KINDS[backend.kind].label if backend.kind in registry.KINDS else backend.kind


def _is_script(config: dict[str, Any] | None) -> bool:
    """Whether a job of ``config`` ran (or runs) the user's script instead of our trainer."""
    return bool(((config or {}).get("code") or {}).get("script"))


def _artifact(errors: Errors, source: TrainingJob, mode: str) -> tuple[str, str]:
    """(artifact name, path or URI where it lies) of what ``mode`` starts from; ("", "") with an
    error when the source has none or its backend cannot say. A script's job has them only where its
    script saved them (``report.checkpoint_dir()``/last.pt, ``report.model_dir()``/model.pt): the
    error says so."""
    if not source.provider_handle:
        errors.add(ALL, f"Job #{source.pk} never ran on its backend: there is no checkpoint or model to start from.")
        return "", ""
    try:
        adapter = backend_adapter(source.backend)
        handle = JobHandle.from_dict(source.provider_handle)
        names = {a.name for a in adapter.artifacts(handle)}
    except (BackendError, LookupError, ValueError, TypeError) as exc:
        errors.add(ALL, f"The files of job #{source.pk} on backend {source.backend.name} cannot be listed: {exc}")
        return "", ""
    wanted = [CHECKPOINT_ARTIFACT] if mode == "continue" else [MODEL_ARTIFACT, CHECKPOINT_ARTIFACT]
    name = next((n for n in wanted if n in names), "")
    if not name:
        what = ("checkpoint (checkpoints/last.pt)" if mode == "continue"
                else "trained weights (model.pt) and no checkpoint")
        if _is_script(source.config):
            saves = ("its checkpoint as last.pt in TRAINBOARD_CHECKPOINT_DIR (report.checkpoint_dir())"
                     if mode == "continue" else "its weights as model.pt in TRAINBOARD_MODEL_DIR (report.model_dir()) "
                                                "or a checkpoint as last.pt in TRAINBOARD_CHECKPOINT_DIR")
            errors.add(ALL, f"Job #{source.pk} left no {what}: its script saved none (or its backend no longer "
                            f"keeps its files), so there is nothing to hand the new job's script in "
                            f"TRAINBOARD_INIT_FROM. A script that is to be {_MODE_VERB[mode]}d saves {saves}; "
                            f"start this job from scratch instead.")
            return "", ""
        errors.add(ALL, f"Job #{source.pk} left no {what}: it ended before its first epoch did, or its backend "
                        f"no longer keeps its files. Start it from scratch instead.")
        return "", ""
    try:
        return name, adapter.artifact_uri(handle, name)
    except (BackendError, ValueError) as exc:
        errors.add(ALL, f"Job #{source.pk}'s {name} on backend {source.backend.name} cannot be located: {exc}")
        return "", ""


def _readable_where(errors: Errors, source: TrainingJob, name: str, uri: str, backend: ComputeBackend,
                    adapter: Any) -> bool:
    """Whether a job on ``backend`` can read the source's file at ``uri`` in place (the same backend
    row: its path, or the datastore path an Azure ML job mounts; elsewhere a URI the trainer reads);
    else an error on ``backend`` naming the backend to choose."""
    if uri and backend.pk == source.backend_id:
        return True
    if uri and is_remote(uri) and uri_scheme(uri) in adapter.dataset_schemes:
        return True
    where = f"at {uri}" if uri else "where only that backend reads it"
    errors.add("backend", f"Job #{source.pk}'s {name} lies on backend {source.backend.name} "
                          f"({_kind_label(source.backend)}) {where}; {with_article(_kind_label(backend))} backend "
                          f"({backend.name}) cannot read it there, and Trainboard does not copy checkpoints "
                          f"between backends. Choose backend {source.backend.name}.")
    return False


def _check_continue(errors: Errors, source: TrainingJob, config: JobConfig, epochs_done: int | None) -> None:
    """The trainer's resume rules for a continued job (trainer_pkg/train.py ``maybe_resume``): the
    same model (architecture, parameters, user code), the optimizer as the checkpoint holds it, a
    full checkpoint, a world size the checkpoint loads on, and more epochs than it has done. A
    script's job keeps only the same model and code: what its checkpoint holds and how it resumes
    (optimizer, lr, shape) is its script's business (``epochs_done`` None: not known)."""
    src, new = source.config or {}, config.to_dict()
    if (src.get("model") or {}) != new["model"] or (src.get("code") or {}).get("sha256", "") != new["code"]["sha256"]:
        errors.add("model_spec", f"Continue keeps the model: job #{source.pk} trained "
                                 f"{_describe_model(src.get('model') or {})}, this job would train "
                                 f"{_describe_model(new['model'])}. Keep job #{source.pk}'s model, or choose "
                                 f"Fine-tune (weights only) or a new job.")
    if _wrote_sharded(source, new):
        errors.add(ALL, f"Job #{source.pk} wrote a sharded checkpoint (a directory every rank reads); continue "
                        f"starts from a full checkpoint (last.pt) only. Choose Fine-tune, or re-run job "
                        f"#{source.pk} with checkpoint format full.")
    if _is_script(new) or epochs_done is None:
        return
    for dotted, label in _CONTINUE_KEEPS:
        if _get(src, dotted) is not None and _get(src, dotted) != _get(new, dotted):
            errors.add(_FIELD_OF.get(dotted, "hyperparameters"),
                       f"{label}: continue resumes job #{source.pk}'s optimizer state, which holds "
                       f"{dotted} = {_get(src, dotted)!r}; this job asks for {_get(new, dotted)!r}. Keep "
                       f"{_get(src, dotted)!r}, or choose Fine-tune to start a new optimizer.")
    src_parallel, new_parallel = src.get("parallel") or {}, new["parallel"]
    if "pipeline" in (src_parallel.get("strategy"), new_parallel["strategy"]):
        keys = ("strategy", "nodes", "procs_per_node", "pipeline_stages")
        if any(src_parallel.get(k) != new_parallel[k] for k in keys):
            shown = ", ".join(f"{k} {src_parallel.get(k)}" for k in keys)
            errors.add("strategy", f"A pipeline checkpoint holds each stage's layers as job #{source.pk} split "
                                   f"them: continue it with the same shape ({shown}).")
    if config.train.max_steps == 0 and config.train.epochs <= epochs_done:
        errors.add("epochs", f"Epochs: job #{source.pk}'s checkpoint has {epochs_done} epoch"
                             f"{'' if epochs_done == 1 else 's'} done; set more than {epochs_done} to continue it.")


def _wrote_sharded(source: TrainingJob, new: dict[str, Any]) -> bool:
    """Whether continuing ``source`` as the built-in trainer's job ``new`` (a config dict) meets a sharded
    checkpoint, which has no ``last.pt`` to start from (a script's checkpoint is its script's own)."""
    return not _is_script(new) and _get(source.config or {}, "output.checkpoint_format") == "sharded"


def _describe_model(model: dict[str, Any]) -> str:
    arch = model.get("arch") or "?"
    if arch == "custom":
        arch = f"custom {model.get('entry_point') or ''}".strip()
    params = model.get("params") or {}
    shown = ", ".join(f"{k}={v}" for k, v in sorted(params.items()))
    return f"{arch} ({shown})" if shown else arch


def _check_finetune(errors: Errors, source: TrainingJob, config: JobConfig, dataset: Any) -> None:
    """Fine-tuning loads the source's whole state dict, head included: the same architecture and
    parameters, and (where both datasets' shapes were read) the same sample shape and classes."""
    src, new = source.config or {}, config.to_dict()
    src_model = src.get("model") or {}
    if (src_model.get("arch"), src_model.get("params"), src_model.get("entry_point")) != (
            new["model"]["arch"], new["model"]["params"], new["model"]["entry_point"]):
        errors.add("model_spec", f"Fine-tune loads job #{source.pk}'s weights into the same architecture: it trained "
                                 f"{_describe_model(src_model)}, this job would train "
                                 f"{_describe_model(new['model'])}. Keep job #{source.pk}'s model.")
    before = source.dataset
    if dataset is None or before is None or _is_script(new):  # a script's model, head included, is its own
        return
    for attr, what in (("sample_shape", "sample shape"), ("num_classes", "number of classes")):
        old, now = getattr(before, attr), getattr(dataset, attr)
        if old is not None and now is not None and list(old if isinstance(old, list) else [old]) != list(
                now if isinstance(now, list) else [now]):
            errors.add("dataset", f"Fine-tune keeps job #{source.pk}'s model, head included: its dataset "
                                  f"{before.name} has {what} {old}, dataset {dataset.name} has {now}. Choose a "
                                  f"dataset with the same {what}.")


def _count(errors: Errors) -> int:
    return sum(len(messages) for messages in errors.values())


def job_init(errors: Errors, *, source: TrainingJob | None, mode: str, config: JobConfig, backend: ComputeBackend,
             adapter: Any, dataset: Any) -> int | None:
    """Check that a job of ``config`` on ``backend`` can start from ``source`` in ``mode``
    (continue | finetune; ``source`` must have ended: a running job's files still change) and set ``config.train.init_from`` / ``init_mode`` to the source's file.
    Returns the epochs the checkpoint holds (continue; None for finetune). Errors are added to
    ``errors`` keyed by the form/API fields (model_spec, epochs, lr, strategy, dataset, backend,
    hyperparameters, __all__); nothing is set then."""
    if mode not in INIT_MODES:
        errors.add("init_mode", f"Init mode must be continue or finetune (or blank), not {str(mode)[:40]!r}.")
        return None
    if source is None:
        errors.add("init_mode", "Continue and fine-tune start from another job: choose the job.")
        return None
    if not source.is_terminal:
        what = "its last checkpoint" if mode == "continue" else "its trained weights"
        errors.add("init_mode", f"Job #{source.pk} is {source.state}, not ended: {_MODE_VERB[mode]} starts from "
                                f"{what}, which the job still writes while it runs. Wait until it has ended "
                                f"(or cancel it: a cancelled job keeps its last checkpoint), or clone it "
                                f"without init_mode to start a new run like it from scratch.")
        return None
    # A script's checkpoint holds what its script saved: its epoch is not known (not "epoch 0").
    epochs_done = (training_job_checkpoint_epoch(job=source)
                   if mode == "continue" and not _is_script(config.to_dict()) else None)
    found = _count(errors)
    if mode == "continue":
        _check_continue(errors, source, config, epochs_done)
    else:
        _check_finetune(errors, source, config, dataset)
    # A sharded checkpoint was refused above for what it is: not also as a missing last.pt.
    sharded = mode == "continue" and _wrote_sharded(source, config.to_dict())
    name, uri = ("", "") if sharded else _artifact(errors, source, mode)
    if not name or not _readable_where(errors, source, name, uri, backend, adapter) or _count(errors) > found:
        return None
    config.train.init_from = uri
    config.train.init_mode = mode
    return epochs_done
