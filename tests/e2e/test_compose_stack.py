"""End to end: docker-compose.yml built, started and running jobs, on a dockerd of the test's own.

What it does (issue 17; docs/docker.md "How CI tests it"), each phase printed with its duration:

1. starts ``dockerd`` as root with its data root, exec root and socket in a temporary directory,
   ``--bridge=none --iptables=false`` (no container network at all);
2. the base images the production files name (docker/bases/images: Python, PostgreSQL, Redis) from Debian's
   packages, ``scripts/docker-bases.sh``, and the Dockerfile's ``deps`` stage of an earlier run as the
   build's layer cache, both ``docker load``-ed from ``$TRAINBOARD_DOCKER_CACHE`` (default
   ~/.cache/trainboard-docker) when a run on this machine saved them;
3. ``docker-compose -f docker-compose.yml -f docker/compose.hostnet.yml build`` and ``up -d`` (of that
   merged configuration without its ``ports``, see :func:`_ci_compose`): docker-compose.yml alone, the
   CPU-only stack a host without NVIDIA's toolkit runs; every container on the host's network,
   PostgreSQL, Redis and web on 127.0.0.1:25432, 26379 and 28000; torch's CPU build (its wheel copied
   into the context's .wheels/ when this machine has it); the ``deps`` stage saved for the next run
   when it changed;
4. waits until every container's health check passes; checks the containers as the engine made them
   (non-root, host network, the runner's PID namespace shared with the box's worker, no device, the
   volumes; the runner holds no secret, and a process in it, where jobs run, cannot read the box
   worker's environment); creates a superuser with
   ``docker-compose exec -T web python manage.py createsuperuser``, takes an API token and, through the
   web container's API, creates the digits dataset, a CNN and the GPU-box backend box-a;
5. a digits DDP job of 1 node × 2 processes reaches SUCCEEDED on the gpubox-worker-a container, with
   metrics and a cost;
6. a second, longer job: ``docker-compose restart gpubox-worker-a`` while it runs; its training
   processes (in gpubox-runner) keep running, the restarted worker (its container's start time changed)
   follows it, and it ends SUCCEEDED in its first attempt (not FAILED lost, not resubmitted);
7. ``down -v``: no container and no volume left; then dockerd is stopped by its PID and its temporary
   directory, data root included, removed.

The machine has no NVIDIA GPU and its engine no ``nvidia`` device driver, like the host of a user
without NVIDIA's Container Toolkit: no container asks for a device. docker-compose.gpu.yml, which adds
the reservation, is checked as configuration (tests/test_docker_compose.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from polling import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
WEB = "http://127.0.0.1:28000"
OVERRIDE = ROOT / "docker" / "compose.hostnet.yml"
TORCH_CPU_WHEEL = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
DEPS_CACHE = "trainboard-ci/deps-cache"  # the Dockerfile's deps stage, the build's layer cache (compose.hostnet.yml)
SERVICES = {"postgres", "redis", "web", "worker", "notifier", "beat", "gpubox-runner", "gpubox-worker-a", "flower"}


class Phases:
    """Prints each phase with its duration (pytest shows them when the test fails; -s shows them live)."""

    def __init__(self) -> None:
        self.started = self.last = time.monotonic()

    def done(self, what: str) -> None:
        now = time.monotonic()
        print(f"[compose e2e] {what}: {now - self.last:.1f} s (total {now - self.started:.1f} s)", flush=True)
        self.last = now


def _run(argv: list[str], env: dict[str, str], timeout: float, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        pytest.fail(f"{' '.join(argv[:6])} ... exited {out.returncode}:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    return out


ENGINE_DIR = "engine"
"""The engine's data root kept between runs, inside the cache directory (``TRAINBOARD_DOCKER_KEEP_ENGINE=0``
turns it off: a temporary one, as on a machine whose cache directory is not on a disk overlay2 takes)."""


@pytest.fixture(scope="module")
def dockerd():
    """``{"env": ..., "pid": ..., "cache": ..., "kept": ...}``: a dockerd of this test's own (module
    docstring, step 1), stopped by its PID at the end, also when the test fails. Its exec root and
    socket are in a temporary directory, removed at the end. Its data root (images, layers) is
    ``<cache>/engine``, kept for the next run on this machine (``kept`` True) while this run holds
    ``<cache>/engine.lock``; a second run beside it, or ``TRAINBOARD_DOCKER_KEEP_ENGINE=0``, gets a
    temporary data root (``kept`` False) and the tarballs instead. ``cache`` is the directory of the
    images saved between runs (``TRAINBOARD_DOCKER_CACHE``, default ~/.cache/trainboard-docker)."""
    import fcntl

    assert os.geteuid() == 0, "the compose e2e test starts its own dockerd and needs root (as CI runs)"
    for tool in ("dockerd", "docker", "docker-compose", "debootstrap"):
        assert shutil.which(tool), f"{tool} missing: run `make system-deps` (scripts/system-deps.sh)"
    cache = Path(os.environ.get("TRAINBOARD_DOCKER_CACHE") or Path.home() / ".cache" / "trainboard-docker")
    cache.mkdir(parents=True, exist_ok=True)
    # Short: the exec root holds unix sockets (108-byte path limit).
    top = Path(tempfile.mkdtemp(prefix="tbd-", dir="/tmp"))
    lock = open(cache / "engine.lock", "w")
    kept = os.environ.get("TRAINBOARD_DOCKER_KEEP_ENGINE", "1") != "0"
    if kept:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another run's engine has it: this one starts from the tarballs
            kept = False
    data_root = cache / ENGINE_DIR if kept else top / "data"
    if kept:
        _unmount_under(data_root)  # an engine killed by a crash may have left its mounts
    sock = top / "docker.sock"
    log = open(top / "dockerd.log", "wb")
    # overlay2 works on this machine's ext4; should a CI disk refuse it, --storage-driver vfs does (slower).
    proc = subprocess.Popen(
        ["dockerd", "--data-root", str(data_root), "--exec-root", str(top / "x"), "--pidfile", str(top / "pid"),
         "--host", f"unix://{sock}", "--bridge=none", "--iptables=false", "--ip6tables=false"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    env = {**os.environ, "DOCKER_HOST": f"unix://{sock}", "DOCKER_BUILDKIT": "0", "COMPOSE_DOCKER_CLI_BUILD": "0"}
    try:
        wait_for(lambda: proc.poll() is not None or subprocess.run(
            ["docker", "version"], env=env, capture_output=True, timeout=30).returncode == 0,
            timeout=60, interval=0.5, what="the test's dockerd to answer")
        assert proc.poll() is None, (top / "dockerd.log").read_text()[-3000:]
        if kept:  # what a crashed run left: its containers and volumes (the images stay: they are the cache)
            left = _run(["docker", "ps", "-aq"], env, 60).stdout.split()
            if left:
                _run(["docker", "rm", "--force", "--volumes", *left], env, 300)
            _run(["docker", "volume", "prune", "--force"], env, 120)
        yield {"env": env, "pid": proc.pid, "log": top / "dockerd.log", "cache": cache, "kept": kept}
    finally:
        if kept and proc.poll() is None:
            # Keep the cache from growing: the images no tag names any more (the last run's app image).
            subprocess.run(["docker", "image", "prune", "--force"], env=env, capture_output=True, timeout=300)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # it stops its containers and its containerd
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                # Its whole session (it was started in one of its own): containerd and the shims too.
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        _unmount_under(top)  # dockerd leaves its netns/default bind mount in the exec root
        if kept:
            _unmount_under(data_root)
        lock.close()  # the next run may take the engine
        shutil.rmtree(top, ignore_errors=True)  # never hide the test's own failure behind a cleanup error


def _unmount_under(top: Path) -> None:
    """Unmount every mount point inside ``top``, the deepest first."""
    with open("/proc/self/mounts") as fh:
        points = [line.split()[1] for line in fh if line.split()[1].startswith(f"{top}/")]
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", point], capture_output=True, timeout=30)


class Api:
    def __init__(self, token: str = ""):
        self.token = token

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{WEB}{path}", data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Token {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def post(self, path: str, body: dict, expect: int = 201) -> dict:
        status, answer = self.call("POST", path, body)
        assert status == expect, (path, status, answer)
        return answer

    def upload_model(self, name: str, script: str) -> dict:
        """A *my script* model whose code is one file, ``held.py`` = ``script``, uploaded as a multipart
        ``.tar.gz`` (``POST /api/models/``, kind script)."""
        import io
        import tarfile

        import requests

        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            data = script.encode()
            member = tarfile.TarInfo("held.py")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
        answer = requests.post(f"{WEB}/api/models/", headers={"Authorization": f"Token {self.token}"}, timeout=60,
                               data={"name": name, "kind": "script", "entry_point": "held.py"},
                               files={"code": ("held.tar.gz", buffer.getvalue(), "application/gzip")})
        assert answer.status_code == 201, (answer.status_code, answer.text[:2000])
        return answer.json()

    def get(self, path: str) -> dict:
        status, answer = self.call("GET", path)
        assert status == 200, (path, status, answer)
        return answer


def _health(compose, env) -> dict[str, str]:
    ids = _run(compose + ["ps", "-q"], env, 60).stdout.split()
    if not ids:
        return {}
    out = _run(["docker", "inspect", "--format",
                "{{index .Config.Labels \"com.docker.compose.service\"}} {{if .State.Health}}{{.State.Health.Status}}"
                "{{else}}{{.State.Status}}{{end}}", *ids], env, 60)
    return dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.strip())


def _ci_compose(files: list[str], env: dict[str, str], path: Path) -> list[str]:
    """The docker-compose command line on the merged configuration of ``files``, minus ``ports``.

    Host networking discards published ports (the engine says so), but docker-compose 1.29 refuses to
    create a container with both, and an override file cannot remove a key: so the test runs what
    ``docker-compose config`` merged, with the ports taken out and nothing else changed. The file holds
    the secrets of the run: it is written to the test's own temporary directory."""
    merged = yaml.safe_load(_run(files + ["config"], env, 120).stdout)
    for service in merged["services"].values():
        service.pop("ports", None)
    path.write_text(yaml.safe_dump(merged, sort_keys=False))
    path.chmod(0o600)
    return ["docker-compose", "--project-directory", str(ROOT), "-f", str(path)]


