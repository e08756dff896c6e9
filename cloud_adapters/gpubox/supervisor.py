"""The per-job supervisor of the gpubox backend: starts torchrun, enforces cancel and max runtime,
and leaves the outcome on disk.

Started detached by :meth:`GpuBoxBackend.submit` (never through a shell)::

    python -m cloud_adapters.gpubox.supervisor --run-dir DIR --grace-period 10 --max-runtime 3600 \\
        --start-lock-fd 5 --plan-stdin -- /usr/bin/python3 -m torch.distributed.run --nnodes 1 \\
           --nproc_per_node 2 --standalone -m trainer_pkg.launch --config DIR/job.json

(the command is :func:`trainer_pkg.launch.torchrun_command`'s, as ``trainer_pkg.launch --standalone``
would start it, or a ``docker run`` of it in the job's image).

With ``--plan-stdin`` the submitting worker writes one JSON object to its stdin and closes it::

    {"env": {...},          the job's whole environment (secrets included: never written anywhere)
     "user": {"name", "uid", "gid", "groups", "home"} | null,   the OS user the job runs as
     "environment": {"dir", "lock", "marker", "sha256", "steps": [[argv], ...], "env": {...}} | null,
     "isolation": {"run_root", "uid"} | null,   the job's own uid, given back when it is over
                                  (cloud_adapters.gpubox._usercode.release_job_user)
     "memory_limit": {"job_bytes", "per_process_bytes"} | null,   RLIMIT_DATA of torchrun and each rank
     "cleanup": [argv] | null,    run once the job is over (``docker rm --force`` of its container)
     "in_container": bool}        the commands are ``docker run``s (started as the worker, see
                                  ``_Supervisor._user_kwargs``)

Without it the command gets this process's own environment.

What it does, in order:

1. records itself in ``DIR/supervisor.json`` (pid, /proc start ticks, start time) unless the
   submitting process already did, then closes its copy of ``DIR/start.lock`` (``--start-lock-fd``)
   so that a retry of the submit may adopt the run; logs the trainer snapshot of ``DIR/trainer.json``;
2. when the plan has an ``environment`` (the job's requirements), takes its lock (``flock``, waiting
   for another job building the same one) and reuses it when its marker is there ("reusing
   environment ..." in train.log), else runs its steps (venv, then pip) as the job's user, output in
   train.log, and writes the marker last; a failed step removes the unfinished environment and ends
   the job with pip's error as its reason (``exit.json`` ``stage: requirements``);
3. starts the command in its own process group (``start_new_session``), stdout and stderr appended
   to ``DIR/train.log``, cwd ``DIR``, ``TRAINBOARD_GPUBOX_RUN=DIR`` in its environment, and records
   the group in ``DIR/torchrun.json``. torchrun starts each rank in a session of its own, so the
   group alone does not reach the ranks; the inherited environment tag does;
4. waits. A cancel (SIGTERM/SIGINT to the supervisor, or the file ``DIR/cancel_requested``) or the
   max runtime sends SIGTERM to every rank (then to torchrun's group if it lingers), waits up to the
   grace period, then SIGKILLs them;
5. kills whatever is left (orphaned ranks) once torchrun has exited, runs the plan's ``cleanup``
   (on every way out, a failed environment build included), then writes
   ``DIR/exit.json`` atomically: ``returncode``, ``started_at``, ``ended_at`` (Unix seconds),
   ``cancelled``, ``max_runtime`` (True when the max runtime stopped it), ``reason``, ``stage``
   (``requirements`` when the environment's build failed, else ``train``).

Its own messages go to ``DIR/supervisor.log``, never into the trainer's log, except the environment's
``[environment] ...`` progress lines, which the job's log shows. It imports neither torch nor Django,
so it starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from cloud_adapters.gpubox._usercode import release_job_user
from cloud_adapters.gpubox._proc import (
    RUN_TAG_VAR,
    chown_tree,
    job_processes,
    kill_group,
    read_json,
    signal_job,
    signal_pid,
    start_ticks,
    write_json_atomic,
)

POLL_S = 0.2  # how often the wait loop looks at the child, the cancel file and the clock
ERROR_LINES = 5  # pip's error lines an environment's failure reason quotes at most
REASON_CHARS = 2000


class _Supervisor:
    def __init__(self, run_dir: Path, grace_s: float, max_runtime_s: float, command: list[str],
                 start_lock_fd: int | None = None, plan: Mapping[str, Any] | None = None):
        self.run_dir = run_dir
        self.start_lock_fd = start_lock_fd
        self.grace_s = grace_s
        self.max_runtime_s = max_runtime_s
        self.command = command
        self.plan = plan
        self.started_at = time.time()
        self.deadline = self.started_at + max_runtime_s
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

    def _user_kwargs(self) -> dict[str, Any]:
        """Popen's arguments that start a child as the plan's user (none when that is us already, or
        when the child is a ``docker`` client: the Docker daemon's socket is the worker's, and the
        container itself runs as the user by ``docker run --user``)."""
        user = (self.plan or {}).get("user")
        if not user or int(user["uid"]) == os.geteuid() or (self.plan or {}).get("in_container"):
            return {}
        return {"user": int(user["uid"]), "group": int(user["gid"]),
                "extra_groups": [int(g) for g in user.get("groups") or []]}

    def _spawn(self, argv: Sequence[str], env: Mapping[str, str], log, limit_memory: bool = False) -> subprocess.Popen:
        env = dict(env)
        limit = ((self.plan or {}).get("memory_limit") or {}).get("per_process_bytes") if limit_memory else None
        env[RUN_TAG_VAR] = str(self.run_dir)  # inherited by every rank: how we find them all
        return subprocess.Popen(
            list(argv),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.run_dir,
            start_new_session=True,  # its own process group: one killpg reaches every rank
            # Inherited by torchrun's ranks: private writable memory (heap, tensors), not the address
            # space CUDA reserves (PROT_NONE), so it bounds what a rank allocates, on GPUs too.
            preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_DATA, (int(limit), int(limit)))) if limit else None,
            **self._user_kwargs(),
        )

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
        trainer = read_json(self.run_dir / "trainer.json")
        if trainer:
            self.say(f"trainer snapshot {str(trainer.get('sha256'))[:16]} at {trainer.get('dir')} "
                     f"(sha256 {trainer.get('sha256')}, made from {trainer.get('source')})")

        if self.cancel_requested():  # cancelled before torchrun ever started
            self.say("cancel requested before start; torchrun not started")
            return self.finish(None, cancelled=True, reason=f"{self.stop_reason()} before start")

        if self.plan is None:
            env = dict(os.environ)
        else:
            env = dict(self.plan.get("env") or {})
            if self.plan.get("environment"):
                ended = self.prepare_environment(self.plan["environment"])
                if ended is not None:
                    return ended
        with open(self.run_dir / "train.log", "ab") as log:
            try:
                child = self._spawn(self.command, env, log, limit_memory=True)
            except OSError as exc:
                log.write(f"trainer error: could not start {self.command[0]}: {exc}\n".encode())
                return self.finish(127, cancelled=False, reason=f"could not start torchrun: {exc}")
        pgid = child.pid
        write_json_atomic(
            self.run_dir / "torchrun.json",
            {"pid": child.pid, "pgid": pgid, "start_ticks": start_ticks(child.pid),
             "started_at": time.time()},
        )
        what = self._started_what()
        self.say(f"started {what} pid {child.pid} in process group {pgid}")
        cancelled, timed_out, reason = self.watch(child, pgid)
        returncode = self.reap(child, pgid)
        self.say(f"{what} exited with code {returncode}")
        return self.finish(returncode, cancelled=cancelled, reason=reason, max_runtime=timed_out)

    def _started_what(self) -> str:
        """What the command starts, for the log: torchrun, or the launcher alone (an MPI job's)."""
        command = [str(part) for part in self.command]
        if any(part == "torch.distributed.run" or os.path.basename(part) == "torchrun" for part in command):
            return "torchrun"
        return "the launcher"

    def watch(self, child: subprocess.Popen, pgid: int) -> tuple[bool, bool, str]:
        """Wait for ``child`` to exit, stopping its group on a cancel or at the max runtime;
        ``(cancelled, timed_out, reason)``."""
        while not _exited(child.pid):
            if self.cancel_requested():
                reason = self.stop_reason()
                self.say(f"{reason}: stopping the process group")
                self.stop_group(child.pid, pgid)
                return True, False, reason
            if time.time() > self.deadline:
                reason = (f"Max runtime reached: the run took longer than {self.max_runtime_s:g} s, start-up "
                          f"included; raise the max runtime or resume from the job's checkpoints")
                self.say(reason)
                self.stop_group(child.pid, pgid)
                return False, True, reason
            time.sleep(POLL_S)
        return False, False, ""

    def reap(self, child: subprocess.Popen, pgid: int) -> int:
        """Kill what ``child`` left behind, then reap it; its exit code."""
        # The child has exited but is not reaped yet, so its pid (= the group id) cannot have been
        # reused: kill anything it left behind (ranks live in sessions of their own), then reap it.
        kill_group(pgid, signal.SIGKILL)
        signal_job(str(self.run_dir), signal.SIGKILL, exclude=os.getpid())
        return child.wait()

    def cleanup(self) -> None:
        """Run the plan's cleanup once the job is over: a killed ``docker run`` client leaves its
        container running, so the job's containers are removed by name."""
        command = (self.plan or {}).get("cleanup")
        if not command:
            return
        try:
            subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=60)  # our own, clean, environment
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.say(f"cleanup {command[:3]} failed: {exc}")

    # -- the requirements environment ---------------------------------------------------------

    def prepare_environment(self, spec: Mapping[str, Any]) -> int | None:
        """Reuse or build the job's requirements environment (module docstring, step 2); None when
        it is ready, else what :meth:`finish` returned (the job is over)."""
        env_dir, marker = Path(spec["dir"]), Path(spec["marker"])
        sha16 = str(spec.get("sha256", ""))[:16]
        with open(self.run_dir / "train.log", "ab", buffering=0) as log:
            def note(message: str) -> None:
                log.write(f"[environment] {message}\n".encode())
                self.say(message)

            fd = os.open(spec["lock"], os.O_CREAT | os.O_RDWR, 0o644)
            try:
                waiting = False
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if not waiting:
                            note(f"waiting for another job building environment {env_dir}")
                            waiting = True
                    if self.cancel_requested():
                        return self.finish(None, cancelled=True, reason=f"{self.stop_reason()} before start")
                    if time.time() > self.deadline:
                        return self.finish(None, cancelled=False, max_runtime=True, reason=(
                            f"Max runtime reached while waiting for environment {env_dir} to be built "
                            f"({self.max_runtime_s:g} s); raise the max runtime"))
                    time.sleep(POLL_S)
                if marker.exists():
                    note(f"reusing environment {env_dir} (requirements {sha16})")
                    return None
                return self._build_environment(spec, env_dir, marker, log, note)
            finally:
                os.close(fd)  # releases the lock

    def _build_environment(self, spec: Mapping[str, Any], env_dir: Path, marker: Path, log,
                           note) -> int | None:
        if env_dir.exists():  # an unfinished build (no marker): start it over
            shutil.rmtree(env_dir, ignore_errors=True)
        note(f"building environment {env_dir} for the job's requirements.txt "
             f"(requirements {str(spec.get('sha256', ''))[:16]})")
        user = (self.plan or {}).get("user")
        try:
            env_dir.mkdir()
            if user:
                os.chown(env_dir, int(user["uid"]), int(user["gid"]))
        except OSError as exc:
            return self.finish(None, cancelled=False, stage="requirements",
                               reason=f"could not create the job's environment {env_dir}: {exc}")
        start = log.tell()
        for step in spec["steps"]:
            try:
                child = self._spawn(step, spec.get("env") or {}, log)
            except OSError as exc:
                shutil.rmtree(env_dir, ignore_errors=True)
                return self.finish(127, cancelled=False, stage="requirements",
                                   reason=f"could not build the job's environment: {step[0]}: {exc}")
            cancelled, timed_out, reason = self.watch(child, child.pid)
            code = self.reap(child, child.pid)
            if cancelled or timed_out or code != 0:
                shutil.rmtree(env_dir, ignore_errors=True)
                if cancelled or timed_out:
                    return self.finish(None, cancelled=cancelled, max_runtime=timed_out, reason=reason)
                note(f"environment build failed: {' '.join(step[:4])} ... exited with code {code}; "
                     f"{env_dir} removed")
                return self.finish(code, cancelled=False, stage="requirements", reason=(
                    f"installing the job's requirements failed (exit code {code}): "
                    f"{_error_lines(self.run_dir / 'train.log', start)}"))
        if user:
            # Shared by every later job with the same requirements: none of them may change it.
            chown_tree(env_dir, os.geteuid(), os.getegid())
        write_json_atomic(marker, {"sha256": spec.get("sha256"), "built_at": time.time(),
                                   "built_by": self.run_dir.name})
        note(f"environment {env_dir} ready")
        return None

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

    def finish(self, returncode: int | None, *, cancelled: bool, reason: str, max_runtime: bool = False,
               stage: str = "train") -> int:
        self.cleanup()
        isolation = (self.plan or {}).get("isolation")
        if isolation:
            # The job's uid is its own: whatever still runs as it (a daemon that dropped the run's
            # environment tag) is killed, its files become root's, and the uid goes back to the pool.
            try:
                release_job_user(Path(isolation["run_root"]), int(isolation["uid"]), self.run_dir)
            except OSError as exc:
                self.say(f"could not give uid {isolation.get('uid')} back: {exc}")
        write_json_atomic(
            self.run_dir / "exit.json",
            {"returncode": returncode, "started_at": self.started_at, "ended_at": time.time(),
             "cancelled": cancelled, "max_runtime": max_runtime, "reason": reason[:REASON_CHARS],
             "stage": stage, "memory_limit": (self.plan or {}).get("memory_limit")},
        )
        self._log.close()
        return 0


