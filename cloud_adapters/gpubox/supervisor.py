"""The per-job supervisor of the gpubox backend: starts torchrun, enforces cancel and max runtime,
and leaves the outcome on disk.

Started detached by :meth:`GpuBoxBackend.submit` (never through a shell)::

    python -m cloud_adapters.gpubox.supervisor --run-dir DIR --grace-period 10 --max-runtime 3600 \\
        --start-lock-fd 5 -- /usr/bin/python3 -m torch.distributed.run --nnodes 1 --nproc_per_node 2 \\
           --standalone -m trainer_pkg.launch --config DIR/job.json

(the command is :func:`trainer_pkg.launch.torchrun_command`'s, as ``trainer_pkg.launch --standalone``
would start it).

What it does, in order:

1. records itself in ``DIR/supervisor.json`` (pid, /proc start ticks, start time) unless the
   submitting process already did, then closes its copy of ``DIR/start.lock`` (``--start-lock-fd``)
   so that a retry of the submit may adopt the run;
2. starts the command in its own process group (``start_new_session``), stdout and stderr appended
   to ``DIR/train.log``, cwd ``DIR``, ``TRAINBOARD_GPUBOX_RUN=DIR`` in its environment, and records
   the group in ``DIR/torchrun.json``. torchrun starts each rank in a session of its own, so the
   group alone does not reach the ranks; the inherited environment tag does;
3. waits. A cancel (SIGTERM/SIGINT to the supervisor, or the file ``DIR/cancel_requested``) or the
   max runtime sends SIGTERM to every rank (then to torchrun's group if it lingers), waits up to the
   grace period, then SIGKILLs them;
4. kills whatever is left (orphaned ranks) once torchrun has exited, then writes
   ``DIR/exit.json`` atomically: ``returncode``, ``started_at``, ``ended_at`` (Unix seconds),
   ``cancelled``, ``max_runtime`` (True when the max runtime stopped it), ``reason``.

Its own messages go to ``DIR/supervisor.log``, never into the trainer's log. It imports neither torch
nor Django, so it starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from cloud_adapters.gpubox._proc import (
    RUN_TAG_VAR,
    job_processes,
    kill_group,
    signal_job,
    signal_pid,
    start_ticks,
    write_json_atomic,
)

POLL_S = 0.2  # how often the wait loop looks at the child, the cancel file and the clock


class _Supervisor:
    def __init__(self, run_dir: Path, grace_s: float, max_runtime_s: float, command: list[str],
                 start_lock_fd: int | None = None):
        self.run_dir = run_dir
        self.start_lock_fd = start_lock_fd
        self.grace_s = grace_s
        self.max_runtime_s = max_runtime_s
        self.command = command
        self.started_at = time.time()
        self.signalled = False
        self._log = open(run_dir / "supervisor.log", "a", encoding="utf-8", buffering=1)

    def say(self, message: str) -> None:
        self._log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {message}\n")

    def cancel_requested(self) -> bool:
        return self.signalled or (self.run_dir / "cancel_requested").exists()

    def stop_reason(self) -> str:
        """Why the job is being stopped: a Trainboard cancel leaves ``cancel_requested`` before it
        signals; a SIGTERM/SIGINT without it came from elsewhere (a shutdown, someone's kill)."""
        if (self.run_dir / "cancel_requested").exists():
            return "stopped by user"
        return "stopped by a signal to the job's supervisor (no cancel was requested: a shutdown or a kill)"

    def run(self) -> int:
        pid = os.getpid()
        record = self.run_dir / "supervisor.json"
        if not record.exists():  # submit writes it first; this covers a submit that died mid-way
            write_json_atomic(
                record, {"pid": pid, "start_ticks": start_ticks(pid), "started_at": self.started_at}
            )
        if self.start_lock_fd is not None:
            # Recorded: a retry now adopts this run, so the start lock (inherited from the submit,
            # held in case that worker died) may go. Closed, never unlocked (see backend._start_lock).
            os.close(self.start_lock_fd)
            self.start_lock_fd = None

        if self.cancel_requested():  # cancelled before torchrun ever started
            self.say("cancel requested before start; torchrun not started")
            return self.finish(None, cancelled=True, reason=f"{self.stop_reason()} before start")

        env = dict(os.environ)
        env[RUN_TAG_VAR] = str(self.run_dir)  # inherited by every rank: how we find them all
        with open(self.run_dir / "train.log", "ab") as log:
            try:
                child = subprocess.Popen(
                    self.command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.run_dir,
                    start_new_session=True,  # its own process group: one killpg reaches every rank
                )
            except OSError as exc:
                log.write(f"trainer error: could not start {self.command[0]}: {exc}\n".encode())
                return self.finish(127, cancelled=False, reason=f"could not start torchrun: {exc}")
        pgid = child.pid
        write_json_atomic(
            self.run_dir / "torchrun.json",
            {"pid": child.pid, "pgid": pgid, "start_ticks": start_ticks(child.pid),
             "started_at": time.time()},
        )
        self.say(f"started torchrun pid {child.pid} in process group {pgid}")

        deadline = self.started_at + self.max_runtime_s
        reason = ""
        cancelled = timed_out = False
        while not _exited(child.pid):
            if self.cancel_requested():
                cancelled, reason = True, self.stop_reason()
                self.say(f"{reason}: stopping the process group")
                self.stop_group(child.pid, pgid)
                break
            if time.time() > deadline:
                timed_out = True
                reason = (f"Max runtime reached: the run took longer than {self.max_runtime_s:g} s, start-up "
                          f"included; raise the max runtime or resume from the job's checkpoints")
                self.say(reason)
                self.stop_group(child.pid, pgid)
                break
            time.sleep(POLL_S)
        # torchrun has exited but is not reaped yet, so its pid (= the group id) cannot have been
        # reused: kill anything it left behind (ranks live in sessions of their own), then reap it.
        kill_group(pgid, signal.SIGKILL)
        signal_job(str(self.run_dir), signal.SIGKILL, exclude=os.getpid())
        returncode = child.wait()
        self.say(f"torchrun exited with code {returncode}")
        return self.finish(returncode, cancelled=cancelled, reason=reason, max_runtime=timed_out)

    def stop_group(self, pid: int, pgid: int) -> None:
        """Stop the job within the grace period, quietly when it cooperates.

        SIGTERM goes to the ranks first: the trainer checkpoints and exits 0, and torchrun, seeing
        every rank done, ends by itself (a SIGTERM to torchrun would instead make it print a
        SignalException traceback and abort, which reads like a crash in the job's log). torchrun's
        group gets SIGTERM only when no rank is left but torchrun lingers (e.g. still in
        rendezvous), and everything is SIGKILLed when the grace period is over.
        """
        me = os.getpid()
        ranks = [p for p in job_processes(str(self.run_dir), me) if p != pid]
        for rank in ranks:
            signal_pid(rank, None, signal.SIGTERM)
        give_up = time.time() + self.grace_s
        torchrun_signalled = not ranks
        if torchrun_signalled:
            kill_group(pgid, signal.SIGTERM)
        while time.time() < give_up:
            if _exited(pid):
                return
            if not torchrun_signalled and not [p for p in job_processes(str(self.run_dir), me) if p != pid]:
                time.sleep(1.0)  # torchrun notices its ranks ended within its monitor interval
                if _exited(pid):
                    return
                kill_group(pgid, signal.SIGTERM)
                torchrun_signalled = True
            time.sleep(min(POLL_S, 0.05))
        self.say(f"torchrun (process group {pgid}) still alive after {self.grace_s:g} s; SIGKILL")
        kill_group(pgid, signal.SIGKILL)
        signal_job(str(self.run_dir), signal.SIGKILL, exclude=me)

    def finish(self, returncode: int | None, *, cancelled: bool, reason: str, max_runtime: bool = False) -> int:
        write_json_atomic(
            self.run_dir / "exit.json",
            {"returncode": returncode, "started_at": self.started_at, "ended_at": time.time(),
             "cancelled": cancelled, "max_runtime": max_runtime, "reason": reason},
        )
        self._log.close()
        return 0


def _exited(pid: int) -> bool:
    """True once ``pid`` (our child) has exited; it stays unreaped so its group id stays ours."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cloud_adapters.gpubox.supervisor")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--grace-period", type=float, default=10.0, help="seconds from SIGTERM to SIGKILL")
    parser.add_argument("--max-runtime", type=float, default=3600.0, help="seconds")
    parser.add_argument("--start-lock-fd", type=int, default=None,
                        help="descriptor of the run's start.lock, closed once supervisor.json is written")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the torchrun command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given after --")

    if not args.run_dir.is_absolute():
        parser.error("--run-dir must be absolute")
    # Not resolved: the backend finds the ranks by this exact string (their environment tag).
    sup = _Supervisor(args.run_dir, args.grace_period, args.max_runtime, command, args.start_lock_fd)

    def on_term(signum: int, frame: object) -> None:  # a flag only: the wait loop does the work
        sup.signalled = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # detached: a closing terminal is no cancel
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
