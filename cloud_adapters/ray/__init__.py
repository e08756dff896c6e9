"""The Ray backend (``ray``): one Ray job per Trainboard job on an existing Ray cluster, through Ray's
Job Submission API over plain HTTP (no ``ray`` package in the dashboard's processes).

:mod:`.backend` (the adapter and its settings), :mod:`.states` (Ray's job states and log prefixes),
:mod:`.logtail` (reading the job's log from its end, a bounded amount per call).
What runs on the cluster: :mod:`trainer_pkg.ray_entry`."""

from cloud_adapters.ray.backend import RayBackend

__all__ = ["RayBackend"]
