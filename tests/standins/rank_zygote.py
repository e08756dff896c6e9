"""A rank zygote for the torch-free torchrun (:mod:`standins.torchrun_lite`): one long-lived process
per pytest process that has imported ``torch`` and ``numpy`` once (about 1.3 CPU-seconds each time a
rank would otherwise do it) and forks a child for each rank the lite agent asks it for.

The zygote imports nothing of the repository: it runs as ``python -P rank_zygote.py SOCKET``
(``-P``: no script directory on ``sys.path``) with ``PYTHONPATH`` removed, so a rank whose
``PYTHONPATH`` names another ``trainer_pkg`` (the GPU box snapshot) imports that one. Before it forks
it starts no thread, initialises no process group and never asks torch for its thread count.

A child becomes what ``rank_python -u -m MODULE ARGS`` (or ``rank_python -u SCRIPT ARGS``) would be:

- ``os.environ`` replaced wholesale by the requested environment, ``cwd`` as requested;
- ``sys.path`` as that interpreter would build it: ``cwd`` (``-m``) or the script's directory, then
  ``PYTHONPATH``'s entries (made absolute against ``cwd``, an empty one being ``cwd``), then the
  zygote's own ``-P`` path (the standard library and site-packages);
- the requester's stdin/stdout/stderr (passed over the unix socket with ``SCM_RIGHTS``) on 0, 1, 2,
  every other descriptor closed, stdio unbuffered (``-u``);
- a session of its own (``os.setsid``, as torch's SubprocessHandler starts a rank), Python's default
  signal dispositions (SIGINT raising KeyboardInterrupt, SIGPIPE and SIGXFSZ ignored, every other
  signal SIG_DFL) and an empty signal mask;
- ``torch.set_num_threads(OMP_NUM_THREADS)`` when the environment sets it: the OpenMP runtime read
  ``OMP_NUM_THREADS`` from the zygote's environment when torch was imported, so without this a rank
  would get the zygote's count, not its own (tests/trainer_pkg/test_torchrun_lite.py checks
  ``torch.get_num_threads()`` in a rank);
- numpy's global generator reseeded from the OS (a fresh interpreter seeds it so; Python's ``random``
  reseeds itself after a fork);
- the module run by ``runpy`` as ``__main__``, then its atexit handlers, then ``os._exit`` with the
  exit code ``SystemExit`` gives (1 after an uncaught exception, its traceback on stderr).

What differs from a fresh interpreter, by design: the string hash seed is the zygote's (the same for
every rank; a request whose ``PYTHONHASHSEED`` differs from the zygote's is refused and the agent
starts a plain process), ``sys.flags`` are the zygote's (``-P`` among them), and anything torch
reads from the environment *at import* was read from the zygote's (a rank without
``OMP_NUM_THREADS`` gets the thread count the zygote's environment gave; ``MKL_NUM_THREADS`` and
the like are not re-applied).

Protocol (one unix stream connection per rank): the requester sends one byte with its three stdio
descriptors attached, then an 8-byte big-endian length and a JSON request ``{"python", "argv",
"env", "cwd"}`` (``argv``: ``["-m", MODULE, ...]`` or ``[SCRIPT, ...]``); the zygote answers one
line, ``pid N`` or ``refused REASON``, and after ``pid`` one more line, ``status S`` (the raw wait
status), when the child has ended. :class:`RankProcess` is the requester's side, a
``subprocess.Popen``-like object. Closing the zygote (SIGTERM, or end of file on its stdin, which
the pytest process holds) SIGKILLs the process group of every child still running, reaps them and
exits.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
import time

ENABLE_VAR = "TRAINBOARD_TEST_RANK_ZYGOTE"
"""``0`` turns the zygote off: ranks start as plain subprocesses."""
SOCKET_VAR = "TRAINBOARD_TEST_RANK_ZYGOTE_SOCKET"
"""The zygote's socket path, set in the pytest process's environment once the zygote is up (the lite
agent, a grandchild, reads it; it removes it from the ranks' environment)."""
START_TIMEOUT_S = 60.0
"""Seconds the pytest process waits for the zygote to import torch and listen."""
CONNECT_TIMEOUT_S = 10.0
"""Seconds the agent waits for the zygote's ``pid`` answer before it starts a plain process."""
CLOSE_TIMEOUT_S = 10.0
"""Seconds the pytest process gives the zygote to kill its leftovers and exit before SIGKILL."""
_KEEP: list = []
"""The zygote's own stdio objects, kept alive in a child so that collecting them never closes the
rank's descriptors 0, 1, 2."""


# -- the zygote -----------------------------------------------------------------------------------


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``conn`` (raises ConnectionError at end of file first)."""
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("end of file")
        data += chunk
    return data


def _python_path(env: dict[str, str], cwd: str, first: str, base: list[str]) -> list[str]:
    """``sys.path`` as a fresh interpreter would build it (module docstring)."""
    extra = []
    for entry in (env.get("PYTHONPATH") or "").split(os.pathsep) if env.get("PYTHONPATH") else []:
        extra.append(os.path.normpath(os.path.join(cwd, entry)) if entry else cwd)
    return [first, *extra, *base]


def _become_rank(request: dict, fds: list[int], base_path: list[str], close: list) -> None:
    """In the forked child: become the rank (module docstring). Never returns."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)  # before its pipe is closed
        for obj in close:
            obj.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target, inheritable=True)
        os.closerange(3, 65536)
        for sig in range(1, signal.NSIG):
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError, RuntimeError):
                pass
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        import io

        _KEEP.extend([sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__])
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.open(0, "rb", closefd=False), errors="strict")
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.open(1, "wb", 0, closefd=False), write_through=True,
                                                       line_buffering=False)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.open(2, "wb", 0, closefd=False), write_through=True,
                                                       errors="backslashreplace")
        env, cwd, argv = request["env"], request["cwd"], request["argv"]
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        import numpy
        import torch

        numpy.random.seed()
        if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        import runpy

        if argv[0] == "-m":
            sys.path[:] = _python_path(env, cwd, os.getcwd(), base_path)
            sys.argv = ["-m", *argv[2:]]
            run = lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True)  # noqa: E731
        else:
            script = os.path.join(cwd, argv[0])
            sys.path[:] = _python_path(env, cwd, os.path.dirname(os.path.realpath(script)), base_path)
            sys.argv = list(argv)
            run = lambda: runpy.run_path(argv[0], run_name="__main__")  # noqa: E731
        try:
            run()
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
            sys.excepthook(*sys.exc_info())
            code = 1
        import atexit

        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - setting the rank up failed: say why on its stderr
        try:
            import traceback

            traceback.print_exc()
        except BaseException:  # noqa: BLE001
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001
                pass
        os._exit(code & 0xFF)


