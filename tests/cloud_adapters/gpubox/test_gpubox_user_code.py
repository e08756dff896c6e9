"""The GPU box runs a user's code safely: real supervisor + torchrun (2 CPU ranks, gloo) running a
code archive built here: the user's script (``code.script``, run by the launcher in every rank) or
the user's model (its entry point, called by the trainer on every rank).

What is shown: the worker's own variables (database and broker URLs, Django's secret key, the
encryption key, cloud credentials, planted in this process's environment) never reach a rank, while
the job's ``env`` and ``secret_env`` do and the secret values are written nowhere by us; the
archive's requirements are installed from a local wheel into a virtualenv per requirements text,
built once and reused; a bad requirement fails the job with pip's message; the job runs a snapshot
of the trainer, not whatever the trainer directory holds later; ``run_as`` starts the job as another
OS user; an image runs the job under ``docker run`` (the argv, with a recording ``docker`` on PATH:
a real Docker run is left to the infrastructure of issue 17), and a box without Docker refuses.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import pwd
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
import zipfile
from pathlib import Path

import pytest
from polling import wait_for

from cloud_adapters.base import CodeBundle, InvalidSpec, JobHandle, JobSpec, JobState
from cloud_adapters.gpubox import GpuBoxBackend
from cloud_adapters.gpubox import _proc, _usercode
from cloud_adapters.gpubox.backend import RESERVED_ENV
from cloud_adapters.gpubox._usercode import RunUser, container_command
from cloud_adapters.packaging import build_archive
from user_code_kit import fake_docker

REPO_ROOT = Path(__file__).resolve().parents[3]

# What the dashboard's worker holds in its environment (webapp/settings.py and the clouds' SDKs read
# these): none of it may reach a job.
PLANTED = {
    "DATABASE_URL": "postgres://planted-db-user:planted-db-password@127.0.0.1:5432/trainboard",
    "REDIS_URL": "redis://:planted-redis-password@127.0.0.1:6379/0",
    "DJANGO_SECRET_KEY": "planted-django-secret-key",
    "TRAINBOARD_ENCRYPTION_KEY": "planted-fernet-key-0123456789abcdef0123456789a=",
    "AWS_ACCESS_KEY_ID": "AKIAPLANTEDKEY",
    "AWS_SECRET_ACCESS_KEY": "planted-aws-secret-access-key",
    "GOOGLE_APPLICATION_CREDENTIALS": "/planted/service-account.json",
    "AZURE_CLIENT_SECRET": "planted-azure-client-secret",
}
SET_IN_EVERY_RANK = RESERVED_ENV | {"OMP_NUM_THREADS", "PYTHONUNBUFFERED"}
SECRET = "s3cr3t-token-" + uuid.uuid4().hex  # the job's own secret: reaches it, written nowhere by us

# The user's code: what every rank sees, recorded in code.dir as env-rank<RANK>.json by the model's
# entry point (envmodel:build), which the trainer calls on every rank in the rank's own process, or
# by the user's script (train.py, code.script), which the launcher runs in every rank.
ENV_RECORD = '''\
import json, os, sys, time

def write():
    go = os.environ.get("TB_TEST_GO")
    while go and not os.path.exists(go):  # the test edits the trainer's source before letting us go
        time.sleep(0.05)
    record = {"environ": dict(os.environ), "uid": os.getuid(), "executable": sys.executable, "cwd": os.getcwd(),
              "argv": sys.argv[1:]}
    try:
        import tbhello
        record["tbhello"] = tbhello.GREETING
    except ImportError:
        record["tbhello"] = None
    import trainer_pkg
    record["trainer_pkg"] = trainer_pkg.__file__
    try:
        from trainer_pkg import _snapshot_probe
        record["probe"] = _snapshot_probe.VALUE
    except ImportError:
        record["probe"] = None
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, f"env-rank{os.environ['RANK']}.json"), "w") as fh:
        json.dump(record, fh)
'''
ENV_MODEL = '''\
import math

from torch import nn

import envrecord


def build(num_classes, input_shape, **params):
    envrecord.write()
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))
'''
ENV_SCRIPT = '''\
import envrecord

envrecord.write()
'''
USER_CODE = {"envrecord.py": ENV_RECORD, "envmodel.py": ENV_MODEL, "train.py": ENV_SCRIPT}
USER_CONFIG = {"model": {"arch": "custom", "entry_point": "envmodel:build"}, "train": {"epochs": 1},
               "parallel": {"procs_per_node": 2}}
SCRIPT_CONFIG = {"code": {"script": "train.py", "args": ["--epochs", "1"]}, "parallel": {"procs_per_node": 2}}


# ---------------------------------------------------------------------------------------------
# Helpers: archives, wheels, waiting
# ---------------------------------------------------------------------------------------------


def code_bundle(store: Path, files: dict[str, str], requirements: str = "") -> CodeBundle:
    """A deterministic .tar.gz of ``files`` (plus requirements.txt) stored under ``store`` by hash."""
    if requirements:
        files = {**files, "requirements.txt": requirements}
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            data = files[name].encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return _store(store, gzip.compress(raw.getvalue(), mtime=0), requirements)


def _store(store: Path, data: bytes, requirements: str = "") -> CodeBundle:
    store.mkdir(parents=True, exist_ok=True)
    sha = hashlib.sha256(data).hexdigest()
    path = store / f"{sha}.tar.gz"
    path.write_bytes(data)
    return CodeBundle(sha256=sha, path=str(path), requirements=requirements)


def build_wheel(dest: Path, name: str = "tbhello", version: str = "0.1") -> Path:
    """A pure-Python wheel of package ``name`` (``GREETING``), written by hand: no network, no build."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f'GREETING = "hello from {name} {version}"\n',
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: trainboard-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join(record + [f"{dist}/RECORD,,"]) + "\n"
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


