"""Slurm's job states as Trainboard's, and the fixed output formats of squeue, sacct and scontrol.

Every Slurm command here is asked for a format we name (``squeue -o``, ``sacct --parsable2 -o``,
``scontrol -o show job``), never JSON: ``--json`` output differs across Slurm versions and older ones
lack it (clouds.md §7). The commands run with ``TZ=UTC`` and ``SLURM_TIME_FORMAT=standard``, so
times are ISO-8601 local times of UTC (``2026-12-01T23:45:53``) and are read as UTC.

State table (DESIGN.md §4, Slurm row; the states are Slurm's ``JOB_STATE_CODES``, squeue(1) "JOB
STATE CODES", Slurm 22.05):

==================  ===========  ==========================================================
Slurm state         JobState     shown
==================  ===========  ==========================================================
PENDING             PENDING      the reason squeue gives (Resources, Priority, QOSMaxJobs…)
CONFIGURING         PENDING      "nodes booting / configuring"
REQUEUED, REQUEUE_  PENDING      "requeued"
HOLD, REQUEUE_FED,
RESV_DEL_HOLD,
SUSPENDED
RUNNING             RUNNING
COMPLETING          RUNNING      the job's processes are ending
STAGE_OUT, SIGNAL-  RUNNING
ING, RESIZING,
STOPPED
COMPLETED           SUCCEEDED
FAILED              FAILED       the trainer's error, else "exit code N"
CANCELLED           CANCELLED    (sacct's "CANCELLED by <uid>" too)
TIMEOUT             FAILED       "time limit (--time …) reached"
NODE_FAIL           FAILED       "a node of the job failed"
PREEMPTED           FAILED       "preempted by a higher-priority job"
OUT_OF_MEMORY       FAILED       "out of memory"
BOOT_FAIL           FAILED       "a node failed to boot"
DEADLINE            FAILED       "deadline (--deadline) reached before it could end"
SPECIAL_EXIT,       FAILED       the state's name
REVOKED
anything else       PENDING      non-terminal, with a warning naming the state
==================  ===========  ==========================================================

NODE_FAIL, PREEMPTED and BOOT_FAIL (:data:`LOST_STATES`) are lost runs, not the job's own failure:
the status has ``lost`` set and Trainboard may resubmit the job from its checkpoint
(docs/recovery.md). So is a job the controller no longer knows that left no exit record (its node
vanished with it). TIMEOUT, OUT_OF_MEMORY, DEADLINE and FAILED are the job's own: never resubmitted.
A job Slurm requeues itself (``--requeue``, the cluster's JobRequeue) goes back to PENDING
(REQUEUED): an interruption Slurm restarts, not a loss.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from typing import Iterable

from cloud_adapters.base import JobState, parse_utc

PENDING_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                            "RESV_DEL_HOLD", "SUSPENDED"})
RUNNING_STATES = frozenset({"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING", "STOPPED"})
SUCCEEDED_STATES = frozenset({"COMPLETED"})
CANCELLED_STATES = frozenset({"CANCELLED"})
FAILED_REASONS: dict[str, str] = {
    "FAILED": "",  # the trainer's own error, from the job's log, says more than Slurm does
    "TIMEOUT": "time limit (--time {time_limit}) reached: Slurm stopped the job",
    "NODE_FAIL": "a node of the job failed (NODE_FAIL); Slurm ended the job",
    "PREEMPTED": "preempted by a higher-priority job (PREEMPTED)",
    "OUT_OF_MEMORY": "out of memory (OUT_OF_MEMORY): a process used more than the job's --mem",
    "BOOT_FAIL": "a node failed to boot (BOOT_FAIL)",
    "DEADLINE": "deadline (--deadline) reached before the job could end (DEADLINE)",
    "SPECIAL_EXIT": "ended in Slurm's SPECIAL_EXIT state (a requeue that failed)",
    "REVOKED": "revoked by the federation (REVOKED): a sibling cluster runs it",
}
"""Slurm's failed states → the failure reason shown ("{time_limit}" is the job's limit)."""
FAILED_STATES = frozenset(FAILED_REASONS)
LOST_STATES = frozenset({"NODE_FAIL", "PREEMPTED", "BOOT_FAIL"})
"""Failed states that are a lost run (a node that failed or never booted, a preemption), not the job's
own error: :attr:`cloud_adapters.base.JobStatus.lost`."""
TERMINAL_STATES = SUCCEEDED_STATES | CANCELLED_STATES | FAILED_STATES

SQUEUE_FIELDS = ("%i", "%j", "%T", "%r", "%S", "%e", "%D", "%l", "%k", "%V")
"""squeue ``-o`` fields: job id, name, state (long), reason, start, end, nodes, time limit, comment,
submit time; joined by :data:`SEP`."""
SACCT_FIELDS = ("JobID", "JobName", "State", "Reason", "Start", "End", "Elapsed", "ExitCode", "NNodes",
                "Timelimit")
SEP = "|"
"""The field separator of the formats above: job names are ours and hold no "|" (JOB_NAME_RE)."""


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    """One job as a Slurm command reports it (one squeue/sacct line, one scontrol record)."""

    job_id: str  # Slurm's job id, e.g. "17"
    name: str = ""  # --job-name
    state: str = ""  # Slurm's state, upper case, without "by <uid>" (e.g. "CANCELLED")
    reason: str = ""  # why it waits / why it ended ("Resources", "TimeLimit", "None" → "")
    started_at: dt.datetime | None = None  # UTC
    ended_at: dt.datetime | None = None  # UTC
    nodes: int = 0  # nodes allocated (or asked for while pending)
    time_limit: str = ""  # as Slurm prints it, e.g. "1:00", "UNLIMITED"
    exit_code: int | None = None  # the batch script's exit code (sacct, scontrol), None if unknown
    signal: int = 0  # the signal that ended it (ExitCode "0:15" → 15)
    comment: str = ""  # --comment (Trainboard's tag)
    submitted_at: dt.datetime | None = None  # UTC


def normal_state(raw: str) -> str:
    """``"CANCELLED by 0"`` → ``"CANCELLED"``; ``"running"`` → ``"RUNNING"`` (first word, upper)."""
    words = (raw or "").strip().split()
    return words[0].upper().rstrip("+") if words else ""


def _time(text: str) -> dt.datetime | None:
    text = (text or "").strip()
    if text in ("", "N/A", "None", "Unknown", "(null)"):
        return None
    return parse_utc(text.replace(" ", "T")) if re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", text) else None


def _int(text: str) -> int:
    text = (text or "").strip()
    return int(text) if text.isdigit() else 0


def _reason(text: str) -> str:
    text = (text or "").strip()
    return "" if text in ("None", "(null)", "N/A") else text


def _exit_code(text: str) -> tuple[int | None, int]:
    match = re.fullmatch(r"(\d+):(\d+)", (text or "").strip())
    return (int(match.group(1)), int(match.group(2))) if match else (None, 0)


def parse_squeue(text: str) -> list[SlurmJob]:
    """The jobs of ``squeue -h -o <SQUEUE_FIELDS joined by SEP>`` output; malformed lines are skipped."""
    jobs = []
    for line in text.splitlines():
        parts = line.split(SEP)
        if len(parts) != len(SQUEUE_FIELDS) or not parts[0].strip().isdigit():
            continue
        job_id, name, state, reason, start, end, nodes, limit, comment, submit = (p.strip() for p in parts)
        state = normal_state(state)
        jobs.append(SlurmJob(job_id=job_id, name=name, state=state, reason=_reason(reason),
                             # squeue prints the expected start/end of a pending job: not a start
                             started_at=None if state in PENDING_STATES else _time(start),
                             ended_at=_time(end) if state in TERMINAL_STATES else None,
                             nodes=_int(nodes), time_limit=limit, comment=_reason(comment),
                             submitted_at=_time(submit)))
    return jobs


def parse_sacct(text: str) -> list[SlurmJob]:
    """The jobs of ``sacct --parsable2 -n -X -o <SACCT_FIELDS>`` output (allocations only, ``-X``)."""
    jobs = []
    for line in text.splitlines():
        parts = line.split(SEP)
        if len(parts) != len(SACCT_FIELDS) or not parts[0].strip().isdigit():
            continue
        job_id, name, state, reason, start, end, _elapsed, exit_code, nodes, limit = (p.strip() for p in parts)
        code, sig = _exit_code(exit_code)
        state = normal_state(state)
        jobs.append(SlurmJob(job_id=job_id, name=name, state=state, reason=_reason(reason),
                             started_at=_time(start), ended_at=_time(end) if state in TERMINAL_STATES else None,
                             nodes=_int(nodes), time_limit=limit, exit_code=code, signal=sig))
    return jobs


_SCONTROL_PAIR = re.compile(r"(\w[\w/:]*)=(\S*)")


def parse_scontrol(text: str) -> list[SlurmJob]:
    """The jobs of ``scontrol -o show job <id>`` output (one ``Key=Value …`` line per job). Values
    with spaces (a Command with arguments) are cut at the space: none of the keys read here has one."""
    jobs = []
    for line in text.splitlines():
        fields = dict(_SCONTROL_PAIR.findall(line))
        if not fields.get("JobId", "").isdigit():
            continue
        code, sig = _exit_code(fields.get("ExitCode", ""))
        state = normal_state(fields.get("JobState", ""))
        jobs.append(SlurmJob(job_id=fields["JobId"], name=fields.get("JobName", ""), state=state,
                             reason=_reason(fields.get("Reason", "")),
                             started_at=None if state in PENDING_STATES else _time(fields.get("StartTime", "")),
                             ended_at=_time(fields.get("EndTime", "")) if state in TERMINAL_STATES else None,
                             nodes=_int(fields.get("NumNodes", "")), time_limit=fields.get("TimeLimit", ""),
                             exit_code=code, signal=sig, comment=_reason(fields.get("Comment", "")),
                             submitted_at=_time(fields.get("SubmitTime", ""))))
    return jobs


def job_state(state: str) -> JobState | None:
    """The :class:`JobState` of Slurm state ``state`` (:func:`normal_state` form); None when unknown."""
    if state in PENDING_STATES:
        return JobState.PENDING
    if state in RUNNING_STATES:
        return JobState.RUNNING
    if state in SUCCEEDED_STATES:
        return JobState.SUCCEEDED
    if state in CANCELLED_STATES:
        return JobState.CANCELLED
    if state in FAILED_STATES:
        return JobState.FAILED
    return None


def pending_reason(job: SlurmJob) -> str:
    """What the job page shows while the job waits: "waiting: Resources" (squeue's reason code)."""
    if job.state == "CONFIGURING":
        return "nodes booting / configuring"
    if job.state in ("REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"):
        return f"requeued ({job.state})"
    if job.state == "SUSPENDED":
        return "suspended by Slurm"
    return f"waiting: {job.reason}" if job.reason else "waiting"


def failed_reason(job: SlurmJob) -> str:
    """Why Slurm says the job failed (empty for plain FAILED: the log says more)."""
    template = FAILED_REASONS.get(job.state, "")
    return template.format(time_limit=job.time_limit or "?")


def by_id(jobs: Iterable[SlurmJob]) -> dict[str, SlurmJob]:
    return {j.job_id: j for j in jobs}
