"""The Vertex AI backend: Trainboard jobs as Vertex AI custom jobs through google-cloud-aiplatform.

Exports exactly the backend class; see :mod:`cloud_adapters.vertex.backend` for what a job is made
of, :mod:`~cloud_adapters.vertex.states` for the state mapping, :mod:`~cloud_adapters.vertex.logs`
for the Cloud Logging tailer and :mod:`~cloud_adapters.vertex.package` for the pip-installable
trainer archive.

The SDKs are imported on first use, but their absence is reported here, at import, so
:func:`cloud_adapters.registry.backend_class` answers MissingDependency naming the ``gcp`` extra
before any job is tried.
"""

import importlib.util

for _sdk in ("google.cloud.aiplatform_v1", "google.cloud.storage", "google.auth"):
    try:
        _found = importlib.util.find_spec(_sdk) is not None
    except ModuleNotFoundError:
        _found = False
    if not _found:
        raise ModuleNotFoundError(f"No module named {_sdk!r}", name=_sdk)

from cloud_adapters.vertex.backend import VertexBackend  # noqa: E402

__all__ = ["VertexBackend"]
