"""A GPU box isolates its jobs (docs/gpu-boxes.md "Isolation", DESIGN.md §8): with a root worker each
job runs as a uid of its own from the operator's pool, so a hostile user's script cannot reach another
user's running job nor the installation. Real processes: a runner, two supervisors, torchrun, the
users' scripts; the installation's ``var/`` is laid out by the code the dashboard's settings run
(:mod:`webapp.private_files`), the run root under it as in ``make demo``.

The interpreter must be one a job's uid can run: this machine's lives under ``/root`` (mode 0700), so the
``reachable_interpreter`` fixture lets other users through the directories on its way (``o+x``, not
``o+r``: they are entered, not listed) for the test's length and puts the modes back after: what the box
operator does once (docs/gpu-boxes.md). pytest's own temporary directories sit under a 0700 directory,
so the installation is made in a directory of its own under /tmp instead.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from cloud_adapters.base import InvalidSpec, JobSpec, JobState
from cloud_adapters.gpubox import GpuBoxBackend, _proc, _usercode, runner
from polling import wait_for
from user_code_kit import DEP_NAME, DEP_VERSION, build_wheel, code_bundle, fake_docker
from webapp import private_files

ROOT = Path(__file__).resolve().parents[3]
GATE_S = 120  # the victim waits at most this long for the test's go (the test gives it in seconds)

# The second user's job: writes a checkpoint and its model, reports, then waits for the test's go, so
# that it is running while the hostile job tries everything against it.
VICTIM = textwrap.dedent('''\
    import os, time
    from trainer_pkg import report
    with open(os.path.join(report.checkpoint_dir(), "epoch-1.pt"), "wb") as fh:
        fh.write(b"victim checkpoint " * 512)
    with open(os.path.join(report.model_dir(), "model.pt"), "wb") as fh:
        fh.write(b"victim weights " * 512)
    report.log(step=1, loss=0.5)
    with open(os.path.join(report.model_dir(), "ready"), "w") as fh:
        fh.write(str(os.getpid()))
    deadline = time.monotonic() + float(os.environ["TB_GATE_S"])
    while not os.path.exists(os.environ["TB_GO"]):
        if time.monotonic() > deadline:
            raise SystemExit("the test never said go")
        time.sleep(0.05)
    ''')

# The hostile user's job: every attempt is recorded with its outcome in its own output directory.
HOSTILE = textwrap.dedent('''\
    import json, os, signal, socket
    from trainer_pkg import report
    t = json.loads(os.environ["TB_TARGETS"])
    attempts = {}

    def attempt(name, action):
        try:
            action()
            attempts[name] = "allowed"
        except OSError as exc:
            attempts[name] = type(exc).__name__ + ": " + (exc.strerror or str(exc))

    def read(path):
        with open(path, "rb") as fh:
            fh.read(1)

    def write(path, mode="ab"):
        with open(path, mode) as fh:
            fh.write(b"pwned")

    def connect(path):
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.close()

    attempt("read the victim's checkpoint", lambda: read(t["victim_checkpoint"]))
    attempt("read the victim's model", lambda: read(t["victim_model"]))
    attempt("list the victim's run directory", lambda: os.listdir(t["victim_dir"]))
    attempt("read the victim's log", lambda: read(os.path.join(t["victim_dir"], "train.log")))
    attempt("write into the victim's run directory", lambda: write(os.path.join(t["victim_dir"], "planted")))
    attempt("write into the victim's output", lambda: write(os.path.join(t["victim_dir"], "output", "planted")))
    attempt("overwrite the victim's model", lambda: write(t["victim_model"], "wb"))
    attempt("kill the victim's rank", lambda: os.kill(t["victim_rank"], signal.SIGKILL))
    attempt("read the victim rank's environment", lambda: read(f"/proc/{t['victim_rank']}/environ"))
    attempt("stop the victim's supervisor", lambda: os.kill(t["victim_supervisor"], signal.SIGTERM))
    attempt("signal the runner", lambda: os.kill(t["runner"], 0))
    attempt("signal the worker", lambda: os.kill(t["worker"], 0))
    attempt("read the worker's environment", lambda: read(f"/proc/{t['worker']}/environ"))
    attempt("read the encryption key", lambda: read(t["encryption_key"]))
    attempt("read the database", lambda: read(t["database"]))
    attempt("read the secret key", lambda: read(t["secret_key"]))
    attempt("list the installation's var", lambda: os.listdir(t["var"]))
    attempt("read the code store", lambda: read(t["victim_archive"]))
    attempt("use the runner's socket", lambda: connect(t["runner_socket"]))
    attempt("list the run root", lambda: os.listdir(t["run_root"]))
    attempt("write into the run root", lambda: write(os.path.join(t["run_root"], "planted")))
    attempt("change the shared trainer snapshot", lambda: write(t["trainer_init"]))
    attempt("forge its own exit.json", lambda: write(os.path.join(t["own_dir"], "exit.json"), "wb"))
    attempt("read a run made before the box could isolate", lambda: read(t["old_run_model"]))
    # What it may do: its own files (the refusals above are not wrong paths).
    own = {"job.json": open(os.path.join(t["own_dir"], "job.json")).read()[:1],
           "home": os.environ.get("HOME"), "tmp": os.environ.get("TMPDIR"), "uid": os.getuid(), "gid": os.getgid(),
           "groups": os.getgroups()}
    with open(os.path.join(report.model_dir(), "attempts.json"), "w") as fh:
        json.dump({"attempts": attempts, "own": own}, fh)
    ''')


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def reachable_interpreter():
    """Let other uids run this interpreter: ``o+x`` on each directory on its way that lacks it (this
    machine's sits under /root, 0700), put back afterwards."""
    changed = []
    paths = {Path(os.path.realpath(sys.executable)), Path(sys.prefix), Path(sys.base_prefix)}
    for path in paths:
        for directory in [*reversed(path.parents), path]:
            mode = directory.stat().st_mode
            if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH and directory not in [d for d, _ in changed]:
                changed.append((directory, stat.S_IMODE(mode)))
                os.chmod(directory, stat.S_IMODE(mode) | stat.S_IXOTH)
    try:
        yield
    finally:
        for directory, mode in reversed(changed):
            os.chmod(directory, mode)


@pytest.fixture
def installation():
    """An installation's ``var/`` as webapp/settings.py lays it out, in a 0755 directory of its own:
    ``(var, run root, code store)``."""
    top = Path(tempfile.mkdtemp(prefix="tb-isolation-"))
    os.chmod(top, 0o755)
    var = private_files.traversable_dir(top / "var")
    private_files.private_file(var / "encryption_key", lambda: "planted-fernet-key=")
    private_files.private_file(var / "secret_key", lambda: "planted-django-secret")
    private_files.private_file(var / "trainboard.sqlite3", lambda: "SQLite format 3\0planted credentials")
    store = private_files.private_dir(var / "code")
    try:
        yield var, var / "runs", store
    finally:
        for run_dir in (var / "runs").glob("*"):  # nothing of a failed test keeps running
            _proc.signal_job(str(run_dir), signal.SIGKILL)
        shutil.rmtree(top, ignore_errors=True)


def _start_runner(socket_path: Path, run_root: Path) -> subprocess.Popen:
    run_root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "cloud_adapters.gpubox.runner", "--socket", str(socket_path),
                             "--run-root", str(run_root)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_for(lambda: socket_path.exists(), timeout=20, what="the runner's socket")
    return proc


def _ended(backend, handle, timeout: float = 180):
    return wait_for(lambda: (s := backend.describe(handle)).state.is_terminal and s, timeout=timeout,
                    what=f"{handle.job_name} to end")


def _pool() -> str:
    """Ten uids no account or process of this machine has (a range of its own per run)."""
    while True:
        low = random.randrange(40000, 60000, 10)
        if not any(_usercode._uid_in_use(u) for u in range(low, low + 10)):
            return f"{low}-{low + 9}"


def test_a_hostile_script_cannot_reach_another_job_or_the_installation(reachable_interpreter, installation,
                                                                        monkeypatch):
    var, run_root, store = installation
    socket_path = var / "runner" / "runner.sock"
    private_files.private_dir(socket_path.parent)
    proc = _start_runner(socket_path, run_root)
    monkeypatch.setenv(runner.SOCKET_VAR, str(socket_path))
    monkeypatch.setenv("TRAINBOARD_ENCRYPTION_KEY", "planted-in-the-worker")
    # A run from before the box could isolate (its worker not root, or an older Trainboard): made
    # 0755/0644 in a 0755 run root, where its jobs all ran as one user.
    old_model = run_root / "tb-job-1-before" / "output" / "model.pt"
    old_model.parent.mkdir(parents=True)
    old_model.write_bytes(b"an older run's weights")
    for path, mode in ((run_root, 0o755), (old_model.parent.parent, 0o755), (old_model.parent, 0o755),
                       (old_model, 0o644)):
        os.chmod(path, mode)
    try:
        pool = _pool()
        backend = GpuBoxBackend({"run_root": str(run_root), "max_procs_per_node": 1, "grace_period_s": 5,
                                 "job_uids": pool})
        assert backend.isolation.isolated, backend.isolation.text
        go = var.parent / "go"  # a 0755 directory: the victim's uid sees the test's go
        victim_code = code_bundle(store, {"victim.py": VICTIM})
        victim = backend.submit(JobSpec(
            job_name="victim", procs_per_node=1, code=victim_code,
            config={"code": {"script": "victim.py"}, "parallel": {"procs_per_node": 1}},
            env={"TB_GO": str(go), "TB_GATE_S": str(GATE_S)}, secret_env={"TB_API_TOKEN": "victim-secret"}))
        victim_dir = Path(victim.provider_job_id)
        ready = victim_dir / "output" / "ready"
        wait_for(ready.exists, timeout=120, what="the victim to write its files and wait")
        files = [victim_dir / "output" / "model.pt", victim_dir / "output" / "checkpoints" / "epoch-1.pt",
                 victim_dir / "code" / "victim.py"]
        before = {p: _sha256(p) for p in files}
        victim_rank = int(ready.read_text())
        victim_uid = Path(f"/proc/{victim_rank}").stat().st_uid
        supervisor = json.loads((victim_dir / "supervisor.json").read_text())["pid"]
        trainer = Path(json.loads((victim_dir / "trainer.json").read_text())["dir"])

        targets = {
            "victim_dir": str(victim_dir), "victim_model": str(files[0]), "victim_checkpoint": str(files[1]),
            "victim_rank": victim_rank, "victim_supervisor": supervisor, "runner": proc.pid,
            "worker": os.getpid(), "encryption_key": str(var / "encryption_key"),
            "database": str(var / "trainboard.sqlite3"), "secret_key": str(var / "secret_key"), "var": str(var),
            "victim_archive": victim_code.path, "runner_socket": str(socket_path), "run_root": str(run_root),
            "trainer_init": str(trainer / "trainer_pkg" / "__init__.py"), "own_dir": str(run_root / "hostile"),
            "old_run_model": str(old_model),
        }
        for key in ("old_run_model", "victim_checkpoint", "encryption_key", "database", "secret_key", "victim_archive",
                    "runner_socket", "trainer_init"):
            assert Path(targets[key]).exists(), key  # every target is there: a refusal is the kernel's
        hostile = backend.submit(JobSpec(
            job_name="hostile", procs_per_node=1, code=code_bundle(store, {"hostile.py": HOSTILE}),
            config={"code": {"script": "hostile.py"}, "parallel": {"procs_per_node": 1}},
            env={"TB_TARGETS": json.dumps(targets)}))
        status = _ended(backend, hostile)
        assert status.state == JobState.SUCCEEDED, (status, (run_root / "hostile" / "train.log").read_text()[-3000:])
        record = json.loads((run_root / "hostile" / "output" / "attempts.json").read_text())
        allowed = {name: outcome for name, outcome in record["attempts"].items()
                   if not outcome.startswith("PermissionError")}
        assert allowed == {}, allowed
        assert len(record["attempts"]) == 24
        own = record["own"]
        hostile_uid = own["uid"]
        assert hostile_uid != victim_uid and {hostile_uid, victim_uid} <= set(_usercode.parse_uid_pool(pool))
        assert (own["gid"], own["groups"]) == (hostile_uid, [])
        assert (own["home"], own["tmp"]) == (str(run_root / "hostile" / "home"), str(run_root / "hostile" / "tmp"))

        # The victim ran on, untouched, and ends SUCCEEDED with its files as they were.
        assert backend.describe(victim).state == JobState.RUNNING
        go.touch()
        status = _ended(backend, victim)
        assert status.state == JobState.SUCCEEDED, (status, (victim_dir / "train.log").read_text()[-3000:])
        assert {p: _sha256(p) for p in files} == before
        assert not (victim_dir / "planted").exists() and not (victim_dir / "output" / "planted").exists()
        assert proc.poll() is None  # the runner too
        # Over: the uids went back to the pool and every file is root's again (the next job given the
        # uid reads nothing of these), no process runs as either uid.
        assert sorted(p.name for p in (run_root / ".uids").iterdir()) == [".lock"]
        for run_dir in (victim_dir, run_root / "hostile"):
            owners = {p.stat().st_uid for p in [run_dir, *run_dir.rglob("*")]}
            assert owners == {0}, (run_dir, owners)
        assert _usercode.processes_of(victim_uid) == _usercode.processes_of(hostile_uid) == []
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


def test_an_isolated_jobs_container_runs_as_its_uid_and_mounts_only_its_own(reachable_interpreter, installation,
                                                                            monkeypatch):
    var, run_root, store = installation
    calls = fake_docker(var.parent / "bin", var.parent / "docker-calls.jsonl", monkeypatch)
    backend = GpuBoxBackend({"run_root": str(run_root), "max_procs_per_node": 1, "job_uids": _pool(),
                             "allowed_images": "ghcr.io/example/*"})
    # A fine-tune's source: a model.pt in another job's run directory, which this job's uid may not enter.
    source = run_root / "source-job" / "output" / "model.pt"
    source.parent.mkdir(parents=True)
    os.chmod(source.parent.parent, 0o700)
    source.write_bytes(b"source weights")
    handle = backend.submit(JobSpec(
        job_name="in-image", procs_per_node=1, image="ghcr.io/example/train:1.2",
        code=code_bundle(store, {"train.py": "print('hi')\n"}),
        config={"code": {"script": "train.py"}, "train": {"init_from": str(source)}, "parallel": {"procs_per_node": 1}}))
    status = _ended(backend, handle, timeout=60)
    assert status.state == JobState.SUCCEEDED, status
    run_dir = Path(handle.provider_job_id)
    job, _cleanup = [json.loads(line)["argv"] for line in calls.read_text().splitlines()]
    uid = int(job[job.index("--user") + 1].split(":")[0])
    assert job[job.index("--user") + 1] == f"{uid}:{uid}" and uid in _usercode.parse_uid_pool(backend.config["job_uids"])
    assert "--group-add" not in job
    trainer = json.loads((run_dir / "trainer.json").read_text())["dir"]
    copy = run_dir / "input" / "model.pt"
    assert [job[i + 1] for i, a in enumerate(job) if a == "--volume"] == [
        f"{run_dir}:{run_dir}:rw", f"{trainer}:{trainer}:ro", f"{copy}:{copy}:ro"]
    assert json.loads((run_dir / "job.json").read_text())["train"]["init_from"] == str(copy)
    assert copy.read_bytes() == b"source weights" and (copy.stat().st_uid, copy.stat().st_mode & 0o777) == (0, 0o640)
    assert sorted(p.name for p in (run_root / ".uids").iterdir()) == [".lock"]
    assert {p.stat().st_gid for p in [run_dir, *run_dir.rglob("*")]} == {0}  # the next holder of the gid reads none


def test_an_isolated_job_builds_its_requirements_as_its_uid_for_root_to_keep(reachable_interpreter, installation):
    var, run_root, store = installation
    wheels = build_wheel(var.parent / "wheels")  # the operator's wheel directory, readable by every uid
    backend = GpuBoxBackend({"run_root": str(run_root), "max_procs_per_node": 1, "job_uids": _pool(),
                             "pip_args": f"--no-index --find-links {wheels}"})
    script = f"import {DEP_NAME}, os\nopen(os.path.join(os.environ['TRAINBOARD_MODEL_DIR'], 'dep'), 'w').write({DEP_NAME}.__version__)\n"
    handle = backend.submit(JobSpec(
        job_name="with-reqs", procs_per_node=1,
        code=code_bundle(store, {"train.py": script, "requirements.txt": f"{DEP_NAME}=={DEP_VERSION}\n"}),
        config={"code": {"script": "train.py"}, "parallel": {"procs_per_node": 1}}))
    status = _ended(backend, handle)
    run_dir = Path(handle.provider_job_id)
    assert status.state == JobState.SUCCEEDED, (status, (run_dir / "train.log").read_text()[-3000:])
    assert (run_dir / "output" / "dep").read_text() == DEP_VERSION
    env_dir = run_root / ".envs" / _usercode.requirements_sha256(f"{DEP_NAME}=={DEP_VERSION}\n")[:16]
    assert {p.stat().st_uid for p in [env_dir, *env_dir.rglob("*")]} == {0}  # no later job may change it


RESUMER = textwrap.dedent('''\
    import os
    from trainer_pkg import report
    path = os.path.join(report.checkpoint_dir(), "epoch.txt")
    epoch = int(open(path).read()) + 1 if os.path.exists(path) else 1
    with open(path, "w") as fh:
        fh.write(str(epoch))
    ''')


def test_a_resumed_attempt_of_another_uid_writes_the_lost_attempts_checkpoints(reachable_interpreter, installation):
    var, run_root, store = installation
    backend = GpuBoxBackend({"run_root": str(run_root), "max_procs_per_node": 1, "job_uids": _pool()})
    code = code_bundle(store, {"resume.py": RESUMER})
    config = {"code": {"script": "resume.py"}, "parallel": {"procs_per_node": 1}}
    first = backend.submit(JobSpec(job_name="attempt-1", procs_per_node=1, code=code, config=config))
    assert _ended(backend, first).state == JobState.SUCCEEDED
    checkpoints = Path(backend.checkpoint_uri(first))
    assert (checkpoints / "epoch.txt").read_text() == "1"
    second = backend.submit(JobSpec(job_name="attempt-2", procs_per_node=1, code=code, config=config,
                                    checkpoint_uri=str(checkpoints)))
    status = _ended(backend, second)
    assert status.state == JobState.SUCCEEDED, (status, (run_root / "attempt-2" / "train.log").read_text()[-2000:])
    assert (checkpoints / "epoch.txt").read_text() == "2"  # read the lost attempt's, wrote on from it
    attempt_1 = run_root / "attempt-1"
    assert {(p.stat().st_uid, p.stat().st_gid) for p in [attempt_1, *attempt_1.rglob("*")]} == {(0, 0)}  # given back


def test_a_uid_whose_job_is_over_is_reclaimed_and_a_held_one_is_not(tmp_path):
    run_root = tmp_path / "runs"
    run_root.mkdir()
    pool = _usercode.parse_uid_pool(_pool())[:2]
    first = _usercode.allocate_job_user(run_root, "a", pool)
    assert (first.uid, first.gid, first.groups, first.home) == (pool[0], pool[0], (), str(run_root / "a" / "home"))
    assert _usercode.allocate_job_user(run_root, "a", pool) == first  # a retried submit keeps its uid
    (run_root / "a").mkdir()
    (run_root / "a" / "supervisor.json").write_text(json.dumps({"pid": os.getpid(), "start_ticks": None}))
    (run_root / "b").mkdir()  # being submitted: no supervisor yet
    second = _usercode.allocate_job_user(run_root, "b", pool)
    assert second.uid == pool[1]  # a's supervisor (this process) is alive: a holds its uid
    from cloud_adapters.base import ProviderError

    with pytest.raises(ProviderError, match=r"every uid of this GPU box's pool \(2\) is held by a running job"):
        _usercode.allocate_job_user(run_root, "c", pool)
    (run_root / "a" / "exit.json").write_text("{}")  # a is over, its supervisor gone without giving it back
    assert _usercode.allocate_job_user(run_root, "c", pool).uid == pool[0]
    assert (run_root / ".uids" / str(pool[0])).read_text() == "c\n"


# ---------------------------------------------------------------------------------------------
# A box that cannot isolate says so, and an installation of several users starts no job there
# ---------------------------------------------------------------------------------------------


def test_a_box_that_cannot_isolate_says_why(tmp_path, reachable_interpreter):
    off = GpuBoxBackend({"run_root": str(tmp_path / "runs"), "job_uids": "none"})
    assert (off.isolation.isolated, off.isolation.text) == (False, "jobs on this box run as the dashboard's own user: for a single user only (the "
                                    "operator turned the uid pool off (TRAINBOARD_GPUBOX_JOB_UIDS=none))")
    shared = GpuBoxBackend({"run_root": str(tmp_path / "runs"), "run_as": "nobody"})
    assert shared.isolation.text.endswith("(every job runs as the one OS user 'nobody' (TRAINBOARD_GPUBOX_RUN_AS))")
    # pytest's temporary directory lies under a 0700 directory: a job's uid could not reach the run root.
    hidden = GpuBoxBackend({"run_root": str(tmp_path / "runs")})
    if os.geteuid() == 0:
        blocked = next(p for p in [*reversed(tmp_path.parents), tmp_path] if not p.stat().st_mode & stat.S_IXOTH)
        assert hidden.isolation.text == (
            f"jobs on this box run as the dashboard's own user: for a single user only (a job's uid could not reach "
            f"the run root {tmp_path / 'runs'}: {blocked} is mode {stat.S_IMODE(blocked.stat().st_mode):04o}, which "
            f"other users may not enter)")
    else:
        assert hidden.isolation.text.startswith("jobs on this box run as the dashboard's own user: for a single user "
                                                "only (the gpubox worker runs as uid ")
    with pytest.raises(InvalidSpec) as err:
        GpuBoxBackend({"run_root": str(tmp_path), "job_uids": "500-600, 3x, 9-1"})
    assert err.value.errors["job_uids"] == [
        "Job uids: '500-600': a job's uid must be 1000 to 2147483646 (below 1000 are the system's accounts and root)."]


@pytest.mark.django_db
def test_several_users_start_no_job_on_a_shared_box_unless_the_operator_allows(
        user, django_user_model, digits_dataset, cnn_model, local_backend, settings, client):
    from jobs import dispatch, lifecycle, services
    from django.core.exceptions import ValidationError
    from taskkit import sent_tasks

    settings.TRAINBOARD_GPUBOX_ALLOW_SHARED_UID = False  # the default (the suite's is true: tests/xdist_workers.py)
    notice = "jobs on this box run as the dashboard's own user: for a single user only"
    client.force_login(user)
    page = html.unescape(client.get(f"/backends/{local_backend.pk}/").content.decode())
    assert f"Shared user</span> {notice} (" in page  # tmp_path: the box cannot isolate (test above)
    assert f"GPU box <strong>local</strong>: {notice} (" in html.unescape(client.get("/jobs/new/").content.decode())

    def create(name):
        with sent_tasks(dispatch.SUBMIT_JOB):
            return services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                                backend=local_backend, procs_per_node=2, name=name)

    django_user_model.objects.create_user(username="carol", password="pw-carol-123")
    queued = create("one-user")  # staff and a single user: a single user's installation
    django_user_model.objects.create_user(username="dave", password="pw-dave-123")
    with pytest.raises(ValidationError) as err:
        create("two-users")
    (message,) = err.value.message_dict["backend"]
    assert message.startswith(f"This GPU box cannot keep one user's job from another's: {notice} (")
    assert ("This installation has 2 users, so it starts no job there: the box's operator runs its worker as root "
            "with a uid pool (TRAINBOARD_GPUBOX_JOB_UIDS), or sets TRAINBOARD_GPUBOX_ALLOW_SHARED_UID=true") in message
    # A job created before the second user came is refused when the worker would start it.
    lifecycle.training_job_submit(job=queued)
    queued.refresh_from_db()
    assert queued.state == "FAILED" and queued.failure_reason == message
    settings.TRAINBOARD_GPUBOX_ALLOW_SHARED_UID = True
    create("allowed")