def _error_lines(log_path: Path, start: int) -> str:
    """pip's ``ERROR:`` lines written to ``log_path`` after byte ``start`` (its last lines when it
    printed none), joined for a failure reason."""
    try:
        with open(log_path, "rb") as fh:
            fh.seek(start)
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return "see the job's log"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("[environment]")]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    return " | ".join((errors or lines)[-ERROR_LINES:]) or "see the job's log"


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
    parser.add_argument("--plan-stdin", action="store_true",
                        help="read the job's environment, user and requirements steps as JSON from stdin")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the torchrun command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given after --")

    if not args.run_dir.is_absolute():
        parser.error("--run-dir must be absolute")
    plan, plan_error = None, ""
    if args.plan_stdin:
        try:
            plan = json.loads(sys.stdin.buffer.read())
            if not isinstance(plan, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:  # the submitting worker died while writing it
            plan, plan_error = {}, f"could not read the job's plan from the submitting worker ({exc}); re-run the job"
    # Not resolved: the backend finds the ranks by this exact string (their environment tag).
    sup = _Supervisor(args.run_dir, args.grace_period, args.max_runtime, command, args.start_lock_fd, plan)
    if plan_error:
        sup.say(plan_error)
        return sup.finish(None, cancelled=False, reason=plan_error)

    def on_term(signum: int, frame: object) -> None:  # a flag only: the wait loop does the work
        sup.signalled = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # detached: a closing terminal is no cancel
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