def test_the_compose_stack_builds_starts_runs_jobs_and_survives_a_worker_restart(dockerd, tmp_path):
    phases = Phases()
    env = dict(dockerd["env"])
    from cryptography.fernet import Fernet

    env.update(POSTGRES_PASSWORD=secrets.token_urlsafe(16), DJANGO_SECRET_KEY=secrets.token_urlsafe(40),
               TRAINBOARD_ENCRYPTION_KEY=Fernet.generate_key().decode(),
               COMPOSE_PROJECT_NAME=f"tbci{secrets.token_hex(3)}", TORCH_VARIANT="cpu")
    files = ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "-f", str(OVERRIDE)]
    compose = _ci_compose(files, env, tmp_path / "compose.ci.yml")

    out = _run(["bash", str(ROOT / "scripts" / "docker-bases.sh")], env, 900)
    print(out.stdout.strip())
    phases.done("base images")
    deps_tarball = dockerd["cache"] / "build-deps-cpu.tar"
    cached_deps = _image_id(DEPS_CACHE, env)  # a kept engine has it from the last run: nothing to load
    if not cached_deps and deps_tarball.is_file():
        _run(["docker", "load", "-q", "-i", str(deps_tarball)], env, 600)
        cached_deps = _image_id(DEPS_CACHE, env)
    phases.done(f"deps stage {'in the engine or loaded from ' + str(deps_tarball) if cached_deps else 'not cached yet'}")

    wheels = ROOT / ".wheels"
    if not (wheels / TORCH_CPU_WHEEL).exists():
        sources = [p for d in [*os.environ.get("PIP_FIND_LINKS", "").split(), "/opt/wheels"]
                   if (p := Path(d) / TORCH_CPU_WHEEL).is_file()]
        if sources:
            wheels.mkdir(exist_ok=True)
            shutil.copy2(sources[0], wheels / TORCH_CPU_WHEEL)
    try:
        # The deps stage first, on its own tag: from the loaded one's layers where its inputs are unchanged
        # (the classic builder reuses a loaded image's layers only through --cache-from, and with it no
        # other cache), else built; saved for the next run when it changed (requirements, package files,
        # the wheel, the base). The compose build then takes it whole as its cache (compose.hostnet.yml).
        _run(["docker", "build", "-q", "--network", "host", "--build-arg", "TORCH_VARIANT=cpu", "--target", "deps",
              *(["--cache-from", DEPS_CACHE] if cached_deps else []), "-t", DEPS_CACHE, str(ROOT)], env, 1500)
        if _image_id(DEPS_CACHE, env) != cached_deps and dockerd["kept"]:
            phases.done("deps stage built (kept in this machine's engine for the next run)")
        elif _image_id(DEPS_CACHE, env) != cached_deps:
            phases.done("deps stage built")
            partial = deps_tarball.with_suffix(".tar.partial")
            _run(["docker", "save", "-o", str(partial), DEPS_CACHE], env, 600)
            partial.replace(deps_tarball)
            phases.done(f"deps stage saved to {deps_tarball} ({deps_tarball.stat().st_size / 1e6:.0f} MB)")
        else:
            phases.done("deps stage unchanged (all its layers from the cache)")
        _run(files + ["build", "web"], env, 1500)  # every app service runs this one image
        phases.done("build trainboard:latest")
        size = int(_run(["docker", "image", "inspect", "--format", "{{.Size}}", "trainboard:latest"], env, 60).stdout)
        print(f"[compose e2e] trainboard:latest (TORCH_VARIANT=cpu) is {size / 1e6:.0f} MB")

        _run(compose + ["up", "-d"], env, 600)
        phases.done("up -d")
        seen: dict[str, str] = {}

        def all_healthy():
            seen.clear()
            seen.update(_health(compose, env))
            return set(seen) == SERVICES and all(v == "healthy" for v in seen.values())

        try:
            wait_for(all_healthy, timeout=300, interval=2, what="every service's health check to pass")
        except BaseException:
            print(f"health: {seen}")
            raise
        phases.done("all health checks passed")
        _check_the_containers(compose, env)

        password = secrets.token_urlsafe(16)
        _run(compose + ["exec", "-T", "-e", f"DJANGO_SUPERUSER_PASSWORD={password}", "web", "python", "manage.py",
                        "createsuperuser", "--noinput", "--username", "ci-admin", "--email", "ci@example.com"], env, 120)
        token = Api().post("/api/auth/token/", {"username": "ci-admin", "password": password}, expect=200)["token"]
        api = Api(token)
        # Static files are served by gunicorn through whitenoise, from the image's collected files.
        with urllib.request.urlopen(f"{WEB}/static/chart.umd.min.js", timeout=30) as response:
            assert response.status == 200 and b"Chart" in response.read(4096)
        dataset = api.post("/api/datasets/", {"name": "digits", "format": "builtin", "builtin_name": "digits"})
        model = api.post("/api/models/", {"name": "digits-cnn", "architecture": "cnn",
                                          "params": {"channels": 16, "hidden_size": 64}})
        backend = api.post("/api/backends/", {"name": "box-a", "kind": "gpubox", "config": {"hourly_rate_usd": 3.6}})
        phases.done("superuser, token, dataset, model, backend box-a")

        def submit(epochs: int) -> dict:
            return api.post("/api/jobs/", {"dataset": dataset["id"], "model_spec": model["id"], "backend": backend["id"],
                                           "nodes": 1, "procs_per_node": 2, "epochs": epochs, "seed": 1,
                                           "max_runtime_s": 1800})  # the default lr and batch size

        def ended(job_id: int, timeout: float) -> dict:
            return wait_for(lambda: (j := api.get(f"/api/jobs/{job_id}/"))["is_terminal"] and j, timeout=timeout,
                            interval=1, what=f"job {job_id} to end")

        first = ended(submit(3)["id"], 300)
        assert first["state"] == "SUCCEEDED", first
        assert first["final_metrics"]["val_accuracy"] >= 0.85, first["final_metrics"]
        assert float(first["cost_usd"]) > 0 and first["billable_seconds"] > 0, first
        assert float(first["hourly_price_usd"]) == 3.6, first["hourly_price_usd"]  # box-a's hourly_rate_usd
        phases.done(f"first job SUCCEEDED (val_accuracy {first['final_metrics']['val_accuracy']:.3f}, "
                    f"${first['cost_usd']})")
        # Its artifacts, listed and streamed by the web container from the box's run directory.
        listing = api.get(f"/api/jobs/{first['id']}/artifacts/")
        assert listing["error"] == "", listing
        model_pt = next(a for a in listing["results"] if a["name"].endswith("model.pt"))
        request = urllib.request.Request(f"{WEB}/api/jobs/{first['id']}/artifacts/{model_pt['name']}/download/",
                                         headers={"Authorization": f"Token {token}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            weights = response.read()
        assert len(weights) == model_pt["size_bytes"] > 0 and hashlib.sha256(weights).hexdigest() == model_pt["sha256"]
        phases.done(f"its {model_pt['name']} downloaded from the web container ({len(weights):,} bytes, sha256 matches)")

        # The second job is held running until the test releases it (no race with a job's length): a
        # *my script* job of 2 ranks, uploaded through the API, that reports a step every 0.2 s until a
        # file the test writes in the runner's container appears in its output directory.
        script = api.upload_model("held", HELD_SCRIPT)
        second = api.post("/api/jobs/", {"model_spec": script["id"], "backend": backend["id"], "nodes": 1,
                                         "procs_per_node": 2, "max_runtime_s": 1800})
        running = wait_for(lambda: (j := api.get(f"/api/jobs/{second['id']}/"))["state"] == "RUNNING" and j,
                           timeout=180, interval=1, what="the second job to run")
        wait_for(lambda: len(_ranks(compose, env)) >= 2 and _in_runner(compose, env, HELD_RANKS) == "2",
                 timeout=120, interval=1, what="both ranks of the second job held at their gate")
        ranks_before = _ranks(compose, env)
        started_before = _started_at(compose, env, "gpubox-worker-a")
        _run(compose + ["restart", "gpubox-worker-a"], env, 180)
        assert _started_at(compose, env, "gpubox-worker-a") != started_before  # a new start of its container
        phases.done("second job RUNNING and held; gpubox-worker-a restarted")
        # The training processes lived through the restart: the same pids, in the runner's container.
        assert _ranks(compose, env) >= ranks_before
        assert api.get(f"/api/jobs/{second['id']}/")["state"] == "RUNNING"
        _in_runner(compose, env, RELEASE_HELD)
        second = ended(running["id"], 300)
        assert second["state"] == "SUCCEEDED", second
        assert second["attempt"] == 1, second  # followed to its end, never lost and resubmitted
        assert second["final_metrics"]["released"] == 1.0 and float(second["cost_usd"]) > 0, second
        events = api.get(f"/api/jobs/{second['id']}/")
        assert "lost" not in json.dumps(events.get("events", [])).lower()
        wait_for(lambda: _health(compose, env).get("gpubox-worker-a") == "healthy", timeout=120, interval=2,
                 what="the restarted gpubox-worker-a to be healthy")
        phases.done("second job SUCCEEDED after the worker's restart; the worker healthy again")
    finally:
        print(_health(compose, env))
        logs = _run(compose + ["logs", "--no-color", "--tail", "25"], env, 120, check=False)
        print(logs.stdout[-15000:])
        _run(compose + ["down", "-v", "--remove-orphans"], env, 300, check=False)
    assert _run(["docker", "ps", "-aq"], env, 60).stdout.split() == []
    assert _run(["docker", "volume", "ls", "-q"], env, 60).stdout.split() == []
    phases.done("down -v: no container, no volume left")


def _started_at(compose: list[str], env: dict[str, str], service: str) -> str:
    cid = _run(compose + ["ps", "-q", service], env, 60).stdout.split()[0]
    return _run(["docker", "inspect", "--format", "{{.State.StartedAt}}", cid], env, 60).stdout.strip()


# Run in the runner's container as its user, where a job's user code runs: every Celery worker process
# it can see (the box's worker shares the runner's PID namespace), and whether its environment reads.
_READ_WORKERS_ENVIRON = r"""
import json, os
seen = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        continue
    if any(a.endswith(b"celery") for a in argv) and b"worker" in argv:
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read()
        except PermissionError:
            seen[pid] = "refused"
        else:
            seen[pid] = "secret read" if b"TRAINBOARD_ENCRYPTION_KEY=" in environ else "read"
print(json.dumps({"uid": os.getuid(), "workers": seen}))
"""


def _check_the_containers(compose: list[str], env: dict[str, str]) -> None:
    """What the compose file asks of the engine, as the engine applied it."""
    def inspect(service: str) -> dict:
        cid = _run(compose + ["ps", "-q", service], env, 60).stdout.split()[0]
        return json.loads(_run(["docker", "inspect", cid], env, 60).stdout)[0]

    runner, worker, web = inspect("gpubox-runner"), inspect("gpubox-worker-a"), inspect("web")
    for box in (runner, worker):
        assert not box["HostConfig"]["DeviceRequests"], box["Name"]  # the CPU-only stack asks for no device
    assert worker["HostConfig"]["PidMode"] == f"container:{runner['Id']}"
    assert runner["HostConfig"]["ShmSize"] == 8 * 1024 ** 3 and runner["HostConfig"]["Init"] is True
    for box in (runner, worker, web):
        assert box["Config"]["User"] == "trainboard" and box["HostConfig"]["NetworkMode"] == "host"
    # The runner, whose processes are the jobs, holds none of the installation's secrets ...
    runner_env = dict(item.split("=", 1) for item in runner["Config"]["Env"])
    assert not {"DJANGO_SECRET_KEY", "TRAINBOARD_ENCRYPTION_KEY", "DATABASE_URL", "POSTGRES_PASSWORD"} & set(runner_env)
    assert "TRAINBOARD_ENCRYPTION_KEY" in dict(item.split("=", 1) for item in worker["Config"]["Env"])
    # ... and code running there as the same user cannot read the box worker's (it is not dumpable).
    found = json.loads(_run(compose + ["exec", "-T", "gpubox-runner", "python", "-c", _READ_WORKERS_ENVIRON],
                            env, 120).stdout.strip().splitlines()[-1])
    assert found["uid"] != 0 and found["workers"], found
    assert set(found["workers"].values()) == {"refused"}, found
    mounts = {m["Destination"]: m["Name"].split("_", 1)[1] for m in runner["Mounts"]}
    assert mounts == {"/var/lib/trainboard/runs": "runs", "/var/lib/trainboard/datasets": "datasets",
                      "/var/lib/trainboard/code": "code", "/var/lib/trainboard/runner": "runner"}
    assert {m["Destination"]: m["Name"].split("_", 1)[1] for m in worker["Mounts"]} == mounts
    assert {(m["Destination"], m["RW"]) for m in web["Mounts"]} == {
        ("/var/lib/trainboard/datasets", True), ("/var/lib/trainboard/code", True), ("/var/lib/trainboard/runs", False)}


def _image_id(ref: str, env: dict[str, str]) -> str:
    out = _run(["docker", "image", "inspect", "--format", "{{.Id}}", ref], env, 60, check=False)
    return out.stdout.strip() if out.returncode == 0 else ""


def _ranks(compose: list[str], env: dict[str, str]) -> set[str]:
    """Pids of the ranks' launchers in the runner's container (``docker top``, which cuts each command
    line at 80 characters: ``python -u -m trainer_pkg.launch ...``, the user's script their child)."""
    cid = _run(compose + ["ps", "-q", "gpubox-runner"], env, 60).stdout.split()[0]
    out = _run(["docker", "top", cid, "-o", "pid,args"], env, 60).stdout.splitlines()[1:]
    return {line.split(None, 1)[0] for line in out if "trainer_pkg" in line and "torch.distributed.run" not in line}


def _in_runner(compose: list[str], env: dict[str, str], shell: str) -> str:
    """``shell`` (a fixed text of this module, never a value from elsewhere) run by ``sh -c`` in the
    runner's container, as its user; its stdout, stripped."""
    return _run(compose + ["exec", "-T", "gpubox-runner", "sh", "-c", shell], env, 120).stdout.strip()


HELD_SCRIPT = """\
import os, pathlib, time

from trainer_pkg import report

out = pathlib.Path(report.model_dir())
(out / f"held-{os.environ.get('RANK', '0')}").touch()  # this rank is at the gate
step = 0
while not (out / "release").exists():
    step += 1
    report.log(step=step, released=0.0)
    time.sleep(0.2)
report.log(step=step + 1, released=1.0)
"""
"""The second job's script: each rank marks itself held in the job's output directory, then reports a
step every 0.2 s until the test writes ``release`` there (:data:`RELEASE_HELD`)."""

RUNS = "/var/lib/trainboard/runs"  # the box's run root in the runner's container (docker-compose.yml)
HELD_RANKS = f"ls {RUNS}/*/output/held-* 2>/dev/null | wc -l"
RELEASE_HELD = f"for d in {RUNS}/*/output; do [ -e \"$d/held-0\" ] && touch \"$d/release\"; done; true"
