"""Ray's job states (the Job Submission API's ``JobStatus``) as data, and how Ray's log lines are read.

Ray documents five states (ray.job_submission.JobStatus): PENDING (submitted, the driver not started:
the runtime environment is being set up, or the cluster waits for resources), RUNNING, STOPPED
(``ray job stop`` / ``POST /api/jobs/{id}/stop``), SUCCEEDED (the entrypoint exited 0) and FAILED.
A stopped job is never SUCCEEDED (DESIGN.md §4): STOPPED is CANCELLED.
"""

from __future__ import annotations

import re

from cloud_adapters.base import JobState

STATES: dict[str, JobState] = {
    "PENDING": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "STOPPED": JobState.CANCELLED,
    "SUCCEEDED": JobState.SUCCEEDED,
    "FAILED": JobState.FAILED,
}
"""Ray's ``JobStatus`` → ours; a state not here keeps the job active with a warning."""

RAY_PREFIX = re.compile(r"^(?:\x1b\[[0-9;]*m)?\((?P<who>[A-Za-z_][\w.]*) pid=\d+(?:, ip=[^)]*)?\)(?:\x1b\[[0-9;]*m)? ?")
"""What Ray puts before a line it forwards from a worker to the job's log: ``(RayTrainWorker pid=12,
ip=10.0.0.5) `` (colored unless ``RAY_COLOR_PREFIX=0``)."""


def job_state(raw: str) -> JobState | None:
    """Our state for Ray's ``raw`` status; None for a status Ray did not document."""
    return STATES.get(str(raw or "").upper())


def unprefixed(line: str) -> str:
    """``line`` without the ``(Worker pid=…)`` prefix Ray adds to a forwarded line."""
    return RAY_PREFIX.sub("", line, count=1)
