"""docker-compose.yml, docker-compose.gpu.yml and the CI override, as Debian's docker-compose 1.29 resolves
them (`config` needs no engine). tests/e2e/test_compose_stack.py builds and runs them."""

import io
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from django.core.management import call_command

ROOT = Path(__file__).resolve().parent.parent


SECRETS = {"POSTGRES_PASSWORD": "pw-for-validation", "DJANGO_SECRET_KEY": "key-for-validation",
           "TRAINBOARD_ENCRYPTION_KEY": "fernet-key-for-validation"}


def _resolved_compose(*overrides: str, files: bool = True, env_file: Path | None = None) -> dict:
    """``docker-compose config`` of docker-compose.yml plus ``overrides`` (or, with ``files=False``, of
    what COMPOSE_FILE selects, as a user's .env would), run in the repository's root."""
    assert shutil.which("docker-compose"), "docker-compose missing: run `make system-deps`"
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_VARIANT", "COMPOSE_FILE")}
    env.update(SECRETS)
    argv = [arg for f in ("docker-compose.yml", *overrides) for arg in ("-f", str(ROOT / f))] if files else []
    if env_file is not None:
        argv = ["--env-file", str(env_file), *argv]
    out = subprocess.run(
        ["docker-compose", *argv, "config"], cwd=ROOT,
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )
    return yaml.safe_load(out.stdout)


APP_SERVICES = ("web", "worker", "notifier", "beat", "gpubox-runner", "gpubox-worker-a", "flower")
DJANGO_SERVICES = tuple(name for name in APP_SERVICES if name != "gpubox-runner")
"""The services that run Django and hold the installation's secrets (the runner holds none)."""
RUNNER_ENV = {"TRAINBOARD_RUN_ROOT": "/var/lib/trainboard/runs",
              "TRAINBOARD_GPUBOX_RUNNER_SOCKET": "/var/lib/trainboard/runner/runner.sock"}


def test_compose_has_every_service_with_postgres_and_redis():
    services = _resolved_compose()["services"]
    assert set(services) == {"postgres", "redis", "web", "worker", "notifier", "beat", "gpubox-runner",
                             "gpubox-worker-a", "flower"}
    for name in DJANGO_SERVICES:
        env = services[name]["environment"]
        assert env["DATABASE_URL"].startswith("postgres://trainboard:pw-for-validation@postgres:5432/")
        assert env["REDIS_URL"] == "redis://redis:6379/0"
        # One key for all processes: what the web encrypts, the workers must decrypt.
        assert env["TRAINBOARD_ENCRYPTION_KEY"] == "fernet-key-for-validation"
        assert (env["DJANGO_ENV"], env["DJANGO_SECURE_PROXY_SSL_HEADER"]) == ("development", "false")  # .env sets them
    # The runner's processes are the jobs (user code, its uid): it is given no secret to leak.
    assert services["gpubox-runner"]["environment"] == RUNNER_ENV


def test_published_ports_are_this_hosts_loopback_only_unless_the_operator_says(monkeypatch):
    published = {name: service.get("ports", []) for name, service in _resolved_compose()["services"].items()}
    assert {name: ports for name, ports in published.items() if ports} == {
        "web": ["127.0.0.1:8000:8000/tcp"], "flower": ["127.0.0.1:5555:5555/tcp"]}
    monkeypatch.setenv("TRAINBOARD_WEB_ADDR", "0.0.0.0")
    monkeypatch.setenv("TRAINBOARD_WEB_PORT", "8100")
    monkeypatch.setenv("TRAINBOARD_FLOWER_PORT", "5600")
    services = _resolved_compose()["services"]
    assert (services["web"]["ports"], services["flower"]["ports"]) == (["0.0.0.0:8100:8000/tcp"],
                                                                       ["127.0.0.1:5600:5555/tcp"])


def test_the_web_and_the_workers_hide_their_environment_from_same_user_jobs():
    """gunicorn's master and every Celery worker mark themselves not dumpable (webapp/hardening.py)."""
    services = _resolved_compose()["services"]
    assert "--config python:webapp.gunicorn_conf" in services["web"]["command"]
    hostnet = _resolved_compose("docker/compose.hostnet.yml")["services"]
    assert "--config python:webapp.gunicorn_conf" in hostnet["web"]["command"]


