"""The GPU box's runner: a long-lived process that starts the jobs' supervisors for a worker that
may come and go (docker-compose.yml's ``gpubox-runner`` service; docs/docker.md).

Without a runner, :meth:`GpuBoxBackend.submit` starts each supervisor itself, detached
(``start_new_session``): it outlives the Celery worker process. In a container that is not enough:
stopping the worker's container kills every process in it, supervisors and ranks included. So the
worker's container hands the start to this process, in a container of its own, over a Unix socket
in a volume both mount::

    python -m cloud_adapters.gpubox.runner --socket /var/lib/trainboard/runner/runner.sock
    python -m cloud_adapters.gpubox.runner --socket PATH --ping     # exit 0 when it answers (health check)

and the worker is started with ``TRAINBOARD_GPUBOX_RUNNER_SOCKET`` set to the same path. The worker
must see the runner's processes (compose: ``pid: "service:gpubox-runner"``): it judges a job by its
supervisor's pid in ``/proc`` and cancels it by signal, exactly as without a runner; the runner refuses
a worker in another PID namespace rather than start jobs it would report lost.

Protocol (one request per connection): a 4-byte big-endian length, then a JSON object, with file
descriptors passed alongside it (``SCM_RIGHTS``)::

    {"op": "ping"}                                      -> {"ok": true, "pid_ns": "pid:[4026531836]"}
    {"op": "start", "args": [...], "env": {...},        -> {"ok": true, "pid": 123, "start_ticks": 456}
     "cwd": "/abs/run/dir", "pid_ns": "pid:[...]"}         or {"ok": false, "error": "..."}
       + 3 descriptors: the supervisor's stdin (the read end of the worker's plan pipe), its
         stdout+stderr (supervisor.log) and the run's start.lock

The runner runs ``<its own interpreter> -m cloud_adapters.gpubox.supervisor --start-lock-fd N *args``
and nothing else, in its own session, with ``cwd`` (which must lie in the runner's
``TRAINBOARD_RUN_ROOT``), ``env`` and the three descriptors; the start lock is the same open file as
the worker's, so the supervisor holds it exactly as a directly started one does. Only a peer with the
runner's own uid is served (``SO_PEERCRED``); the socket is made mode 0600. The runner reaps its
children and exits on SIGTERM/SIGINT (jobs it started end with its container: restart the runner only
when no job runs).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from cloud_adapters.gpubox import _proc

SOCKET_VAR = "TRAINBOARD_GPUBOX_RUNNER_SOCKET"  # = backend.RUNNER_SOCKET_VAR (this module imports no backend)
"""The worker's setting: when set, :meth:`GpuBoxBackend.submit` starts supervisors through the
runner listening on this Unix socket path instead of as its own children."""

MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a job's whole environment fits many times over
START_FDS = 3  # stdin, log, start lock
TIMEOUT_S = 30.0  # one request, connect to reply


class RunnerError(Exception):
    """The runner could not be reached or refused the request. ``reached`` is False when no runner
    answered (not listening, restarting): the start may be retried as it stands."""

    def __init__(self, message: str, reached: bool):
        super().__init__(message)
        self.reached = reached


def pid_namespace() -> str:
    """This process's PID namespace as ``/proc/self/ns/pid`` names it, e.g. ``pid:[4026531836]``."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


# -- the wire -----------------------------------------------------------------------------------


