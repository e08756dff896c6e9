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
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pwd
import re
import shutil
import tarfile
import tempfile
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