def serve(path: str) -> None:
    """The zygote's loop: import torch and numpy, listen on ``path``, fork ranks, report their pids
    and wait statuses; stop on SIGTERM or end of file on stdin."""
    import numpy  # noqa: F401 - imported once, for every rank
    import torch  # noqa: F401

    base_path = list(sys.path)
    stopping: list[int] = []
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.signal(signal.SIGCHLD, lambda s, f: None)
    signal.signal(signal.SIGTERM, lambda s, f: stopping.append(s))
    signal.set_wakeup_fd(wake_w)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    children: dict[int, socket.socket] = {}
    pending: dict[socket.socket, None] = {}
    stdin = sys.stdin.fileno()
    print("ready", flush=True)
    while not stopping:
        try:
            readable, _, _ = select.select([listener, wake_r, stdin, *pending], [], [], 1.0)
        except InterruptedError:
            readable = []
        if stdin in readable and not os.read(stdin, 4096):
            break
        if wake_r in readable:
            try:
                while os.read(wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        if listener in readable:
            conn, _ = listener.accept()
            pending[conn] = None
        for conn in [c for c in readable if isinstance(c, socket.socket) and c in pending]:
            del pending[conn]
            fds: list[int] = []
            try:
                conn.settimeout(CONNECT_TIMEOUT_S)
                _, fds, _, _ = socket.recv_fds(conn, 1, 3)
                size = struct.unpack(">Q", _recv_exact(conn, 8))[0]
                request = json.loads(_recv_exact(conn, size))
                if len(fds) != 3:
                    reason = f"{len(fds)} descriptors, not 3"
                elif request["python"] != sys.executable:
                    reason = f"rank interpreter {request['python']} is not the zygote's {sys.executable}"
                elif request["env"].get("PYTHONHASHSEED") != os.environ.get("PYTHONHASHSEED"):
                    reason = "PYTHONHASHSEED differs from the zygote's"
                else:
                    reason = ""
                if reason:
                    conn.sendall(f"refused {reason}\n".encode())
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    _become_rank(request, fds, base_path,
                                 [listener, conn, *pending, *children.values()] + [_Fd(wake_r), _Fd(wake_w)])
                children[pid] = conn
                conn.sendall(f"pid {pid}\n".encode())
            except (OSError, ValueError, KeyError, struct.error) as exc:
                try:
                    conn.sendall(f"refused {type(exc).__name__}: {exc}\n".encode())
                except OSError:
                    pass
                conn.close()
            finally:
                for fd in fds:
                    os.close(fd)
        _reap(children)
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    while children and time.monotonic() < deadline:
        _reap(children)
        if children:
            select.select([wake_r], [], [], 0.05)
    listener.close()
    try:
        os.unlink(path)
        os.rmdir(os.path.dirname(path))  # its private directory, also when the pytest process died first
    except OSError:
        pass


class _Fd:
    """A raw descriptor with a ``close()``, for the list of what a child closes."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        os.close(self.fd)


def _reap(children: dict[int, socket.socket]) -> None:
    """Report and forget every child that has ended (``status S`` on its connection)."""
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 255 << 8
        if done:
            conn = children.pop(pid)
            try:
                conn.sendall(f"status {status}\n".encode())
            except OSError:
                pass
            conn.close()



# -- the pytest process's side: start and stop the zygote ------------------------------------------

_ZYGOTE: dict = {}
"""This process's zygote once started: ``proc`` (its Popen), ``dir`` (its private directory)."""


def enabled() -> bool:
    """Whether ranks may use the zygote (``TRAINBOARD_TEST_RANK_ZYGOTE`` is not ``0``)."""
    return os.environ.get(ENABLE_VAR, "1") != "0"


def ensure() -> str | None:
    """Start this process's zygote if it is not running (its socket path in ``os.environ`` under
    :data:`SOCKET_VAR`, for the agents this process starts); the socket path, or None when the zygote
    is off or did not start (the ranks then start as plain processes)."""
    if not enabled():
        os.environ.pop(SOCKET_VAR, None)
        return None
    proc = _ZYGOTE.get("proc")
    if proc is not None and proc.poll() is None and _ZYGOTE.get("pid") == os.getpid():
        os.environ[SOCKET_VAR] = _ZYGOTE["path"]  # a test that turned the zygote off popped it
        return _ZYGOTE["path"]
    import atexit
    import shutil
    import subprocess
    import tempfile

    directory = tempfile.mkdtemp(prefix="rank-zygote-")  # mode 0700: only this user can connect
    path = os.path.join(directory, "socket")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", SOCKET_VAR)}
    proc = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__), path], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=directory)
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
    if not ready or proc.stdout.readline() != b"ready\n":
        proc.kill()
        proc.wait()
        shutil.rmtree(directory, ignore_errors=True)
        os.environ.pop(SOCKET_VAR, None)
        return None
    _ZYGOTE.update(proc=proc, dir=directory, path=path, pid=os.getpid())
    if not _ZYGOTE.get("atexit"):
        atexit.register(stop)
        _ZYGOTE["atexit"] = True
    os.environ[SOCKET_VAR] = path
    return path


