"""What a GPU-box job brings and how it is kept apart from the worker: archives, the trainer
snapshot, the requirements environment, the job's clean environment, its OS user and its container.

Kept free of torch and Django (the backend imports it on every submit). Nothing here runs a shell:
every command is an argument list, and no user text becomes an option of ours.

On disk, beside the run directories of ``<run_root>``::

    .trainers/<sha16>/      the trainer package a job runs (trainer_pkg/ from
                            cloud_adapters.packaging.build_archive, named by that archive's SHA-256),
                            written once, atomically (temporary directory + rename)
    .envs/<sha16>/          a virtualenv per SHA-256 of a requirements text (--system-site-packages,
                            so torch is the interpreter's); ``.trainboard-ready`` inside is written
                            last: without it the directory is an unfinished build
    .envs/<sha16>.lock      flock held while that environment is built
    .uids/<uid>             the job holding that uid of the pool (its name), while it holds it;
                            .uids/.lock is flocked while a uid is taken or given back

Isolation (docs/gpu-boxes.md "Isolation"): a worker running as root gives each job a uid (and a gid
of the same number) of its own from the operator's pool (``job_uids``, default :data:`JOB_UIDS_DEFAULT`),
taken atomically (:func:`allocate_job_user`) and given back when the job is over
(:func:`release_job_user`). Nothing of the installation is writable by it, and its run directory is
readable by it alone (:func:`prepare_isolated_run`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import io
import os
import pwd
import re
import shutil
import signal
import stat
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from cloud_adapters import packaging
from cloud_adapters.base import InvalidSpec, ProviderError
from cloud_adapters.packaging import Entry

ENV_READY_MARKER = ".trainboard-ready"
"""Written last, atomically, in a built environment: its presence means the environment is whole."""

ENV_ALLOWLIST = ("PATH", "LANG", "LC_ALL", "TZ", "TMPDIR", "CUDA_VISIBLE_DEVICES")
"""The worker's variables a job inherits (docs/user-code.md "GPU box: clean environment"); HOME,
USER and LOGNAME are the run user's, NCCL_* are inherited too, and so are the names the operator
lists in ``env_passthrough``."""
ENV_ALLOWED_PREFIXES = ("NCCL_",)

ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
USER_NAME_RE = re.compile(r"[a-z_][a-z0-9_.-]{0,31}\$?")  # useradd(8)'s portable names
# A Docker image reference: registry/repository[:tag][@digest]; never starting with "-", so that it
# cannot be read as an option of `docker run`.
IMAGE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}")

IMAGE_PYTHON = "python3"
"""The interpreter a job's image runs torchrun with (it must have torch)."""


# -- archives -------------------------------------------------------------------------------

def write_tree(entries: Iterable[Entry], dest: Path, what: str) -> None:
    """Write ``entries`` (``(relative path, contents, mode)``, regular files only: what
    :func:`cloud_adapters.packaging.code_files` returns) into the new directory ``dest``.

    Atomic: the files are written under a temporary sibling that is renamed to ``dest`` at the end,
    so ``dest`` is whole or absent. A ``dest`` that exists already is left as it is (the same content,
    put there by another submit). Directories get mode 0755. Raises :class:`ProviderError` when the
    disk refuses.
    """
    if dest.exists():
        return
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        for name, data, mode in entries:
            target = tmp.joinpath(*name.split("/"))
            target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
        os.chmod(tmp, 0o755)  # mkdtemp made it 0700
        try:
            os.rename(tmp, dest)
        except OSError:
            if not dest.is_dir():
                raise
            # Another submit wrote the same content first: keep theirs.
    except OSError as exc:
        raise ProviderError(f"cannot write {what} into {dest}: {exc}") from exc
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def requirements_problems(text: str) -> list[str]:
    """What a GPU box refuses in a requirements text (:func:`cloud_adapters.packaging.
    requirement_lines`): pip options (``-r``, ``-e``, ``--index-url``, ``--find-links``, a
    requirement's ``--hash``...), whose say is the operator's (``pip_args``). One message per line."""
    return [
        f"requirements.txt line {line[:80]!r}: pip options are the GPU box operator's "
        f"(TRAINBOARD_GPUBOX_PIP_ARGS: index, find-links, constraints); list package requirements only."
        for line in packaging.requirement_lines(text)
        if line.startswith("-") or re.search(r"\s--?[a-z]", line.split(";", 1)[0])
    ]


