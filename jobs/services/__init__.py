"""Writes. Views, the API, admin actions and management commands call these functions; the worker
side (:mod:`jobs.lifecycle`, :mod:`jobs.sync`) and the leaf modules they share (:mod:`jobs.adapters`,
:mod:`jobs.dispatch`, :mod:`jobs.deadlines`, :mod:`jobs.validation`) live beside this package.

One module per sub-domain: :mod:`~jobs.services.resources` (datasets, model specs, backends, their
connection test and instance offers), :mod:`~jobs.services.prices` (the instance price catalog),
:mod:`~jobs.services.training_jobs` (create, estimate, re-run, cancel),
:mod:`~jobs.services.clones` (clone with edits, continue, fine-tune), :mod:`~jobs.services.lineage`
(where a continued or fine-tuned job starts from) and :mod:`~jobs.services.experiments` (tags, notes,
archive, saved filters, list columns). This package re-exports
their public functions, so callers write ``services.training_job_create(...)``.

Every function is keyword-only. Input errors raise :class:`django.core.exceptions.ValidationError`
whose ``message_dict`` is keyed by the form/API field names (``__all__`` for the rest) with messages
a user can act on, and nothing is written when they raise. Side effects outside the database (Celery
messages, provider calls) happen after commit, so a rolled-back request never launches a cloud job.
The contract is docs/internal-api.md.
"""

from jobs.services.experiments import (
    job_list_columns_save,
    saved_filter_create,
    saved_filter_delete,
    training_job_annotate,
    training_jobs_archive,
)
from jobs.services.notifications import (
    notification_preference_update,
    webhook_create,
    webhook_delete,
    webhook_update,
)
from jobs.services.prices import instance_price_save, instance_price_seed, instance_price_upsert
from jobs.services.resources import (
    backend_create,
    backend_instance_offers,
    backend_test_connection,
    backend_update,
    dataset_create,
    dataset_update,
    model_spec_create,
    model_spec_update,
)
from jobs.services.clones import training_job_clone, training_job_clone_data
from jobs.services.training_jobs import (
    training_job_cancel,
    training_job_check,
    training_job_create,
    training_job_estimate,
    training_job_preview,
    training_job_rerun,
)

__all__ = [
    "notification_preference_update",
    "webhook_create",
    "webhook_delete",
    "webhook_update",
    "backend_create",
    "backend_instance_offers",
    "backend_test_connection",
    "backend_update",
    "dataset_create",
    "dataset_update",
    "instance_price_save",
    "instance_price_seed",
    "instance_price_upsert",
    "job_list_columns_save",
    "model_spec_create",
    "model_spec_update",
    "saved_filter_create",
    "saved_filter_delete",
    "training_job_annotate",
    "training_jobs_archive",
    "training_job_cancel",
    "training_job_clone",
    "training_job_clone_data",
    "training_job_check",
    "training_job_create",
    "training_job_estimate",
    "training_job_preview",
    "training_job_rerun",
]