def _send(sock: socket.socket, payload: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    body = json.dumps(payload).encode()
    data = struct.pack(">I", len(body)) + body
    if fds:
        socket.send_fds(sock, [data[:1]], list(fds))  # the descriptors ride on the first byte
        data = data[1:]
    sock.sendall(data)


def _recv(sock: socket.socket, want_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
    """One message: its JSON object and the descriptors sent with it (the caller closes them)."""
    fds: list[int] = []
    head = b""
    if want_fds:
        first, fds, _flags, _addr = socket.recv_fds(sock, 1, want_fds)
        head = first
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            raise ConnectionError("connection closed before the message's length")
        head += chunk
    (length,) = struct.unpack(">I", head)
    if length > MAX_REQUEST_BYTES:
        raise ValueError(f"message of {length} bytes is over the limit of {MAX_REQUEST_BYTES}")
    body = b""
    while len(body) < length:
        chunk = sock.recv(min(65536, length - len(body)))
        if not chunk:
            raise ConnectionError("connection closed in the middle of a message")
        body += chunk
    message = json.loads(body)
    if not isinstance(message, dict):
        raise ValueError("not a JSON object")
    return message, fds


def _request(socket_path: str, payload: Mapping[str, Any], fds: Sequence[int] = ()) -> dict[str, Any]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(TIMEOUT_S)
    try:
        try:
            sock.connect(socket_path)
        except OSError as exc:
            raise RunnerError(f"the GPU box's runner at {socket_path} is not answering ({exc.strerror or exc}); "
                              f"is the gpubox-runner service up?", reached=False) from None
        try:
            _send(sock, payload, fds)
            reply, _ = _recv(sock)
        except (OSError, ValueError, ConnectionError) as exc:
            raise RunnerError(f"the GPU box's runner at {socket_path} did not reply: {exc}", reached=False) from None
    finally:
        sock.close()
    if not reply.get("ok"):
        raise RunnerError(f"the GPU box's runner refused: {reply.get('error') or 'no reason given'}", reached=True)
    return reply


# -- the worker's side ---------------------------------------------------------------------------


def ping(socket_path: str) -> dict[str, Any]:
    """``{"ok": True, "pid_ns": ...}`` from the runner; :class:`RunnerError` when none answers."""
    return _request(socket_path, {"op": "ping"})


def start_supervisor(socket_path: str, *, args: Sequence[str], env: Mapping[str, str], cwd: str,
                     stdin_fd: int, log_fd: int, lock_fd: int) -> tuple[int, int | None]:
    """Have the runner start ``python -m cloud_adapters.gpubox.supervisor --start-lock-fd N *args``;
    ``(pid, start_ticks)`` of the supervisor as this process sees it in ``/proc``.

    ``args``: the supervisor's arguments without ``--start-lock-fd``; the three descriptors are
    sent, not closed (the caller closes its own). Raises :class:`RunnerError`."""
    reply = _request(socket_path, {"op": "start", "args": [str(a) for a in args],
                                   "env": {str(k): str(v) for k, v in env.items()},
                                   "cwd": str(cwd), "pid_ns": pid_namespace()},
                     fds=(stdin_fd, log_fd, lock_fd))
    try:
        return int(reply["pid"]), reply.get("start_ticks")
    except (KeyError, TypeError, ValueError):
        raise RunnerError(f"the GPU box's runner sent no pid: {reply!r:.200}", reached=True) from None


# -- the runner itself -----------------------------------------------------------------------------


class Runner:
    """Serves start requests on ``socket_path`` until :meth:`stop` (see the module docstring).

    ``run_root``: the only directory tree a supervisor may be started in (its run directories)."""

    def __init__(self, socket_path: Path, run_root: Path):
        self.socket_path = socket_path
        self.run_root = Path(os.path.normpath(run_root))
        self.stopping = False
        self.children: list[subprocess.Popen] = []
        self._sock: socket.socket | None = None

    def say(self, message: str) -> None:
        print(f"[gpubox-runner] {message}", flush=True)

    def listen(self) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.socket_path.unlink()  # a socket left by an earlier runner in this volume
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            sock.bind(str(self.socket_path))
        finally:
            os.umask(old_umask)
        sock.listen(16)
        self._sock = sock
        self.say(f"listening on {self.socket_path} (run root {self.run_root}, {pid_namespace()})")

    def serve(self) -> None:
        """Accept requests until :meth:`stop`; reaps finished supervisors between requests."""
        if self._sock is None:
            self.listen()
        assert self._sock is not None
        try:
            while not self.stopping:
                try:
                    ready, _, _ = select.select([self._sock], [], [], 1.0)
                except InterruptedError:
                    ready = []
                self.reap()
                if ready and not self.stopping:
                    try:
                        conn, _ = self._sock.accept()
                    except OSError:
                        continue
                    with conn:
                        self.handle(conn)
        finally:
            self._sock.close()
            try:
                self.socket_path.unlink()
            except FileNotFoundError:
                pass

    def stop(self) -> None:
        self.stopping = True

    def reap(self) -> None:
        self.children = [c for c in self.children if c.poll() is None]

    def handle(self, conn: socket.socket) -> None:
        conn.settimeout(TIMEOUT_S)
        fds: list[int] = []
        try:
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            if uid != os.geteuid():
                _send(conn, {"ok": False, "error": f"uid {uid} may not use this runner (it serves uid {os.geteuid()})"})
                return
            try:
                request, fds = _recv(conn, want_fds=START_FDS)
            except (OSError, ValueError, ConnectionError) as exc:
                _send(conn, {"ok": False, "error": f"unreadable request: {exc}"})
                return
            _send(conn, self.answer(request, fds))
        except OSError as exc:  # the worker went away mid-request: nothing to answer
            self.say(f"request dropped: {exc}")
        finally:
            for fd in fds:
                os.close(fd)

    def answer(self, request: Mapping[str, Any], fds: Sequence[int]) -> dict[str, Any]:
        op = request.get("op")
        if op == "ping":
            return {"ok": True, "pid_ns": pid_namespace(), "children": len(self.children)}
        if op != "start":
            return {"ok": False, "error": f"unknown op {str(op)[:40]!r} (ping or start)"}
        problems = self.start_problems(request, fds)
        if problems:
            return {"ok": False, "error": "; ".join(problems)}
        stdin_fd, log_fd, lock_fd = fds
        argv = [sys.executable, "-m", "cloud_adapters.gpubox.supervisor", "--start-lock-fd", str(lock_fd),
                *request["args"]]
        try:
            child = subprocess.Popen(argv, stdin=stdin_fd, stdout=log_fd, stderr=subprocess.STDOUT,
                                     cwd=request["cwd"], env=dict(request["env"]), start_new_session=True,
                                     close_fds=True, pass_fds=(lock_fd,))
        except OSError as exc:
            return {"ok": False, "error": f"could not start the supervisor: {exc}"}
        self.children.append(child)
        self.say(f"started supervisor pid {child.pid} in {request['cwd']}")
        return {"ok": True, "pid": child.pid, "start_ticks": _proc.start_ticks(child.pid)}

    def start_problems(self, request: Mapping[str, Any], fds: Sequence[int]) -> list[str]:
        """Every reason to refuse a start request, at once."""
        problems = []
        if len(fds) != START_FDS:
            problems.append(f"expected {START_FDS} descriptors (stdin, log, start lock), got {len(fds)}")
        args, env, cwd = request.get("args"), request.get("env"), request.get("cwd")
        if not isinstance(args, list) or not all(isinstance(a, str) and "\0" not in a for a in args):
            problems.append("args: expected a list of strings")
        elif "--start-lock-fd" in args:
            problems.append("args: --start-lock-fd is the runner's to set")
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) and "\0" not in k + v
                                                for k, v in env.items()):
            problems.append("env: expected an object of strings")
        if not isinstance(cwd, str) or not os.path.isabs(cwd) or "\0" in cwd:
            problems.append("cwd: expected an absolute path")
        elif not Path(os.path.realpath(cwd)).is_relative_to(os.path.realpath(self.run_root)):
            problems.append(f"cwd: {cwd[:200]} is not inside the runner's run root {self.run_root}")
        elif not os.path.isdir(cwd):
            problems.append(f"cwd: {cwd[:200]} is not a directory")
        ns = request.get("pid_ns")
        if ns != pid_namespace():
            problems.append(f"the worker runs in PID namespace {str(ns)[:40]}, this runner in {pid_namespace()}: "
                            f"the worker could not see the jobs it starts (compose: pid: \"service:gpubox-runner\" "
                            f"on the worker)")
        return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cloud_adapters.gpubox.runner")
    parser.add_argument("--socket", default=os.environ.get(SOCKET_VAR), help=f"Unix socket path (default ${SOCKET_VAR})")
    parser.add_argument("--run-root", default=os.environ.get("TRAINBOARD_RUN_ROOT"),
                        help="the run directories' root (default $TRAINBOARD_RUN_ROOT)")
    parser.add_argument("--ping", action="store_true", help="ask a running runner; exit 0 when it answers")
    args = parser.parse_args(argv)
    if not args.socket or not os.path.isabs(args.socket):
        parser.error(f"--socket (or ${SOCKET_VAR}) must be an absolute path")
    if args.ping:
        try:
            ping(args.socket)
        except RunnerError as exc:
            print(exc, file=sys.stderr)
            return 1
        return 0
    if not args.run_root or not os.path.isabs(args.run_root):
        parser.error("--run-root (or $TRAINBOARD_RUN_ROOT) must be an absolute path")
    Path(args.run_root).mkdir(parents=True, exist_ok=True)
    runner = Runner(Path(args.socket), Path(args.run_root))

    def on_term(signum: int, frame: object) -> None:
        runner.stop()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    runner.listen()
    runner.serve()
    runner.say("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