# -- the trainer snapshot --------------------------------------------------------------------

def trainer_snapshot(run_root: Path, source_root: Path) -> tuple[str, Path]:
    """``(sha256, directory)`` of the trainer package in ``source_root/trainer_pkg``, written to
    ``<run_root>/.trainers/<sha256[:16]>/`` unless it is there already.

    The SHA-256 is :func:`cloud_adapters.packaging.build_archive`'s, the same one a cloud job's
    trainer archive is named by. A job runs from this directory, so a later change to the worker's
    checkout never changes the code of a job already submitted. Raises :class:`ProviderError` when
    the disk refuses, :class:`InvalidSpec` when ``source_root`` holds no trainer package.
    """
    try:
        archive = packaging.build_archive(source_root)
    except FileNotFoundError as exc:
        raise InvalidSpec(f"trainer package {str(source_root)!r}: {exc}.") from None
    parent = run_root / ".trainers"
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ProviderError(f"cannot create {parent}: {exc}") from exc
    dest = parent / archive.sha256[:16]
    if not dest.exists():
        with tarfile.open(fileobj=io.BytesIO(archive.data), mode="r:gz") as tar:  # ours: regular files
            entries = [(m.name, tar.extractfile(m).read(), m.mode) for m in tar.getmembers()]  # type: ignore[union-attr]
        write_tree(entries, dest, f"trainer snapshot {archive.sha256[:16]}")
    return archive.sha256, dest


# -- the requirements environment ------------------------------------------------------------

def requirements_sha256(text: str, image: str = "") -> str:
    """The SHA-256 that names a requirements environment: of the text, and of the image when the
    environment is built inside one (an environment is bound to its interpreter)."""
    key = text if not image else f"{text}\0image={image}"
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


# Run by the box's interpreter with the new environment's directory as its argument: a .pth file in
# that environment's site-packages lists the interpreter's own. `venv --system-site-packages` alone
# reaches only the base installation's, not those of an interpreter that is itself a virtualenv
# (a box whose torch lives in one).
_LINK_SITE_PACKAGES = """\
import glob, os, sys, sysconfig
paths = [p for p in dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")) if os.path.isdir(p)]
(site,) = glob.glob(os.path.join(sys.argv[1], "lib", "python*", "site-packages"))
with open(os.path.join(site, "_trainboard_interpreter.pth"), "w") as fh:
    fh.write("".join(p + "\\n" for p in paths))
"""