# ---------------------------------------------------------------------------------------------
# Memory: each job is bounded, and a plan beyond the box's memory is refused
# ---------------------------------------------------------------------------------------------

HOG = textwrap.dedent('''\
    hog = bytearray(3 * 2**30)  # 3 GiB, over the 1 GiB limit
    ''')


def test_a_job_past_its_memory_limit_fails_saying_so(tmp_path):
    backend = GpuBoxBackend({"run_root": str(tmp_path / "runs"), "max_procs_per_node": 1, "job_memory_limit": "1GiB"})
    handle = backend.submit(JobSpec(job_name="hog", procs_per_node=1, code=code_bundle(tmp_path / "store", {"hog.py": HOG}),
                                    config={"code": {"script": "hog.py"}, "parallel": {"procs_per_node": 1}}))
    status = _ended(backend, handle)
    assert status.state == JobState.FAILED
    assert status.failure_reason.startswith(
        "the job exceeded its 1 GiB memory limit (1 GiB per process; the box's TRAINBOARD_GPUBOX_JOB_MEMORY_LIMIT): "), \
        status.failure_reason
    with pytest.raises(InvalidSpec) as err:
        GpuBoxBackend({"run_root": str(tmp_path), "job_memory_limit": "lots"})
    assert err.value.errors["job_memory_limit"] == [
        "Job memory limit: 'lots' is not a size such as 8GiB or 512MiB (or none)."]


@pytest.mark.django_db
def test_a_plan_beyond_the_boxs_memory_is_refused_with_the_arithmetic(user, digits_dataset, local_backend, settings):
    from django.core.exceptions import ValidationError

    from jobs import services

    settings.TRAINBOARD_GPUBOX_JOB_MEMORY_LIMIT = "64MiB"  # 32 MiB per rank of two
    big = services.model_spec_create(owner=user, name="big-cnn", architecture="cnn",
                                     params={"channels": 64, "hidden_size": 4096})
    with pytest.raises(ValidationError) as err:
        services.training_job_create(owner=user, dataset=digits_dataset, model_spec=big, backend=local_backend,
                                     procs_per_node=2, name="too-big")
    (message,) = [m for ms in err.value.message_dict.values() for m in ms if "does not fit" in m]
    assert message.startswith("The job does not fit in the machine's memory: it needs ")
    assert (" per rank; backend local's host (no GPU; " in message
            and "a job may use 64 MiB (its memory limit): 32 MiB per rank for 2 ranks) has 32.0 MiB" in message), message
    assert "The plan per rank: " in message and "device: no GPU; " in message
