"""The gpubox backend: torchrun on the machine whose worker consumes the box's queue, ``gpubox.<name>``.

Exports exactly the backend class; see :mod:`cloud_adapters.gpubox.backend` for states and the
run-directory layout, and :mod:`cloud_adapters.gpubox.supervisor` for the per-job supervisor.
"""

from cloud_adapters.gpubox.backend import GpuBoxBackend

__all__ = ["GpuBoxBackend"]