def environment_steps(env_dir: Path, python: str, requirements_file: Path, pip_args: Sequence[str]) -> list[list[str]]:
    """The commands that build a requirements environment at ``env_dir`` with ``python``: a
    virtualenv that sees ``python``'s own packages (torch is not reinstalled, and pip counts it as
    installed), then pip installing ``requirements_file`` with the operator's ``pip_args`` (e.g.
    ``--no-index --find-links /wheels``)."""
    return [
        [python, "-m", "venv", "--system-site-packages", str(env_dir)],
        [python, "-c", _LINK_SITE_PACKAGES, str(env_dir)],
        [str(env_dir / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
         "--no-input", *pip_args, "-r", str(requirements_file)],
    ]


# -- who runs the job, with which environment -------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RunUser:
    """The OS user a job's processes run as."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary groups (getgrouplist)
    home: str

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def run_user(name: str) -> RunUser:
    """The OS user ``name`` a job is to run as; :class:`InvalidSpec` when there is none or this
    worker cannot switch to it (it is not root)."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise InvalidSpec(f"run_as: there is no OS user {name!r} on this GPU box; create it (useradd --system "
                          f"{name}) or leave TRAINBOARD_GPUBOX_RUN_AS blank to run jobs as the worker's user.") from None
    if os.geteuid() != 0 and entry.pw_uid != os.geteuid():
        raise InvalidSpec(f"run_as: running jobs as {name!r} needs the gpubox worker to run as root (it runs as uid "
                          f"{os.geteuid()}); start the worker as root or leave TRAINBOARD_GPUBOX_RUN_AS blank.")
    return RunUser(name=name, uid=entry.pw_uid, gid=entry.pw_gid,
                   groups=tuple(os.getgrouplist(name, entry.pw_gid)), home=entry.pw_dir)


def worker_user() -> RunUser:
    """The worker's own user (what a job runs as when ``run_as`` is blank)."""
    uid = os.geteuid()
    try:
        entry = pwd.getpwuid(uid)
        name, home = entry.pw_name, entry.pw_dir
    except KeyError:  # a uid without a passwd entry (a container's arbitrary user)
        name, home = str(uid), os.environ.get("HOME", "/")
    return RunUser(name=name, uid=uid, gid=os.getegid(), groups=tuple(os.getgroups()), home=home)


def image_patterns(text: str) -> list[str]:
    """The entries of the operator's ``allowed_images`` (commas or spaces between them): each an exact
    image reference, or a prefix ending in ``*`` (``ghcr.io/acme/*``; ``*`` alone allows every image)."""
    return [n for n in re.split(r"[\s,]+", text or "") if n]


def image_pattern_problems(text: str) -> list[str]:
    """Why entries of ``allowed_images`` are not image references or ``prefix*`` patterns; [] if none."""
    bad = [p for p in image_patterns(text)
           if "*" in p[:-1] or not (p == "*" or IMAGE_RE.fullmatch(p[:-1] if p.endswith("*") else p))]
    return [f"allowed_images: {', '.join(map(repr, bad[:5]))} "
            f"{'is not an image reference or a prefix ending in *' if len(bad) == 1 else 'are not image references or prefixes ending in *'} "
            f"(e.g. ghcr.io/acme/train:1.2 or ghcr.io/acme/*)."] if bad else []


def image_allowed(image: str, allowed: str) -> bool:
    """Whether ``image`` is one the operator's ``allowed_images`` lists: equal to an exact entry, or
    starting with a ``prefix*`` entry's prefix. An empty list allows no image."""
    for pattern in image_patterns(allowed):
        if (image.startswith(pattern[:-1]) if pattern.endswith("*") else image == pattern):
            return True
    return False


def passthrough_names(text: str) -> list[str]:
    """The variable names in the operator's ``env_passthrough`` (commas or spaces between them)."""
    return [n for n in re.split(r"[\s,]+", text or "") if n]


def base_environment(worker_env: Mapping[str, str], user: RunUser, passthrough: Iterable[str] = ()) -> dict[str, str]:
    """The environment every process of a job starts from: :data:`ENV_ALLOWLIST`, ``NCCL_*`` and
    the ``passthrough`` names of ``worker_env``, with HOME/USER/LOGNAME of ``user``. Nothing else
    of the worker's (database and broker URLs, Django's secret key, cloud credentials) is in it."""
    allowed = set(ENV_ALLOWLIST) | set(passthrough)
    env = {k: v for k, v in worker_env.items()
           if k in allowed or k.startswith(ENV_ALLOWED_PREFIXES)}
    env.setdefault("PATH", os.defpath)
    env.update(HOME=user.home, USER=user.name, LOGNAME=user.name)
    return env


def env_problems(env: Mapping[str, str], field: str, reserved: Iterable[str]) -> list[str]:
    """What is wrong with a job's ``env`` or ``secret_env`` (``field``): names that are not
    variable names, that belong to Trainboard or torchrun (``reserved``) or configure the Docker
    client (``DOCKER_*``), values that are not text. Secret values are never quoted."""
    reserved = set(reserved)
    problems = []
    for name, value in env.items():
        if not isinstance(name, str) or not ENV_NAME_RE.fullmatch(name):
            problems.append(f"{field}: {str(name)[:40]!r} is not an environment variable name "
                            f"(letters, digits and '_', not starting with a digit).")
        elif name in reserved or name.startswith("DOCKER_"):
            problems.append(f"{field}: {name} is set by Trainboard for every job; remove it (the user code's "
                            f"directory is already on sys.path).")
        elif not isinstance(value, str) or "\0" in value:
            shown = "its value" if field == "secret_env" else repr(value)[:40]
            problems.append(f"{field}: {name}: {shown} must be text without NUL characters.")
    return problems


# -- the container ---------------------------------------------------------------------------

def docker_problem() -> str | None:
    """Why this box cannot run a job in an image (no ``docker`` on PATH, or its daemon does not
    answer ``docker info``), or None when it can."""
    import subprocess

    docker = shutil.which("docker")
    if docker is None:
        return ("this GPU box has no Docker (docker not found on PATH); leave the image empty to run on the host")
    try:
        done = subprocess.run([docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                              text=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"this GPU box's Docker does not answer (docker info: {exc}); start its daemon or leave the image empty"
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        return f"this GPU box's Docker does not answer (docker info: {why[0][:200]}); start its daemon or leave the image empty"
    return None


def container_command(image: str, command: Sequence[str], *, name: str, user: RunUser, workdir: str,
                      mounts: Iterable[tuple[str, bool]], env_names: Iterable[str],
                      gpus: bool | Sequence[int]) -> list[str]:
    """``docker run`` of ``command`` in ``image``, as the job's processes run on the host: the
    host's network and IPC namespace (torchrun's rendezvous, NCCL's shared memory), as ``user``'s
    uid:gid and supplementary groups, each ``(path, read_only)`` of ``mounts`` at the same path
    inside, every GPU when ``gpus`` is True or the GPUs of those indices when it lists them (``--gpus
    '"device=0,2"'``: the quotes keep Docker's CSV parser from splitting the list; Docker's "GPU access"
    documentation), and the variables ``env_names`` passed by name only (``--env
    NAME``: the values come from the Docker client's environment, never the command line).
    ``--name`` lets the supervisor remove a container its client left behind."""
    argv = ["docker", "run", "--rm", "--name", name, "--network", "host", "--ipc", "host",
            "--user", f"{user.uid}:{user.gid}", "--workdir", workdir]
    # The user's other groups too: GPU device nodes often belong to `video` or `render`.
    for gid in sorted(set(user.groups) - {user.gid}):
        argv += ["--group-add", str(gid)]
    if gpus is True:
        argv += ["--gpus", "all"]
    elif gpus:
        argv += ["--gpus", f'"device={",".join(str(int(i)) for i in gpus)}"']
    seen = set()
    for path, read_only in mounts:
        if path in seen:
            continue
        seen.add(path)
        argv += ["--volume", f"{path}:{path}:{'ro' if read_only else 'rw'}"]
    for env_name in sorted(set(env_names)):
        argv += ["--env", env_name]
    return argv + [image, *command]


# -- isolation: a uid per job ------------------------------------------------------------------

JOB_UIDS_DEFAULT = "20000-20999"
"""The pool of uids a root worker gives jobs when the operator names none (``job_uids``)."""
JOB_UIDS_OFF = "none"
"""``job_uids`` that turns the pool off: every job runs as the worker's user (or ``run_as``)."""
MAX_POOL = 1_000_000
SHARED_UID_NOTICE = "jobs on this box run as the dashboard's own user: for a single user only"
"""What the backend page, the job form and the demo say of a box that cannot isolate its jobs."""

_UID_RANGE = re.compile(r"(\d{1,10})(?:-(\d{1,10}))?")


def parse_uid_pool(text: str) -> list[int]:
    """The uids of a ``job_uids`` setting: ranges ``A-B`` and single uids separated by commas or
    spaces (``20000-20999``, ``30000-30099,31000``). Raises :class:`InvalidSpec` naming what is not a
    range, a uid below 1000 (system accounts, root), or a pool of more than 1,000,000 uids."""
    uids: list[int] = []
    for part in re.split(r"[\s,]+", text.strip()):
        if not part:
            continue
        match = _UID_RANGE.fullmatch(part)
        if not match:
            raise InvalidSpec(f"job_uids: {part[:40]!r} is not a uid or a range of uids (e.g. 20000-20999).")
        low = int(match.group(1))
        high = int(match.group(2) or low)
        if low > high:
            raise InvalidSpec(f"job_uids: {part!r} ends below where it starts.")
        if low < 1000 or high >= 2**31 - 1:
            raise InvalidSpec(f"job_uids: {part!r}: a job's uid must be 1000 to 2147483646 (below 1000 are the "
                              f"system's accounts and root).")
        if len(uids) + high - low + 1 > MAX_POOL:
            raise InvalidSpec(f"job_uids: at most {MAX_POOL:,} uids.")
        uids.extend(range(low, high + 1))
    if not uids:
        raise InvalidSpec(f"job_uids: no uid given; name a range (e.g. {JOB_UIDS_DEFAULT}) or {JOB_UIDS_OFF!r}.")
    return list(dict.fromkeys(uids))


def unreachable(path: str | os.PathLike, *, execute: bool = False) -> str | None:
    """Why a process of an unrelated uid (not the owner, in none of the groups of ``path``'s
    directories) cannot reach ``path``: the first directory on the way (symbolic links resolved)
    without the others' search (x) bit, or the file itself without the others' x bit when
    ``execute``; None when it can. Read from the mode bits only: nothing is started."""
    real = Path(os.path.realpath(path))
    for directory in [*reversed(real.parents), real] if not execute else [*reversed(real.parents)]:
        try:
            mode = directory.stat().st_mode
        except OSError as exc:
            return f"{directory}: {exc.strerror or exc}"
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return f"{directory} is mode {stat.S_IMODE(mode):04o}, which other users may not enter"
    if execute:
        try:
            mode = real.stat().st_mode
        except OSError as exc:
            return f"{real}: {exc.strerror or exc}"
        if not mode & stat.S_IXOTH:
            return f"{real} is mode {stat.S_IMODE(mode):04o}, which other users may not run"
    return None


def isolation_problem(*, run_as: str, job_uids: str, run_root: Path, python: str) -> str | None:
    """Why this box cannot give each job a uid of its own, or None when it can: ``run_as`` is set
    (every job is that one user), the pool is off, this process is not root (it cannot switch uids),
    or a job's uid could not reach the interpreter or the run root (a directory on the way that other
    users may not enter: make it ``o+x``)."""
    if run_as:
        return f"every job runs as the one OS user {run_as!r} (TRAINBOARD_GPUBOX_RUN_AS)"
    if job_uids.strip().lower() == JOB_UIDS_OFF:
        return f"the operator turned the uid pool off (TRAINBOARD_GPUBOX_JOB_UIDS={JOB_UIDS_OFF})"
    if os.geteuid() != 0:
        return (f"the gpubox worker runs as uid {os.geteuid()}, not root, so it cannot start a job as another "
                f"user (TRAINBOARD_GPUBOX_JOB_UIDS needs a root worker)")
    problem = unreachable(python, execute=True)
    if problem:
        return f"a job's uid could not run the interpreter {python}: {problem}"
    problem = unreachable(run_root.parent if not run_root.exists() else run_root)
    if problem:
        return f"a job's uid could not reach the run root {run_root}: {problem}"
    return None


def _uid_in_use(uid: int) -> bool:
    """Whether ``uid`` belongs to an account (``/etc/passwd``) or to a running process."""
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        pass
    return bool(processes_of(uid))


def processes_of(uid: int) -> list[int]:
    """Pids of the live processes whose real or effective uid is ``uid`` (from ``/proc/<pid>/status``)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as fh:
                status = fh.read()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith(b"State:") and line.split()[1:2] in ([b"Z"], [b"X"]):
                break
            if line.startswith(b"Uid:"):
                real, effective = (int(v) for v in line.split()[1:3])
                if uid in (real, effective):
                    found.append(int(entry.name))
                break
    return found


def kill_processes_of(uid: int, rounds: int = 50) -> None:
    """SIGKILL every process of ``uid`` until none is left (a process forking while we look is caught
    by the next round); a job's uid is its own, so this reaches exactly what the job left behind,
    whatever environment it gave itself."""
    for _ in range(rounds):
        pids = processes_of(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


ABANDONED_AFTER_S = 600.0  # a run directory this old without a supervisor was abandoned mid-submit


def _uid_dir(run_root: Path) -> Path:
    path = run_root / ".uids"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def seal_shared_runs(run_root: Path) -> int:
    """Take "other"'s permissions off every run directory under ``run_root`` that this process owns
    and leaves open to other users: the runs made while the box could not isolate (or made before it
    knew how: 0755 by default), whose checkpoints and logs a job with a uid of its own must not read.
    Runs once, at the first isolated start: a run root already 0711 was sealed then (its shared runs
    since are made 0700). Isolated runs are root:<gid> 0750 and keep their group. Returns how many
    directories it changed. Reads one directory listing, never a run's tree: what the run holds is
    out of reach once its directory is."""
    try:
        if stat.S_IMODE(run_root.stat().st_mode) == 0o711:
            return 0
        entries = list(os.scandir(run_root))
    except FileNotFoundError:
        return 0
    sealed = 0
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
            continue  # .trainers, .envs, .uids: shared read-only on purpose
        info = entry.stat(follow_symlinks=False)
        if info.st_uid == os.geteuid() and info.st_mode & 0o007:
            os.chmod(entry.path, stat.S_IMODE(info.st_mode) & ~0o007)
            sealed += 1
    return sealed


def allocate_job_user(run_root: Path, job_name: str, pool: Sequence[int]) -> RunUser:
    """Take a uid of ``pool`` for the job ``job_name``: the one it already holds (a retried submit),
    else the first that no job holds, no account owns and no process runs as. A marker
    ``<run_root>/.uids/<uid>`` naming the job is made under ``.uids/.lock`` (``flock``), so two
    workers never hand out one uid. A marker whose job is over (its ``exit.json`` written, its
    supervisor gone, or its run directory removed) is given back first (:func:`release_job_user`).
    Raises a transient :class:`ProviderError` when every uid is held."""
    from cloud_adapters.gpubox import _proc

    uids = _uid_dir(run_root)
    lock = os.open(uids / ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        held = {}
        for entry in os.scandir(uids):
            if entry.name.isdigit():
                try:
                    held[int(entry.name)] = Path(entry.path).read_text().strip()
                except OSError:
                    continue
        for uid, holder in held.items():
            if holder == job_name:
                return job_user(uid, run_root / job_name)
        for uid in pool:
            if uid in held:
                holder = held[uid]
                holder_dir = run_root / holder
                sup = _proc.read_json(holder_dir / "supervisor.json")
                over = (not holder_dir.is_dir() or (holder_dir / "exit.json").exists()
                        or (sup is not None and not _proc.is_alive(sup.get("pid"), sup.get("start_ticks")))
                        # a submit that died before starting the supervisor (describe: "lost")
                        or (sup is None and time.time() - holder_dir.stat().st_mtime > ABANDONED_AFTER_S))
                if not over:
                    continue
                _release(run_root, uid, holder_dir if holder_dir.is_dir() else None)
            elif _uid_in_use(uid):
                continue
            fd = os.open(uids / str(uid), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(job_name + "\n")
            return job_user(uid, run_root / job_name)
    finally:
        os.close(lock)
    raise ProviderError(f"every uid of this GPU box's pool ({len(pool)}) is held by a running job; the job starts "
                        f"when one ends (TRAINBOARD_GPUBOX_JOB_UIDS sets the pool)", transient=True)


def job_user(uid: int, run_dir: Path) -> RunUser:
    """The user a job with its own ``uid`` runs as: gid of the same number, no other groups, HOME in
    its run directory, named ``tb-job-<uid>`` (no account exists for it)."""
    return RunUser(name=f"tb-job-{uid}", uid=uid, gid=uid, groups=(), home=str(run_dir / "home"))


JOB_DIRS = ("code", "output", "home", "tmp")
"""The parts of an isolated run directory its job owns (and writes); everything else is root's."""


def prepare_isolated_run(run_dir: Path, user: RunUser) -> None:
    """Give the job its part of ``run_dir``: the directory itself ``root:<job gid>`` mode 0750 (the
    job may enter and read the run's records, another uid may not, and only root may add, rename or
    remove a file there: ``exit.json``, ``supervisor.json`` and ``cancel_requested`` stay the
    supervisor's word), and :data:`JOB_DIRS` the job's own, mode 0700."""
    from cloud_adapters.gpubox._proc import chown_tree

    for name in JOB_DIRS:
        path = run_dir / name
        path.mkdir(mode=0o700, exist_ok=True)
        chown_tree(path, user.uid, user.gid)
        os.chmod(path, 0o700)
    os.chown(run_dir, 0, user.gid)
    os.chmod(run_dir, 0o750)


def lend_dir(run_root: Path, path: Path, user: RunUser) -> None:
    """Lend ``path``, a directory in another run directory of ``run_root`` (a lost attempt's
    checkpoints that this attempt resumes from and writes to), to ``user``: the tree becomes its, and
    each directory on the way below ``run_root`` ``root:<its gid>`` with group read and search, so it
    may reach it. Raises ProviderError when a directory on the way is a symbolic link (the other run's
    job made it: it could point anywhere)."""
    from cloud_adapters.gpubox._proc import chown_tree

    relative = path.relative_to(run_root)
    here = run_root
    for part in relative.parts:
        here = here / part
        if here.is_symlink():
            raise ProviderError(f"cannot resume from {path}: {here} is a symbolic link")
        if here != path:
            os.chown(here, 0, user.gid)
            os.chmod(here, stat.S_IMODE(here.stat().st_mode) | 0o050)
    chown_tree(path, user.uid, user.gid)


def _give_back(run_root: Path, path: Path) -> None:
    """Undo :func:`lend_dir`: the tree and the directories on its way below ``run_root`` root's again."""
    from cloud_adapters.gpubox._proc import chown_tree

    if not path.is_relative_to(run_root) or path.is_symlink() or not path.is_dir():
        return
    chown_tree(path, 0, 0)
    here = run_root
    for part in path.relative_to(run_root).parts[:-1]:
        here = here / part
        if here.is_symlink():
            return
        os.chown(here, 0, 0)


ISOLATION_RECORD = "isolation.json"
"""In an isolated run directory, root's: ``{"uid": N, "lent": [directories lent to it]}``, what giving
the uid back undoes, whoever does it (the supervisor, or a later start reclaiming a dead run's uid)."""


def _release(run_root: Path, uid: int, run_dir: Path | None) -> None:
    """Kill what runs as ``uid``, hand ``run_dir``'s files back to root (the next job given this uid
    must not read them), and remove the uid's marker (the caller holds ``.uids/.lock``)."""
    from cloud_adapters.gpubox._proc import chown_tree

    kill_processes_of(uid)
    if run_dir is not None and run_dir.is_dir() and not run_dir.is_symlink():
        for name in (*JOB_DIRS, "input"):  # input/: a fine-tune's source, readable by the job's gid
            path = run_dir / name
            if path.is_dir() and not path.is_symlink():
                chown_tree(path, 0, 0)
        try:
            if run_dir.stat().st_gid == uid:
                os.chown(run_dir, 0, 0)
        except OSError:
            pass
        from cloud_adapters.gpubox._proc import read_json

        for path in (read_json(run_dir / ISOLATION_RECORD) or {}).get("lent") or ():
            _give_back(run_root, Path(str(path)))
    try:
        os.unlink(run_root / ".uids" / str(uid))
    except FileNotFoundError:
        pass


def release_job_user(run_root: Path, uid: int, run_dir: Path) -> None:
    """Give ``uid`` back once its job is over (the supervisor's last act): every process still running
    as it is killed, the run's files and the directories lent to it (:func:`lend_dir`, listed in its
    :data:`ISOLATION_RECORD`) become root's, its marker goes (under ``.uids/.lock``)."""
    uids = _uid_dir(run_root)
    lock = os.open(uids / ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = uids / str(uid)
        try:
            holder = marker.read_text().strip()
        except FileNotFoundError:
            holder = None
        if holder not in (None, run_dir.name):
            return  # already reclaimed for another job: not ours to touch
        _release(run_root, uid, run_dir)
    finally:
        os.close(lock)
