"""The one place that maps a backend kind name to its adapter class.

Nothing outside this module branches on provider names (DESIGN.md §1). Adapters are imported lazily,
on first use, so a web process without, say, boto3 installed still lists every kind and fails only
when that kind is used, with an error naming the pip extra to install.

Usage::

    backend = create_backend("gpubox", {"run_root": "/var/lib/trainboard/runs"})
    handle = backend.submit(spec)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple

from cloud_adapters.base import Backend, InvalidSpec, MissingDependency
from cloud_adapters.settings import BackendSettings

if TYPE_CHECKING:
    from cloud_adapters.pricing import PriceCatalog


class KindInfo(NamedTuple):
    module: str  # dotted module path that defines the adapter class
    class_name: str  # the Backend subclass in that module
    label: str  # human-readable name for forms and the admin


KINDS: dict[str, KindInfo] = {
    "gpubox": KindInfo("cloud_adapters.gpubox", "GpuBoxBackend", "Local GPU box (torchrun)"),
    "sagemaker": KindInfo("cloud_adapters.sagemaker", "SageMakerBackend", "AWS SageMaker"),
    "vertex": KindInfo("cloud_adapters.vertex", "VertexBackend", "Google Vertex AI"),
    "azureml": KindInfo("cloud_adapters.azureml", "AzureMLBackend", "Azure ML"),
    "slurm": KindInfo("cloud_adapters.slurm", "SlurmBackend", "Slurm cluster"),
    "kubernetes": KindInfo("cloud_adapters.kubernetes", "KubernetesBackend", "Kubernetes (Kubeflow Trainer)"),
    "ray": KindInfo("cloud_adapters.ray", "RayBackend", "Ray cluster"),
}
"""kind -> (module path, class name, human label). A new provider is its package (the adapter class
with its ``settings`` declaration) and one line here; the backend form, the admin, the API and the
settings checks are built from the declaration."""

EXTRAS: dict[str, str] = {"sagemaker": "aws", "vertex": "gcp", "azureml": "azure", "kubernetes": "kubernetes"}
"""kind -> the provider group whose SDK it needs, where it needs one (e.g. "sagemaker": "aws")."""

SDK_PACKAGES: dict[str, str] = {"aws": "boto3", "gcp": "google-cloud-aiplatform",
                                "azure": "azure-ai-ml and azure-identity", "kubernetes": "kubernetes"}
"""provider group -> the PyPI packages (pinned in requirements.txt) its adapters import."""


def backend_class(kind: str) -> type[Backend]:
    """The adapter class for ``kind``, imported on first use.

    Raises :class:`InvalidSpec` for an unknown kind (the message lists the known ones) and
    :class:`MissingDependency` when the provider's SDK is not installed (naming the extra).
    """
    try:
        info = KINDS[kind]
    except (KeyError, TypeError):
        raise InvalidSpec(
            f"unknown backend kind {kind!r}; known kinds: {', '.join(sorted(KINDS))}."
        ) from None
    try:
        module = importlib.import_module(info.module)
    except ImportError as exc:
        extra = EXTRAS.get(kind, kind)
        raise MissingDependency(
            f"the {info.label} backend needs a package that is not installed ({exc.name or exc}); "
            f"install {SDK_PACKAGES.get(extra, extra)} with `pip install -r requirements.txt` "
            f"(the versions Trainboard is tested with)."
        ) from exc
    cls = getattr(module, info.class_name)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):  # a registry typo, not user input
        raise TypeError(f"{info.module}.{info.class_name} is not a Backend subclass")
    return cls


def create_backend(kind: str, config: Mapping[str, Any] | None = None, *, secrets: Mapping[str, str] | None = None,
                   prices: "PriceCatalog | None" = None) -> Backend:
    """A configured backend of ``kind``; ``config`` is validated by the class's ``clean_config``
    (:class:`InvalidSpec` naming the field). ``secrets``: its stored credentials (the keys its
    ``settings`` declare; None = the provider's default chain). ``prices``: the catalog its ``price``
    uses (default: the shipped one)."""
    return backend_class(kind)(config, secrets=secrets, prices=prices)


def backend_settings(kind: str) -> BackendSettings:
    """The settings declaration of ``kind`` (``Backend.settings``); raises as :func:`backend_class`."""
    return backend_class(kind).settings


def registered_settings() -> dict[str, BackendSettings]:
    """``{kind: settings declaration}`` of the registered kinds, in registration order, for the forms
    and the API that list them; a kind whose adapter cannot be imported (its SDK is missing) is left
    out: choosing it is refused with the package to install (:func:`backend_class`)."""
    schemas = {}
    for kind in KINDS:
        try:
            schemas[kind] = backend_settings(kind)
        except MissingDependency:
            continue
    return schemas


def kind_choices() -> list[tuple[str, str]]:
    """``[(kind, label), ...]`` in registration order, for form and model choices."""
    return [(kind, info.label) for kind, info in KINDS.items()]
