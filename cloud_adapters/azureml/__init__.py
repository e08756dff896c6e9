"""The Azure ML backend: Trainboard jobs as Azure ML command jobs through azure-ai-ml v2 (MLClient).

Exports exactly the backend class; see :mod:`cloud_adapters.azureml.backend` for what a job is made
of, :mod:`~cloud_adapters.azureml.states` for the status mapping and
:mod:`~cloud_adapters.azureml.logs` for the log reader.

The SDKs are imported on first use (a client is created), but their absence is reported here, at
import, so :func:`cloud_adapters.registry.backend_class` answers MissingDependency naming the
``azure`` extra before any job is tried.
"""

import importlib.util

for _sdk in ("azure.ai.ml", "azure.identity", "azure.core"):
    try:
        _found = importlib.util.find_spec(_sdk)
    except ModuleNotFoundError:
        _found = None
    if _found is None:
        raise ModuleNotFoundError(f"No module named {_sdk!r}", name=_sdk)

from cloud_adapters.azureml.backend import AzureMLBackend  # noqa: E402

__all__ = ["AzureMLBackend"]
