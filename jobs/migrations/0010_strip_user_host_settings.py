"""Remove host settings from the backends of users who are not staff.

A GPU box's ``run_root``, ``python`` and ``max_procs_per_node`` decide what runs on the worker's
machine, where and with how many processes; a cloud backend's endpoint URLs (and SageMaker's
``profile``) decide where the worker sends its calls and with which of its own credentials. Only the
installation's settings or a staff user's backend may set them (``jobs.adapters.backend_adapter``). Rows saved before that rule may carry them:
the adapter already ignores them, and this migration removes them so that editing such a backend
does not stumble on a value its owner may no longer save.

The key set is frozen here as it stood at this migration (the adapter's ``host_settings`` may grow
later; a later migration handles what it adds). Not reversible in content: the removed values were
never in effect once the rule shipped, so backwards does nothing.
"""

from __future__ import annotations

from django.db import migrations

HOST_SETTINGS = {
    "gpubox": ("run_root", "python", "max_procs_per_node"),
    "sagemaker": ("profile", "endpoint_url"),
    "vertex": ("api_endpoint", "storage_endpoint"),
    "azureml": ("base_url",),
}


def forwards(apps, schema_editor) -> None:
    ComputeBackend = apps.get_model("jobs", "ComputeBackend")
    for kind, keys in HOST_SETTINGS.items():
        rows = (ComputeBackend.objects.filter(kind=kind).exclude(owner__is_staff=True, owner__is_active=True)
                .only("id", "config"))
        for backend in rows.iterator():
            config = backend.config if isinstance(backend.config, dict) else {}
            kept = {k: v for k, v in config.items() if k not in keys}
            if kept != config:
                ComputeBackend.objects.filter(pk=backend.pk).update(config=kept)


def backwards(apps, schema_editor) -> None:
    pass


class Migration(migrations.Migration):
    dependencies = [("jobs", "0009_trainingjob_on_demand_price")]

    operations = [migrations.RunPython(forwards, backwards, elidable=False)]