def wait_terminal(backend: GpuBoxBackend, handle: JobHandle, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while not (status := backend.describe(handle)).state.is_terminal:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; last status {status}; log:\n{_log(handle)}")
        time.sleep(0.2)
    return status


def _log(handle: JobHandle) -> str:
    run_dir = Path(handle.provider_job_id)
    parts = []
    for name in ("train.log", "supervisor.log"):
        try:
            parts.append(f"--- {name}\n" + "\n".join((run_dir / name).read_text().splitlines()[-40:]))
        except FileNotFoundError:
            parts.append(f"--- {name}: none")
    return "\n".join(parts)


def rank_records(run_dir: Path) -> list[dict]:
    return [json.loads((run_dir / "code" / f"env-rank{r}.json").read_text()) for r in (0, 1)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _environ(pid: int) -> bytes:
    try:
        return b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def files_holding(root: Path, needle: str, skip: tuple[str, ...] = ()) -> list[str]:
    """Files under ``root`` whose bytes contain ``needle`` (names in ``skip`` left out)."""
    found = []
    for path in root.rglob("*"):
        if path.is_file() and path.name not in skip and needle.encode() in path.read_bytes():
            found.append(str(path.relative_to(root)))
    return found


@pytest.fixture
def store(tmp_path) -> Path:
    return tmp_path / "code-store"


@pytest.fixture
def wheels(tmp_path) -> Path:
    build_wheel(tmp_path / "wheels")
    return tmp_path / "wheels"


@pytest.fixture
def backend(tmp_path, wheels):
    return GpuBoxBackend({"run_root": str(tmp_path / "runs"), "max_procs_per_node": 2, "grace_period_s": 8,
                          "pip_args": f"--no-index --find-links {wheels}",
                          "allowed_images": "ghcr.io/example/* pytorch/pytorch:2.5.1"})


def user_spec(name: str, bundle: CodeBundle, config: dict = USER_CONFIG, **kw) -> JobSpec:
    return JobSpec(job_name=name, config=json.loads(json.dumps(config)), procs_per_node=2, code=bundle, **kw)


# ---------------------------------------------------------------------------------------------
# The clean environment
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["model", "script"])
def test_user_code_sees_the_jobs_variables_and_none_of_the_workers(backend, store, monkeypatch, kind):
    for name, value in PLANTED.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")  # an allowlisted family: the box's NCCL tuning
    bundle = code_bundle(store, USER_CODE)
    handle = backend.submit(user_spec(f"env-clean-{kind}", bundle, USER_CONFIG if kind == "model" else SCRIPT_CONFIG,
                                      env={"TB_USER_FLAG": "visible-flag"}, secret_env={"TB_API_TOKEN": SECRET}))
    status = wait_terminal(backend, handle)
    assert status.state == JobState.SUCCEEDED, (status, _log(handle))
    run_dir = Path(handle.provider_job_id)

    config = json.loads((run_dir / "job.json").read_text())
    expected = {"dir": str(run_dir / "code"), "sha256": bundle.sha256}
    assert config["code"] == (expected if kind == "model" else {**SCRIPT_CONFIG["code"], **expected})
    if kind == "script":  # the launcher runs it in code.dir, which it names, with its arguments
        assert [r["argv"] for r in rank_records(run_dir)] == [["--epochs", "1"]] * 2
        assert [r["cwd"] for r in rank_records(run_dir)] == [str(run_dir / "code")] * 2
        assert [r["environ"]["TRAINBOARD_CODE_DIR"] for r in rank_records(run_dir)] == [str(run_dir / "code")] * 2
    for rank, record in enumerate(rank_records(run_dir)):
        environ = record["environ"]
        assert environ["RANK"] == str(rank) and environ["WORLD_SIZE"] == "2"
        assert not set(PLANTED) & set(environ), f"rank {rank} got the worker's {set(PLANTED) & set(environ)}"
        assert not [k for k, v in environ.items() if v in PLANTED.values()]
        assert environ["TB_USER_FLAG"] == "visible-flag" and environ["TB_API_TOKEN"] == SECRET
        assert environ["NCCL_DEBUG"] == "WARN" and environ["PATH"] == os.environ["PATH"]
        assert environ["HOME"] == pwd.getpwuid(os.geteuid()).pw_dir
        # Every other variable the worker has and the rank shares is on the allowlist, or one that
        # torchrun, the launcher or scikit-learn's import (KMP_* for its OpenMP runtime) set in every
        # process, whose value is then the worker's too when this process imported it.
        shared = {k for k, v in environ.items() if os.environ.get(k) == v
                  and k not in SET_IN_EVERY_RANK and not k.startswith(("TORCHELASTIC_", "TORCH_", "KMP_"))}
        assert shared <= set(_usercode.ENV_ALLOWLIST) | {"HOME", "USER", "LOGNAME", "NCCL_DEBUG"}, shared
    # The secret was never written by Trainboard: only the user's own files hold it.
    assert files_holding(run_dir, SECRET, skip=("env-rank0.json", "env-rank1.json")) == []
    assert files_holding(Path(backend.config["run_root"]) / ".trainers", SECRET) == []


def test_job_variables_that_are_trainboards_or_not_names_are_refused_all_at_once(backend, store):
    bundle = code_bundle(store, USER_CODE)
    with pytest.raises(InvalidSpec) as err:
        backend.submit(user_spec("env-bad", bundle, env={"PYTHONPATH": "/x", "1BAD": "v", "DOCKER_HOST": "tcp://x"},
                                   secret_env={"TRAINBOARD_GPUBOX_RUN": SECRET}))
    message = str(err.value)
    for part in ("env: PYTHONPATH is set by Trainboard", "env: '1BAD' is not an environment variable name",
                 "env: DOCKER_HOST is set by Trainboard", "secret_env: TRAINBOARD_GPUBOX_RUN is set by Trainboard"):
        assert part in message, message
    assert SECRET not in message
    assert not (Path(backend.config["run_root"]) / "env-bad").exists()


# ---------------------------------------------------------------------------------------------
# The code archive
# ---------------------------------------------------------------------------------------------


def test_an_archive_whose_bytes_changed_is_refused_before_anything_is_written(backend, store):
    bundle = code_bundle(store, USER_CODE)
    Path(bundle.path).write_bytes(Path(bundle.path).read_bytes() + b"\0")
    actual = hashlib.sha256(Path(bundle.path).read_bytes()).hexdigest()
    with pytest.raises(InvalidSpec) as err:
        backend.submit(user_spec("sha-mismatch", bundle))
    assert str(err.value) == (f"code archive {bundle.path}: its SHA-256 is {actual[:16]}…, the job records "
                              f"{bundle.sha256[:16]}…; the stored archive changed, upload the code again.")
    assert not (Path(backend.config["run_root"]) / "sha-mismatch").exists()
    missing = CodeBundle(sha256="0" * 64, path=str(store / "nowhere.tar.gz"))
    with pytest.raises(InvalidSpec, match="nowhere.tar.gz: cannot read it .*upload the code again"):
        backend.submit(user_spec("sha-missing", missing))


def _tar_with(member: tarfile.TarInfo, data: bytes = b"") -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        tar.addfile(member, io.BytesIO(data) if member.isreg() else None)
    return gzip.compress(raw.getvalue(), mtime=0)


@pytest.mark.parametrize("kind, message", [
    ("dotdot", "member '../escape.py': the path leaves the archive"),
    ("absolute", "member '/etc/escape.py': the path leaves the archive"),
    ("symlink", "member 'link': not a regular file"),
    ("fifo", "member 'pipe': not a regular file"),
    ("ours", "member 'trainer_pkg/__init__.py': the name is Trainboard's"),
])
def test_unsafe_members_are_refused(backend, store, kind, message):
    if kind == "dotdot":
        member = tarfile.TarInfo("../escape.py")
    elif kind == "absolute":
        member = tarfile.TarInfo("/etc/escape.py")
    elif kind == "ours":  # it would shadow the trainer snapshot on the user code's sys.path
        member = tarfile.TarInfo("trainer_pkg/__init__.py")
    elif kind == "symlink":
        member = tarfile.TarInfo("link")
        member.type, member.linkname = tarfile.SYMTYPE, "/etc/passwd"
    else:
        member = tarfile.TarInfo("pipe")
        member.type = tarfile.FIFOTYPE
    data = b"print('x')\n" if member.isreg() else b""
    member.size = len(data)
    bundle = _store(store, _tar_with(member, data))
    with pytest.raises(InvalidSpec, match=message):
        backend.submit(user_spec(f"unsafe-{kind}", bundle))
    assert not (Path(backend.config["run_root"]) / f"unsafe-{kind}").exists()


# ---------------------------------------------------------------------------------------------
# Requirements: a virtualenv per requirements text, built once by the job, reused
# ---------------------------------------------------------------------------------------------


def test_requirements_install_from_the_operators_wheels_once_and_are_reused(backend, store):
    bundle = code_bundle(store, USER_CODE, requirements="tbhello==0.1\n")
    started = time.monotonic()
    first = backend.submit(user_spec("reqs-1", bundle, SCRIPT_CONFIG))
    assert time.monotonic() - started < 10  # submit does not build the environment
    assert not (Path(first.provider_job_id) / "train.log").exists() or "ready" not in \
        (Path(first.provider_job_id) / "train.log").read_text()
    status = wait_terminal(backend, first)
    assert status.state == JobState.SUCCEEDED, (status, _log(first))

    env_dir = Path(backend.config["run_root"]) / ".envs" / _usercode.requirements_sha256("tbhello==0.1\n")[:16]
    marker = env_dir / _usercode.ENV_READY_MARKER
    for record in rank_records(Path(first.provider_job_id)):
        assert record["tbhello"] == "hello from tbhello 0.1"
        assert record["executable"] == str(env_dir / "bin" / "python")
    log = (Path(first.provider_job_id) / "train.log").read_text()
    assert f"[environment] building environment {env_dir}" in log and f"environment {env_dir} ready" in log
    before = marker.stat()

    second = backend.submit(user_spec("reqs-2", bundle, SCRIPT_CONFIG))
    status = wait_terminal(backend, second)
    assert status.state == JobState.SUCCEEDED, (status, _log(second))
    log = (Path(second.provider_job_id) / "train.log").read_text()
    assert f"[environment] reusing environment {env_dir}" in log and "building environment" not in log
    after = marker.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert [r["tbhello"] for r in rank_records(Path(second.provider_job_id))] == ["hello from tbhello 0.1"] * 2


def test_a_requirement_pip_cannot_install_fails_the_job_with_pips_message(backend, store):
    bundle = code_bundle(store, USER_CODE, requirements="tbnosuchpkg==9.9\n")
    handle = backend.submit(user_spec("reqs-bad", bundle))
    status = wait_terminal(backend, handle)
    assert status.state == JobState.FAILED and status.raw_state == "requirements failed", status
    assert status.failure_reason.startswith("installing the job's requirements failed (exit code 1): ERROR: ")
    assert "No matching distribution found for tbnosuchpkg==9.9" in status.failure_reason
    env_dir = Path(backend.config["run_root"]) / ".envs" / _usercode.requirements_sha256("tbnosuchpkg==9.9\n")[:16]
    assert not env_dir.exists()  # no marker, nothing half-built left for the next job
    assert not (Path(handle.provider_job_id) / "torchrun.json").exists()  # torchrun never started


def test_pip_options_in_requirements_are_refused_naming_the_line(backend, store):
    bundle = code_bundle(store, USER_CODE,
                         requirements="tbhello==0.1\n--index-url http://127.0.0.1:9/simple\n-r \\\n/etc/passwd\n")
    with pytest.raises(InvalidSpec) as err:
        backend.submit(user_spec("reqs-options", bundle))
    message = str(err.value)
    assert "requirements.txt line '--index-url http://127.0.0.1:9/simple': pip options are the GPU box " \
           "operator's (TRAINBOARD_GPUBOX_PIP_ARGS" in message
    assert "requirements.txt line '-r /etc/passwd': pip options" in message
    assert "'tbhello==0.1'" not in message


def test_pip_args_that_do_not_split_are_refused_in_the_settings(tmp_path):
    with pytest.raises(InvalidSpec) as err:
        GpuBoxBackend({"run_root": str(tmp_path), "pip_args": "--find-links '/wheels"})
    assert err.value.errors["pip_args"] == [
        "pip options: cannot be split into pip's options (No closing quotation); quote each option as in a "
        "shell line, e.g. --no-index --find-links /wheels."]


# ---------------------------------------------------------------------------------------------
# The trainer snapshot
# ---------------------------------------------------------------------------------------------


def test_a_job_runs_the_trainer_snapshot_taken_at_submit(backend, store, tmp_path):
    source = tmp_path / "trainer-src"
    shutil.copytree(REPO_ROOT / "trainer_pkg", source / "trainer_pkg",
                    ignore=shutil.ignore_patterns("__pycache__"))
    probe = source / "trainer_pkg" / "_snapshot_probe.py"
    probe.write_text('VALUE = "as submitted"\n')
    go = tmp_path / "go"
    bundle = code_bundle(store, USER_CODE)
    handle = backend.submit(user_spec("snapshot", bundle, trainer_package_uri=str(source),
                                        env={"TB_TEST_GO": str(go)}, secret_env={"TB_API_TOKEN": SECRET}))
    probe.write_text('VALUE = "changed after submit"\n')  # the ranks wait for `go`: they import after this
    # Meanwhile the supervisor runs as the worker: the job's variables are in neither its environment
    # nor any command line of the job's processes (only the ranks' environment holds them).
    run_dir = Path(handle.provider_job_id)
    supervisor = json.loads((run_dir / "supervisor.json").read_text())["pid"]
    assert SECRET.encode() not in Path(f"/proc/{supervisor}/environ").read_bytes()
    assert b"TB_TEST_GO" not in Path(f"/proc/{supervisor}/environ").read_bytes()
    wait_for(lambda: len([p for p in _proc.job_processes(str(run_dir)) if b"\0LOCAL_RANK=" in _environ(p)]) >= 2,
             timeout=60, what="both ranks to start (the user's code waits for the test)")
    for pid in _proc.job_processes(str(run_dir)) + [supervisor]:
        assert SECRET.encode() not in _cmdline(pid)
    go.touch()
    status = wait_terminal(backend, handle)
    assert status.state == JobState.SUCCEEDED, (status, _log(handle))

    sha = build_archive(source).sha256  # of the edited tree: a different snapshot
    trainer = json.loads((run_dir / "trainer.json").read_text())
    snapshot = Path(trainer["dir"])
    assert snapshot.parent == Path(backend.config["run_root"]) / ".trainers"
    assert snapshot.name == trainer["sha256"][:16] and trainer["sha256"] != sha
    assert trainer["source"] == str(source)
    for record in rank_records(run_dir):
        assert record["probe"] == "as submitted"
        assert record["trainer_pkg"] == str(snapshot / "trainer_pkg" / "__init__.py")
        assert str(snapshot) in record["environ"]["PYTHONPATH"].split(os.pathsep)
        assert not {str(REPO_ROOT), str(source)} & set(record["environ"]["PYTHONPATH"].split(os.pathsep))
    assert f"trainer snapshot {trainer['sha256'][:16]} at {snapshot}" in (run_dir / "supervisor.log").read_text()
    # A second job from the same tree shares the snapshot; the edited tree gets its own.
    again = backend.submit(JobSpec(job_name="snapshot-2", config={"parallel": {"procs_per_node": 2}},
                                   procs_per_node=2, trainer_package_uri=str(source)))
    assert json.loads((Path(again.provider_job_id) / "trainer.json").read_text())["sha256"] == sha
    backend.cancel(again)
    wait_terminal(backend, again, timeout=60)


# ---------------------------------------------------------------------------------------------
# run_as
# ---------------------------------------------------------------------------------------------

RECORDER = '''#!/usr/bin/python3
# Stands in for the box's interpreter: this machine's has torch but lives under /root (mode 0700),
# where no other user may reach it. Records who runs torchrun's command, and how.
import json, os, sys
record = {"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()), "argv": sys.argv,
          "environ": dict(os.environ), "cwd": os.getcwd()}
out = os.path.join(os.getcwd(), "output", "whoami.json")
with open(out, "w") as fh:
    json.dump(record, fh)
'''


def test_run_as_starts_the_job_as_that_user(store, monkeypatch):
    for name, value in PLANTED.items():
        monkeypatch.setenv(name, value)
    user = f"tbjob{uuid.uuid4().hex[:8]}"
    # Outside pytest's temporary directory, whose parents only root may enter.
    root = Path(tempfile.mkdtemp(prefix="tb-run-as-"))
    os.chmod(root, 0o755)
    recorder = root / "python"
    recorder.write_text(RECORDER)
    recorder.chmod(0o755)
    config = {"run_root": str(root / "runs"), "max_procs_per_node": 2, "python": str(recorder), "run_as": user,
              "allowed_images": "ghcr.io/example/train:1.2"}
    try:
        with pytest.raises(InvalidSpec, match=f"run_as: there is no OS user '{user}' on this GPU box; create it"):
            GpuBoxBackend(config).submit(user_spec("run-as-missing", code_bundle(store, USER_CODE)))
        if os.geteuid() != 0:
            with pytest.raises(InvalidSpec, match="needs the gpubox worker to run as root"):
                GpuBoxBackend({**config, "run_as": "root"}).submit(
                    user_spec("run-as-root", code_bundle(store, USER_CODE)))
            return
        subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent", user], check=True)
        entry = pwd.getpwnam(user)
        backend = GpuBoxBackend(config)
        handle = backend.submit(user_spec("run-as", code_bundle(store, USER_CODE),
                                            secret_env={"TB_API_TOKEN": SECRET}))
        status = wait_terminal(backend, handle, timeout=60)
        assert status.state == JobState.SUCCEEDED, (status, _log(handle))
        run_dir = Path(handle.provider_job_id)
        record = json.loads((run_dir / "output" / "whoami.json").read_text())
        assert (record["uid"], record["gid"]) == (entry.pw_uid, entry.pw_gid)
        assert record["groups"] == sorted(os.getgrouplist(user, entry.pw_gid))
        assert record["argv"][1:3] == ["-m", "torch.distributed.run"]
        environ = record["environ"]
        assert (environ["HOME"], environ["USER"], environ["LOGNAME"]) == ("/nonexistent", user, user)
        assert environ["TB_API_TOKEN"] == SECRET and not set(PLANTED) & set(environ)
        # The job's outputs and its code directory are the user's; the supervisor's records are not.
        assert (run_dir / "output").stat().st_uid == entry.pw_uid
        assert (run_dir / "code" / "envmodel.py").stat().st_uid == entry.pw_uid
        assert (run_dir / "exit.json").stat().st_uid == 0 and run_dir.stat().st_uid == 0

        # In an image the container runs as the user; the Docker client, which needs the daemon's
        # socket, runs as the worker.
        calls = fake_docker(root / "bin", root / "docker-calls.jsonl", monkeypatch)
        handle = backend.submit(user_spec("run-as-image", code_bundle(store, USER_CODE),
                                            image="ghcr.io/example/train:1.2"))
        status = wait_terminal(backend, handle, timeout=60)
        assert status.state == JobState.SUCCEEDED, (status, _log(handle))
        job, cleanup = [json.loads(line) for line in calls.read_text().splitlines()]
        assert job["argv"][job["argv"].index("--user") + 1] == f"{entry.pw_uid}:{entry.pw_gid}"
        assert job["uid"] == cleanup["uid"] == os.geteuid()
    finally:
        subprocess.run(["userdel", user], stderr=subprocess.DEVNULL)
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The image
# ---------------------------------------------------------------------------------------------

def test_an_image_runs_the_job_under_docker_run(backend, store, tmp_path, monkeypatch):
    calls = fake_docker(tmp_path / "bin", tmp_path / "docker-calls.jsonl", monkeypatch)
    bundle = code_bundle(store, USER_CODE, requirements="tbhello==0.1\n")
    image = "ghcr.io/example/train:1.2"
    handle = backend.submit(user_spec("in-image", bundle, image=image, secret_env={"TB_API_TOKEN": SECRET}))
    status = wait_terminal(backend, handle, timeout=60)
    assert status.state == JobState.SUCCEEDED, (status, _log(handle))

    run_dir = Path(handle.provider_job_id)
    run_root = Path(backend.config["run_root"])
    trainer = Path(json.loads((run_dir / "trainer.json").read_text())["dir"])
    env_dir = run_root / ".envs" / _usercode.requirements_sha256("tbhello==0.1\n", image)[:16]
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    me = f"{os.geteuid()}:{os.getegid()}"
    venv, link, pip, job, cleanup = (r["argv"] for r in recorded)
    # The environment is built inside the image, as the job's user, with the operator's wheels mounted.
    assert venv[venv.index(image):] == ["ghcr.io/example/train:1.2", "python3", "-m", "venv",
                                        "--system-site-packages", str(env_dir)]
    assert link[link.index(image) + 1:link.index(image) + 3] == ["python3", "-c"] and link[-1] == str(env_dir)
    assert pip[pip.index(image) + 1:] == [str(env_dir / "bin" / "python"), "-m", "pip", "install",
                                          "--disable-pip-version-check", "--no-input", "--no-index", "--find-links",
                                          backend.config["pip_args"].split()[-1], "-r", str(run_dir / "requirements.txt")]
    assert f"{backend.config['pip_args'].split()[-1]}:{backend.config['pip_args'].split()[-1]}:ro" in pip
    assert (env_dir / _usercode.ENV_READY_MARKER).exists()
    # The job: host network and IPC, the run directory, snapshot and environment at their own paths.
    assert job[:job.index(image)] == [
        "run", "--rm", "--name", "tb-in-image", "--network", "host", "--ipc", "host", "--user", me,
        "--workdir", str(run_dir),
        "--volume", f"{run_dir}:{run_dir}:rw", "--volume", f"{trainer}:{trainer}:ro",
        "--volume", f"{env_dir}:{env_dir}:ro",
        *[x for name in sorted(recorded[3]["env"]) for x in ("--env", name)],
    ]
    assert job[job.index(image) + 1:] == [
        str(env_dir / "bin" / "python"), "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--standalone", "-m", "trainer_pkg.launch", "--config", str(run_dir / "job.json")]
    assert "--gpus" not in job  # this box has no GPU
    # Variables by name only: the value is in the Docker client's environment, not its command line.
    assert recorded[3]["env"]["TB_API_TOKEN"] == SECRET and SECRET not in " ".join(job)
    assert recorded[3]["env"]["TRAINBOARD_GPUBOX_RUN"] == str(run_dir)
    assert recorded[3]["env"]["PYTHONPATH"].split(os.pathsep) == [str(trainer), str(run_dir / "code")]
    assert {"PATH", "HOME", "TMPDIR"}.isdisjoint(recorded[3]["env"])
    assert cleanup == ["rm", "--force", "tb-in-image", "tb-in-image-env0", "tb-in-image-env1", "tb-in-image-env2"]
    assert files_holding(run_dir, SECRET) == []


def test_container_command_passes_every_gpu_when_the_box_has_them():
    user = RunUser(name="jobs", uid=1500, gid=1500, groups=(1500, 44), home="/home/jobs")  # 44: video
    argv = container_command("pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime", ["python3", "-c", "pass"],
                             name="tb-j", user=user, workdir="/runs/j",
                             mounts=[("/runs/j", False), ("/data", True), ("/runs/j", False)],
                             env_names=["B", "A", "B"], gpus=True)
    assert argv == ["docker", "run", "--rm", "--name", "tb-j", "--network", "host", "--ipc", "host",
                    "--user", "1500:1500", "--workdir", "/runs/j", "--group-add", "44", "--gpus", "all",
                    "--volume", "/runs/j:/runs/j:rw", "--volume", "/data:/data:ro", "--env", "A", "--env", "B",
                    "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime", "python3", "-c", "pass"]


def test_a_box_without_docker_refuses_an_image(backend, store, tmp_path, monkeypatch):
    empty = tmp_path / "no-docker-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(InvalidSpec) as err:
        backend.submit(user_spec("no-docker", code_bundle(store, USER_CODE), image="pytorch/pytorch:2.5.1"))
    assert str(err.value) == ("this GPU box has no Docker (docker not found on PATH); leave the image empty to run "
                              "on the host")
    assert not (Path(backend.config["run_root"]) / "no-docker").exists()
    with pytest.raises(InvalidSpec, match="image: '--privileged' is not a container image reference"):
        backend.validate(user_spec("bad-image", code_bundle(store, USER_CODE), image="--privileged"))


def test_only_the_images_the_operator_allows_run(backend, store, tmp_path):
    """A container runs with the box's GPUs, host network and the run directory: which images may run
    is the operator's list (allowed_images), never the job's choice; blank allows none."""
    bundle = code_bundle(store, USER_CODE)
    for image in ("ghcr.io/example/train:1.2", "ghcr.io/example/other@sha256:" + "a" * 64, "pytorch/pytorch:2.5.1"):
        backend.validate(user_spec("allowed", bundle, image=image))  # raises nothing
    for image in ("ghcr.io/examples/train:1.2", "pytorch/pytorch:2.5.1-cuda", "docker.io/attacker/miner:latest"):
        with pytest.raises(InvalidSpec) as err:
            backend.validate(user_spec("refused", bundle, image=image))
        assert str(err.value) == (
            f"image: this GPU box runs only the images its operator allows, and {image!r} is not one of them "
            "(ghcr.io/example/*, pytorch/pytorch:2.5.1); use an allowed image or leave the image empty to run on "
            "the host (the operator sets TRAINBOARD_GPUBOX_ALLOWED_IMAGES).")
    closed = GpuBoxBackend({"run_root": str(tmp_path / "closed")})
    with pytest.raises(InvalidSpec, match=r"is not among them \(it allows none\)"):
        closed.validate(user_spec("none-allowed", bundle, image="ghcr.io/example/train:1.2"))
    closed.validate(user_spec("on-the-host", bundle))  # no image: the host, as always
    with pytest.raises(InvalidSpec, match=r"Allowed images: 'ghcr.io/\*/train' is not an image reference or a "
                                          r"prefix ending in \*"):
        GpuBoxBackend({"run_root": str(tmp_path / "bad"), "allowed_images": "ghcr.io/*/train, ok/image:1"})
