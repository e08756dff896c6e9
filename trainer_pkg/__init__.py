"""Trainboard's trainer and launcher; ``from trainer_pkg import report`` is the API a user's script calls.

Importing the package imports no torch: the dashboard reads its config and metric record format.
"""

from trainer_pkg import report

__all__ = ["report"]