@pytest.mark.django_db
def test_the_box_worker_consumes_its_own_queue(monkeypatch):
    box = _resolved_compose()["services"]["gpubox-worker-a"]
    assert box["environment"]["TRAINBOARD_GPUBOX_NAME"] == "box-a"
    command = box["command"]
    assert command == ["python", "manage.py", "gpubox_worker", "--concurrency", "2", "--loglevel", "INFO"]
    assert "runs:/var/lib/trainboard/runs:rw" in box["volumes"]
    # What the service's command starts, with the service's environment: a worker on box-a's queue only.
    monkeypatch.setenv("TRAINBOARD_GPUBOX_NAME", box["environment"]["TRAINBOARD_GPUBOX_NAME"])
    out, err = io.StringIO(), io.StringIO()
    call_command(*command[2:], "--print", stdout=out, stderr=err)
    argv = shlex.split(out.getvalue())
    assert argv[1:] == ["-A", "webapp", "worker", "-Q", "gpubox.box-a", "-n", "gpubox-box-a@%h",
                        "--concurrency", "2", "--loglevel", "INFO"]
    assert Path(argv[0]).name == "celery"
    assert "No GPU-box backend is named box-a yet" in err.getvalue()


def test_the_default_worker_leaves_the_boxes_queues_to_theirs():
    command = _resolved_compose()["services"]["worker"]["command"]
    assert command[command.index("-Q") + 1] == "celery"


def test_notifications_have_a_worker_of_their_own():
    from django.conf import settings

    services = _resolved_compose()["services"]
    for files in ((), ("docker/compose.hostnet.yml",)):
        command = _resolved_compose(*files)["services"]["notifier"]["command"]
        # Its own queue and node name (with host networking every container has the host's name).
        assert command[command.index("-Q") + 1] == settings.TRAINBOARD_NOTIFICATIONS_QUEUE == "notifications"
        assert command[command.index("-n") + 1] == "notifier@%h"
    assert "notifier@$$(hostname)" in services["notifier"]["healthcheck"]["test"][1]
    routed = {name for name, route in settings.CELERY_TASK_ROUTES.items() if route == {"queue": "notifications"}}
    assert routed == {"jobs.tasks.deliver_webhook", "jobs.tasks.webhook_deliveries_due",
                      "jobs.tasks.send_notification_email"}


