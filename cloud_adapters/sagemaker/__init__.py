"""The SageMaker backend: Trainboard jobs as SageMaker training jobs through plain boto3.

Exports exactly the backend class; see :mod:`cloud_adapters.sagemaker.backend` for what a job is made
of, :mod:`~cloud_adapters.sagemaker.states` for the status mapping and
:mod:`~cloud_adapters.sagemaker.logs` for the CloudWatch tailer.

boto3 itself is imported on first use (a client is created), but its absence is reported here, at
import, so :func:`cloud_adapters.registry.backend_class` answers MissingDependency naming boto3 (the
``aws`` group's SDK) before any job is tried.
"""

import importlib.util

for _sdk in ("boto3", "botocore"):
    if importlib.util.find_spec(_sdk) is None:
        raise ModuleNotFoundError(f"No module named {_sdk!r}", name=_sdk)

from cloud_adapters.sagemaker.backend import SageMakerBackend  # noqa: E402

__all__ = ["SageMakerBackend"]
