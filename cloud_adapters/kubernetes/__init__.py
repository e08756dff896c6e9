"""The Kubernetes backend (``kubernetes``): Trainboard jobs as Kubeflow Trainer TrainJobs through the
official ``kubernetes`` client.

Exports exactly the backend class; see :mod:`cloud_adapters.kubernetes.backend` for the calls,
:mod:`~cloud_adapters.kubernetes.body` for the TrainJob body, :mod:`~cloud_adapters.kubernetes.states`
for the state table and :mod:`~cloud_adapters.kubernetes.logs` for the pod-log tailer.

The client is imported on first use, but its absence is reported here, at import, so
:func:`cloud_adapters.registry.backend_class` answers MissingDependency naming the package.
"""

import importlib.util

if importlib.util.find_spec("kubernetes") is None:
    raise ModuleNotFoundError("No module named 'kubernetes'", name="kubernetes")

from cloud_adapters.kubernetes.backend import KubernetesBackend  # noqa: E402

__all__ = ["KubernetesBackend"]
