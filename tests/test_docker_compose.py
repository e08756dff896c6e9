"""docker-compose.yml is validated by Debian's docker-compose (no engine needed for `config`)."""

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


def _resolved_compose() -> dict:
    assert shutil.which("docker-compose"), "docker-compose missing: run `make system-deps`"
    env = {**os.environ, "POSTGRES_PASSWORD": "pw-for-validation", "DJANGO_SECRET_KEY": "key-for-validation",
           "TRAINBOARD_ENCRYPTION_KEY": "fernet-key-for-validation"}
    out = subprocess.run(
        ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )
    return yaml.safe_load(out.stdout)


def test_compose_has_every_service_with_postgres_and_redis():
    services = _resolved_compose()["services"]
    assert set(services) == {"postgres", "redis", "web", "worker", "beat", "gpubox-worker-a", "flower"}
    for name in ("web", "worker", "beat", "gpubox-worker-a", "flower"):
        env = services[name]["environment"]
        assert env["DATABASE_URL"].startswith("postgres://trainboard:pw-for-validation@postgres:5432/")
        assert env["REDIS_URL"] == "redis://redis:6379/0"
        # One key for all processes: what the web encrypts, the workers must decrypt.
        assert env["TRAINBOARD_ENCRYPTION_KEY"] == "fernet-key-for-validation"


@pytest.mark.django_db
def test_the_box_worker_consumes_its_own_queue_with_an_nvidia_reservation(monkeypatch):
    box = _resolved_compose()["services"]["gpubox-worker-a"]
    assert box["environment"]["TRAINBOARD_GPUBOX_NAME"] == "box-a"
    command = box["command"]
    assert command == ["python", "manage.py", "gpubox_worker", "--concurrency", "2", "--loglevel", "INFO"]
    devices = box["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert box["volumes"][0].startswith("runs:/var/lib/trainboard/runs")
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