def test_compose_refuses_to_start_without_secrets():
    env = {k: v for k, v in os.environ.items() if k not in ("POSTGRES_PASSWORD", "DJANGO_SECRET_KEY")}
    out = subprocess.run(
        ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode != 0
    assert "set POSTGRES_PASSWORD" in out.stderr or "set DJANGO_SECRET_KEY" in out.stderr


def test_compose_refuses_to_start_without_an_encryption_key():
    env = {**{k: v for k, v in os.environ.items() if k != "TRAINBOARD_ENCRYPTION_KEY"},
           "POSTGRES_PASSWORD": "pw", "DJANGO_SECRET_KEY": "key"}
    out = subprocess.run(
        ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode != 0
    assert "set TRAINBOARD_ENCRYPTION_KEY" in out.stderr


def test_every_service_has_a_health_check_and_the_app_one_image():
    services = _resolved_compose()["services"]
    for name, service in services.items():
        assert service["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name
    for name in APP_SERVICES:
        assert services[name]["image"] == "trainboard:latest", name
        assert services[name]["build"]["args"] == {"TORCH_VARIANT": "cpu"}, name  # no GPU assumed
    # Each checks itself: its own node, its own pidfile, its own socket, its own port.
    assert "celery@$$(hostname)" in services["worker"]["healthcheck"]["test"][1]
    assert "gpubox-box-a@$$(hostname)" in services["gpubox-worker-a"]["healthcheck"]["test"][1]
    assert "/tmp/celerybeat.pid" in services["beat"]["healthcheck"]["test"][-1]
    assert services["beat"]["command"][-2:] == ["--pidfile", "/tmp/celerybeat.pid"]
    assert services["gpubox-runner"]["healthcheck"]["test"] == ["CMD", "python", "-m", "cloud_adapters.gpubox.runner", "--ping"]
    assert "127.0.0.1:8000/healthz" in services["web"]["healthcheck"]["test"][-1]


def test_datasets_code_and_runs_are_shared_at_the_same_paths():
    services = _resolved_compose()["services"]
    volumes = {name: set(services[name].get("volumes", [])) for name in APP_SERVICES}
    shared = {"datasets:/var/lib/trainboard/datasets:rw", "code:/var/lib/trainboard/code:rw"}
    for name in APP_SERVICES:
        assert shared <= volumes[name], name  # the web checks a dataset where the box's runs read it
    for name in DJANGO_SERVICES:
        assert services[name]["environment"]["TRAINBOARD_DATASET_ROOTS"] == "/var/lib/trainboard/datasets"
        assert services[name]["environment"]["TRAINBOARD_CODE_STORE"] == "/var/lib/trainboard/code"
    box = shared | {"runs:/var/lib/trainboard/runs:rw", "runner:/var/lib/trainboard/runner:rw"}
    assert volumes["gpubox-runner"] == box and volumes["gpubox-worker-a"] == box
    # The web streams a box job's artifacts from its run directory, which it can read, never change.
    assert volumes["web"] == shared | {"runs:/var/lib/trainboard/runs:ro"}
    assert services["web"]["environment"]["TRAINBOARD_RUN_ROOT"] == "/var/lib/trainboard/runs"
    for name in ("worker", "beat", "flower"):
        assert volumes[name] == shared, name
    assert set(_resolved_compose()["volumes"]) == {"pgdata", "redisdata", "runs", "datasets", "code", "runner"}


def test_the_boxs_jobs_run_in_the_runner_which_the_worker_sees_and_reaches():
    services = _resolved_compose()["services"]
    runner, worker = services["gpubox-runner"], services["gpubox-worker-a"]
    assert runner["command"] == ["python", "-m", "cloud_adapters.gpubox.runner"]
    socket_path = "/var/lib/trainboard/runner/runner.sock"
    assert runner["environment"]["TRAINBOARD_GPUBOX_RUNNER_SOCKET"] == socket_path
    assert worker["environment"]["TRAINBOARD_GPUBOX_RUNNER_SOCKET"] == socket_path
    assert worker["pid"] == "service:gpubox-runner"  # it judges and cancels the jobs by their pids
    assert worker["depends_on"]["gpubox-runner"] == {"condition": "service_healthy"}
    assert runner["init"] is True and runner["shm_size"] == "8gb"


def test_docker_compose_yml_alone_asks_for_no_device_so_it_runs_on_any_host():
    # A host without NVIDIA's Container Toolkit refuses any nvidia reservation at `up`
    # ("could not select device driver"): the default stack has none, and torch's CPU build.
    for name, service in _resolved_compose()["services"].items():
        assert "deploy" not in service and "devices" not in service and "runtime" not in service, name


def _gpu_stack_checks(services: dict) -> None:
    # The training processes run in the runner: it holds the GPUs, and so does the worker (NVML inventory).
    gpus = [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    for name in ("gpubox-runner", "gpubox-worker-a"):
        assert services[name]["deploy"]["resources"]["reservations"]["devices"] == gpus, name
    for name in ("postgres", "redis", "web", "worker", "notifier", "beat", "flower"):
        assert "deploy" not in services[name], name
    for name in APP_SERVICES:  # one image, one build: every app service builds it with CUDA's torch
        assert services[name]["build"]["args"] == {"TORCH_VARIANT": "cuda"}, name
        assert services[name]["image"] == "trainboard:latest", name
    # The GPU file adds, it changes nothing else: the box still runs in the runner's PID namespace.
    assert services["gpubox-worker-a"]["pid"] == "service:gpubox-runner"
    assert services["gpubox-runner"]["command"] == ["python", "-m", "cloud_adapters.gpubox.runner"]


def test_the_gpu_file_reserves_every_nvidia_gpu_for_the_box_and_builds_cuda_torch():
    _gpu_stack_checks(_resolved_compose("docker-compose.gpu.yml")["services"])


def test_compose_file_in_dot_env_selects_the_gpu_stack_as_the_readme_says(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("COMPOSE_FILE=docker-compose.yml:docker-compose.gpu.yml\n"
                        + "".join(f"{k}={v}\n" for k, v in SECRETS.items()))
    services = _resolved_compose(files=False, env_file=env_file)["services"]
    _gpu_stack_checks(services)
    assert services["web"]["environment"]["TRAINBOARD_ENCRYPTION_KEY"] == "fernet-key-for-validation"
    # TORCH_VARIANT in .env still wins over the GPU file's default.
    env_file.write_text(env_file.read_text() + "TORCH_VARIANT=cpu\n")
    services = _resolved_compose(files=False, env_file=env_file)["services"]
    assert {services[n]["build"]["args"]["TORCH_VARIANT"] for n in APP_SERVICES} == {"cpu"}


def test_the_ci_override_puts_every_service_on_the_host_network_on_loopback_ports():
    services = _resolved_compose("docker/compose.hostnet.yml")["services"]
    for name, service in services.items():
        assert service["network_mode"] == "host", name
    # Below the ephemeral range (32768-60999): no test's client socket can hold them.
    assert services["postgres"]["command"] == ["postgres", "-c", "port=25432", "-c", "listen_addresses=127.0.0.1"]
    assert services["redis"]["command"][-4:] == ["--port", "26379", "--bind", "127.0.0.1"]
    assert "--bind 127.0.0.1:28000" in services["web"]["command"]
    assert services["flower"]["command"][-2:] == ["--address=127.0.0.1", "--port=25555"]
    assert services["gpubox-runner"]["environment"] == RUNNER_ENV  # the override adds no secret either
    for name in APP_SERVICES:
        assert services[name]["build"] == {"context": str(ROOT), "network": "host", "args": {"TORCH_VARIANT": "cpu"},
                                           "cache_from": ["trainboard-ci/deps-cache", "trainboard:latest"]}
    for name in DJANGO_SERVICES:
        env = services[name]["environment"]
        assert env["DATABASE_URL"] == "postgres://trainboard:pw-for-validation@127.0.0.1:25432/trainboard", name
        assert env["REDIS_URL"] == "redis://127.0.0.1:26379/0", name
        assert services[name]["build"] == {"context": str(ROOT), "network": "host", "args": {"TORCH_VARIANT": "cpu"},
                                           "cache_from": ["trainboard-ci/deps-cache", "trainboard:latest"]}
    # The production file itself is what CI builds and starts: the override changes none of this.
    assert services["gpubox-worker-a"]["pid"] == "service:gpubox-runner"
    assert all("deploy" not in service for service in services.values())


def test_the_processes_that_need_the_schema_start_after_the_web_migrated_it():
    services = _resolved_compose()["services"]
    assert "web" not in services["web"]["depends_on"] and "migrate --noinput" in services["web"]["command"]
    for name in ("worker", "beat", "gpubox-worker-a", "flower"):
        assert services[name]["depends_on"]["web"] == {"condition": "service_healthy"}, name
        assert services[name]["depends_on"]["postgres"] == {"condition": "service_healthy"}, name
    assert set(services["gpubox-runner"]["depends_on"]) == {"postgres", "redis"}  # it needs no schema: it starts no Django


def test_the_ci_override_ports_move_with_their_variables(monkeypatch):
    for name, port in (("POSTGRES", "21432"), ("REDIS", "21379"), ("WEB", "21000"), ("FLOWER", "21555")):
        monkeypatch.setenv(f"TRAINBOARD_HOSTNET_{name}_PORT", port)
    services = _resolved_compose("docker/compose.hostnet.yml")["services"]
    assert services["postgres"]["command"] == ["postgres", "-c", "port=21432", "-c", "listen_addresses=127.0.0.1"]
    assert "-p 21432" in services["postgres"]["healthcheck"]["test"][1]
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "-h", "127.0.0.1", "-p", "21379", "ping"]
    assert services["redis"]["command"][-4:] == ["--port", "21379", "--bind", "127.0.0.1"]
    assert "--bind 127.0.0.1:21000" in services["web"]["command"]
    assert "127.0.0.1:21000/healthz" in services["web"]["healthcheck"]["test"][-1]
    assert services["flower"]["command"][-1] == "--port=21555"
    for name in DJANGO_SERVICES:
        env = services[name]["environment"]
        assert env["DATABASE_URL"].endswith("@127.0.0.1:21432/trainboard") and env["REDIS_URL"] == "redis://127.0.0.1:21379/0"
        assert env["TRAINBOARD_BASE_URL"] == "http://127.0.0.1:21000"


def test_the_base_images_are_pinned_releases_and_the_files_agree():
    """docker/bases/images is what scripts/docker-bases.sh builds stand-ins of: the Dockerfile's Python
    base and compose's PostgreSQL and Redis, each a release (x.y.z / x.y), never a floating major tag."""
    listed = dict(line.split() for line in (ROOT / "docker/bases/images").read_text().splitlines()
                  if line.strip() and not line.startswith("#"))
    assert set(listed) == {"python", "postgres", "redis"}
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"ARG PYTHON_IMAGE={listed['python']}\n" in dockerfile
    assert [line for line in dockerfile.splitlines() if line.startswith("FROM ")] == [
        "FROM ${PYTHON_IMAGE} AS deps", "FROM deps AS builder", "FROM ${PYTHON_IMAGE}"]
    services = _resolved_compose()["services"]
    assert (services["postgres"]["image"], services["redis"]["image"]) == (listed["postgres"], listed["redis"])
    assert listed == {"python": "python:3.11.11-slim-bookworm", "postgres": "postgres:15.10-bookworm",
                      "redis": "redis:7.4.1-bookworm"}
