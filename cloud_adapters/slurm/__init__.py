"""The Slurm backend (``slurm``): one ``sbatch`` per job on a cluster the site already runs.

:mod:`.backend` (the adapter and its settings), :mod:`.script` (the batch script and the sbatch option
allowlist), :mod:`.states` (Slurm's states and output formats), :mod:`.transport` / :mod:`.ssh` (how
the worker reaches the login node)."""

from cloud_adapters.slurm.backend import SlurmBackend

__all__ = ["SlurmBackend"]