def stop() -> None:
    """Stop this process's zygote (it SIGKILLs the ranks it still has), SIGKILL it after
    :data:`CLOSE_TIMEOUT_S`, remove its directory and :data:`SOCKET_VAR`."""
    import shutil
    import subprocess

    proc = _ZYGOTE.pop("proc", None)
    if proc is None or _ZYGOTE.get("pid") != os.getpid():
        return
    os.environ.pop(SOCKET_VAR, None)
    try:
        proc.stdin.close()
        proc.terminate()
        proc.wait(timeout=CLOSE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()
    proc.stdout.close()
    shutil.rmtree(_ZYGOTE.pop("dir"), ignore_errors=True)


def zygote_pid() -> int | None:
    """The pid of this process's zygote while it runs, else None."""
    proc = _ZYGOTE.get("proc")
    return proc.pid if proc is not None and proc.poll() is None else None


# -- the agent's side: a rank forked by the zygote --------------------------------------------------


class RankProcess:
    """A rank the zygote forked, as the lite agent sees it: ``pid``, ``returncode``, ``poll()``,
    ``wait(timeout)`` (seconds; raises ``subprocess.TimeoutExpired``), ``send_signal(sig)``,
    ``kill()``, as ``subprocess.Popen`` has them. The rank is the zygote's child: its end comes as the
    wait status the zygote reports on this connection. If the zygote goes away first, the rank's end
    is seen by its pid disappearing and its return code is 1 (its status is lost)."""

    def __init__(self, conn: socket.socket, pid: int, cmd: list[str]) -> None:
        self.conn, self.pid, self.args = conn, pid, cmd
        self.returncode: int | None = None
        self._buffer = b""

    def _take(self, timeout: float) -> None:
        """Read what the zygote said within ``timeout`` seconds (0: only what is there)."""
        if self.returncode is not None:
            return
        if self.conn is None:  # the zygote is gone: watch the pid
            if not os.path.exists(f"/proc/{self.pid}"):
                self.returncode = 1
            return
        ready, _, _ = select.select([self.conn], [], [], timeout)
        if not ready:
            return
        chunk = self.conn.recv(4096)
        if not chunk:
            self.conn.close()
            self.conn = None
            return self._take(0)
        self._buffer += chunk
        for line in self._buffer.split(b"\n")[:-1]:
            word, _, value = line.decode().partition(" ")
            if word == "status":
                self.returncode = os.waitstatus_to_exitcode(int(value))
                self.conn.close()
                self.conn = None

    def poll(self) -> int | None:
        """The return code (negative: the signal that ended it), or None while it runs."""
        self._take(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait up to ``timeout`` seconds (None: for ever) for the rank's end; its return code."""
        import subprocess

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._take(min(left, 0.05) if self.conn is None else min(left, 1.0))
            if self.conn is None and self.returncode is None:
                time.sleep(min(max(left, 0), 0.05))  # an orphaned rank: polls its pid
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the rank (only while it has not been seen to end, as Popen does)."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def start(cmd: list[str], env: dict[str, str], cwd: str | None = None) -> RankProcess | None:
    """Ask the zygote named by ``os.environ[SOCKET_VAR]`` for a rank running ``cmd``
    (``[python, "-u", "-m", MODULE, ...]`` or ``[python, "-u", SCRIPT, ...]``) with ``env`` and
    ``cwd`` (None: this process's) on this process's stdin/stdout/stderr; None when it cannot (the
    zygote off or unreachable, another interpreter, another command form): start a plain process."""
    path = os.environ.get(SOCKET_VAR)
    if not enabled() or not path or len(cmd) < 3 or cmd[1] != "-u" or cmd[2].startswith("-") and cmd[2] != "-m":
        return None
    request = {"python": cmd[0], "argv": cmd[2:], "env": dict(env), "cwd": os.path.abspath(cwd or os.getcwd())}
    payload = json.dumps(request).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(CONNECT_TIMEOUT_S)
        conn.connect(path)
        socket.send_fds(conn, [b"r"], [0, 1, 2])
        conn.sendall(struct.pack(">Q", len(payload)) + payload)
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = conn.recv(1)
            if not chunk:
                raise ConnectionError("the zygote closed the connection")
            answer += chunk
    except OSError as exc:
        conn.close()
        print(f"rank zygote unreachable ({exc}): a plain process", file=sys.stderr, flush=True)
        return None
    word, _, value = answer.decode().strip().partition(" ")
    if word != "pid":
        conn.close()
        return None
    conn.setblocking(True)
    conn.settimeout(None)
    return RankProcess(conn, int(value), cmd)


if __name__ == "__main__":
    serve(sys.argv[1])
