"""End to end: a user's own code on the GPU box, through the services, a real Celery worker (+ beat,
Redis, PostgreSQL) and real torchrun on 2 CPU ranks (gloo) — docs/user-code.md.

- a user's model archive (a small transformer written here, not in trainer_pkg) trained by our
  trainer with ddp, fsdp (one ``fully_shard`` per ``Block``) and pipeline (2 stages);
- a user's script with its own argparse and a ``requirements.txt`` installed from a wheel built here
  (pip's options are the box's: ``--no-index --find-links``), its own metric names charted, its
  environment built once and reused;
- the clean environment: the worker's database and broker URLs, Django's secret key, the encryption
  key and cloud credentials planted in the worker never reach a rank; the job's env and the
  backend's job secret do, and the secret is shown nowhere;
- a re-run after the model got a new archive trains the archive the first job ran;
- an ImportError in the user's code fails the job in seconds, naming the rank and the error.

One worker serves the whole module (its start is most of a short job's time); the three strategy
jobs run at once. Run::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/trainboard REDIS_URL=redis://127.0.0.1:6379/15 \\
        .venv/bin/python -m pytest tests/e2e/test_user_code.py -q -p no:cacheprovider
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from pathlib import Path

import pytest
from django.conf import settings as django_settings

from cloud_adapters import packaging
from cloud_adapters.gpubox.backend import RESERVED_ENV, GpuBoxBackend
from codekit import upload, zip_bytes
from jobs import services
from jobs.models import CodeArchive, JobLogLine, JobStateChoices as S, MetricPoint, TrainingJob
from user_code_kit import DEP_MARK, DEP_NAME, DEP_VERSION, build_wheel

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

REPO_ROOT = Path(__file__).resolve().parents[2]
BOX_NAME = "box"  # box_backend's name; the module's worker consumes its queue
JOB_TIMEOUT_S = 240  # one 2-rank job of 1-3 epochs takes 20-60 s on a loaded 2-core machine

# ---------------------------------------------------------------------------------------------
# The user's code, written here
# ---------------------------------------------------------------------------------------------

TINYFORMER_PY = '''\
"""A tiny transformer classifier: each row of an image is a token (8 tokens of 8 pixels for digits)."""
import math

import torch
from torch import nn
from torch.nn import functional as F

MARK = "{mark}"


class Embed(nn.Module):
    def __init__(self, input_shape, width):
        super().__init__()
        *lead, tokens, features = (1, *input_shape) if len(input_shape) == 1 else input_shape
        self.tokens = tokens
        self.proj = nn.Linear(math.prod(lead) * features, width)
        self.pos = nn.Parameter(torch.zeros(1, tokens, width))

    def forward(self, x):  # (B, C, T, F) -> (B, T, width)
        x = x.reshape(x.shape[0], -1, self.tokens, x.shape[-1]).transpose(1, 2).flatten(2)
        return self.proj(x) + self.pos


class Block(nn.Module):
    """Pre-norm self-attention and MLP, each with its residual."""

    def __init__(self, width, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self, width, num_classes):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, num_classes)

    def forward(self, x):  # (B, T, width) -> (B, num_classes)
        return self.fc(self.norm(x).mean(dim=1))


def build(num_classes, input_shape, width=32, depth=2):
    import os
    import trainer_pkg

    print(f"tinyformer {{MARK}} rank {{os.environ.get('RANK')}} trainer_pkg {{trainer_pkg.__file__}}", flush=True)
    return nn.Sequential(Embed(tuple(input_shape), width), *[Block(width) for _ in range(depth)],
                         Head(width, num_classes))
'''


def tinyformer_files(mark: str = "v1") -> dict[str, bytes]:
    return {"tinyformer/__init__.py": b"", "tinyformer/model.py": TINYFORMER_PY.format(mark=mark).encode(),
            "README.md": b"tinyformer: a user's model\n"}


SCRIPT_PY = f'''\
"""A user's own training loop: its own arguments, torch.distributed over gloo, its own metrics."""
import argparse

import torch
import torch.distributed as dist

import {DEP_NAME}
from trainer_pkg import report

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--tokens-per-step", type=float, default=100.0)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(1, args.steps + 1):
    seen = torch.tensor([float(rank + step)])
    dist.all_reduce(seen)  # the sum over both ranks: 2 * step + 1
    report.log(step=step, my_loss=1.0 / step, tokens_per_s=args.tokens_per_step * seen.item(),
               dep_mark=float({DEP_NAME}.MARK))
dist.destroy_process_group()
print(f"rank {{rank}} done", flush=True)
'''

ENV_DUMP_PY = '''\
"""Dumps each rank's whole environment beside the model and prints the token it was given."""
import json
import os

from trainer_pkg import report

rank = int(os.environ["RANK"])
with open(os.path.join(report.model_dir(), f"environ-rank{rank}.json"), "w") as fh:
    json.dump(dict(os.environ), fh)
print(f"rank {rank}: my token is {os.environ.get('TB_E2E_API_TOKEN', '<missing>')}", flush=True)
report.log(step=1, env_vars=float(len(os.environ)))
'''

BROKEN_PY = '''\
"""A model whose module imports a package that is not installed anywhere."""
import tb_e2e_no_such_module  # noqa: F401
from torch import nn


def build(num_classes, input_shape):
    return nn.Flatten()
'''

PLANTED = {
    # What a dashboard worker holds and a job must never see (docs/user-code.md, "clean environment"),
    # beside DATABASE_URL, REDIS_URL and DJANGO_SECRET_KEY, which the worker has anyway.
    "AWS_ACCESS_KEY_ID": "AKIAPLANTEDE2E000001",
    "AWS_SECRET_ACCESS_KEY": "planted-aws-secret-access-key-e2e",
    "AZURE_CLIENT_SECRET": "planted-azure-client-secret-e2e",
    "GOOGLE_APPLICATION_CREDENTIALS": "/planted/service-account.json",
}


# ---------------------------------------------------------------------------------------------
# One worker for the module
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Box:
    worker: object  # tests/conftest.py's WorkerProcess
    run_root: Path
    code_store: Path
    pip_args: str

    def run_dir(self, job: TrainingJob) -> Path:
        return self.run_root / job.provider_job_name


@pytest.fixture(scope="module")
def box(request, tmp_path_factory, django_db_setup, django_db_blocker, celery_worker_factory):
    """A GPU box with one Celery worker for the module: the test database, its own run root and
    code store, pip's options for the wheel built here, and :data:`PLANTED` in its environment."""
    started = time.monotonic()
    root = tmp_path_factory.mktemp("user-code-box")
    run_root = root / "runs"
    run_root.mkdir()
    code_store = root / "code-store"
    wheels = build_wheel(root / "wheels")
    pip_args = f"--no-index --find-links {wheels}"
    extra = {
        "TRAINBOARD_CODE_STORE": str(code_store),  # where the test process stores the archives
        "TRAINBOARD_ENCRYPTION_KEY": ",".join(django_settings.TRAINBOARD_ENCRYPTION_KEYS),  # the job secrets
        "TRAINBOARD_GPUBOX_PIP_ARGS": pip_args,
        "TRAINBOARD_GPUBOX_SLOTS": "6",  # three 2-process jobs at once (the box never shares a slot)
        **PLANTED,
    }
    with django_db_blocker.unblock():
        # The default queue and the queue of box_backend's box, "box" (gpubox.box).
        running = celery_worker_factory(root, run_root, extra,
                                        queues=f"celery,{GpuBoxBackend.queue_for(BOX_NAME, {})}")
        worker = running.__enter__()
    _say(request, f"worker ready in {time.monotonic() - started:.1f} s")
    try:
        yield Box(worker=worker, run_root=run_root, code_store=code_store, pip_args=pip_args)
    finally:
        with django_db_blocker.unblock():  # its exit waits for the worker's database sessions to end
            running.__exit__(None, None, None)
    _say(request, f"module total {time.monotonic() - started:.1f} s, the worker's start and stop included")


def _say(request, text: str) -> None:
    """Print ``text`` past pytest's output capture (a module fixture has no ``capsys``)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n[e2e user code] {text}", flush=True)


@pytest.fixture
def box_backend(box, user, settings):
    """A gpubox backend "box" on :func:`box`'s machine; this process's settings are the box's."""
    settings.TRAINBOARD_RUN_ROOT = box.run_root
    settings.TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE = 2
    settings.TRAINBOARD_CODE_STORE = box.code_store
    settings.TRAINBOARD_GPUBOX_PIP_ARGS = box.pip_args
    settings.TRAINBOARD_GPUBOX_SLOTS = 6
    return services.backend_create(owner=user, name=BOX_NAME, kind="gpubox",
                                   config={"hourly_rate_usd": 3.6, "grace_period_s": 3.0})


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


def _wait_all(box: Box, jobs: list[TrainingJob], timeout: float = JOB_TIMEOUT_S) -> list[TrainingJob]:
    def ended():
        now = [_reload(j) for j in jobs]
        return all(j.is_terminal for j in now) and now

    return box.worker.wait_for(ended, timeout=timeout, what=f"jobs {[j.pk for j in jobs]} to end")


def _log(job: TrainingJob) -> list[str]:
    return list(JobLogLine.objects.filter(job=job).order_by("seq").values_list("text", flat=True))


def _explain(box: Box, job: TrainingJob) -> str:
    return f"{job.state}: {job.failure_reason}\n" + "\n".join(_log(job)[-40:]) + "\n" + box.worker.log()[-2000:]


def _series(job: TrainingJob, name: str) -> list[tuple[int, float]]:
    return list(MetricPoint.objects.filter(job=job, name=name, rank__isnull=True).order_by("step")
                .values_list("step", "value"))


def _report(capsys, what: str, since: float, jobs: list[TrainingJob]) -> None:
    """Print how long the test took and, per job, from its creation to its first step and its end."""
    def phases(job: TrainingJob) -> str:
        first = f"{(job.first_step_at - job.created_at).total_seconds():.0f} s" if job.first_step_at else "-"
        return f"#{job.pk} first step {first}, ended {(job.ended_at - job.created_at).total_seconds():.0f} s"

    with capsys.disabled():
        print(f"\n[e2e user code] {what}: {time.monotonic() - since:.1f} s ({'; '.join(map(phases, jobs))})")


# ---------------------------------------------------------------------------------------------
# 1. A user's model, our trainer: ddp, fsdp, pipeline
# ---------------------------------------------------------------------------------------------


def test_a_user_transformer_trains_with_ddp_fsdp_and_pipeline(box, box_backend, user, digits_dataset, capsys):
    t0 = time.monotonic()
    files = tinyformer_files()
    model = services.model_spec_create(owner=user, name="tinyformer", kind="code",
                                       code=upload(zip_bytes(files), "tinyformer.zip"),
                                       entry_point="tinyformer.model:build", params={"width": 32, "depth": 2},
                                       shard_classes=["Block"])
    archive = CodeArchive.objects.get(pk=model.code_id)
    assert archive.file_count == 3 and archive.requirements == ""
    common = dict(owner=user, dataset=digits_dataset, model_spec=model, backend=box_backend, nodes=1,
                  procs_per_node=2, epochs=3, lr=3e-3, hyperparameters={"train": {"optimizer": "adamw"}})
    jobs = {
        "ddp": services.training_job_create(strategy="ddp", **common),
        "fsdp": services.training_job_create(strategy="fsdp", **common),
        "pipeline": services.training_job_create(strategy="pipeline", pipeline_stages=2, **common),
    }
    ended = dict(zip(jobs, _wait_all(box, list(jobs.values()))))
    summary = []
    for strategy, job in ended.items():
        assert job.state == S.SUCCEEDED, (strategy, _explain(box, job))
        assert job.config["model"]["arch"] == "custom" and job.config["parallel"]["strategy"] == strategy
        assert job.code_id == archive.pk and job.code.sha256 == archive.sha256
        assert job.config["code"]["sha256"] == archive.sha256
        val = _series(job, "val_accuracy")
        # one point per epoch; a 3-epoch run of this model reaches 0.8-0.95 on digits, chance is 0.1
        assert len(val) == 3, (strategy, val)
        assert val[-1][1] > 0.5, (strategy, val)
        code_dir = box.run_dir(job) / "code"
        unpacked = {p.relative_to(code_dir).as_posix() for p in code_dir.rglob("*") if p.is_file()}
        assert {name for name in unpacked if "__pycache__" not in name} == set(files)
        assert (code_dir / "tinyformer" / "model.py").read_bytes() == files["tinyformer/model.py"]
        built = [line for line in _log(job) if line.startswith("tinyformer v1 rank ")]
        assert {line.split()[3] for line in built} == {"0", "1"}, built  # the user's build ran on both ranks
        summary.append(f"{strategy} val_accuracy {val[-1][1]:.3f}")
    _report(capsys, f"3 strategy jobs at once ({', '.join(summary)})", t0, list(ended.values()))


# ---------------------------------------------------------------------------------------------
# 2. A user's script with its own requirements: metrics charted, environment reused
# ---------------------------------------------------------------------------------------------


def test_a_user_script_with_requirements_reports_its_own_metrics_and_reuses_its_environment(
        box, box_backend, user, digits_dataset, client, capsys):
    t0 = time.monotonic()
    files = {"train.py": SCRIPT_PY.encode(), "requirements.txt": f"{DEP_NAME}=={DEP_VERSION}\n".encode()}
    model = services.model_spec_create(owner=user, name="my-loop", kind="script",
                                       code=upload(zip_bytes(files), "loop.zip"), entry_point="train.py",
                                       script_args=["--steps", "4", "--tokens-per-step", "50"])
    first = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=model,
                                         backend=box_backend, procs_per_node=2, epochs=1)
    [first] = _wait_all(box, [first])
    assert first.state == S.SUCCEEDED, _explain(box, first)

    # Rank 0's records, as logged: 1/step, and tokens/step times the sum over both ranks (2 step + 1).
    assert _series(first, "my_loss") == [(s, pytest.approx(1.0 / s)) for s in (1, 2, 3, 4)]
    assert _series(first, "tokens_per_s") == [(s, pytest.approx(50.0 * (2 * s + 1))) for s in (1, 2, 3, 4)]
    assert {v for _, v in _series(first, "dep_mark")} == {float(DEP_MARK)}  # the wheel's module was imported

    env_dir = box.run_root / ".envs"
    [marker] = env_dir.glob("*/.trainboard-ready")
    before = marker.stat()
    log = _log(first)
    assert any(line.startswith("[environment] building environment") for line in log), log[:20]

    client.force_login(user)
    page = client.get(f"/jobs/{first.pk}/")
    assert page.status_code == 200
    metrics = client.get(f"/jobs/{first.pk}/metrics.json").json()
    assert {"my_loss", "tokens_per_s", "dep_mark"} <= set(metrics["metric_charts"])
    assert [p["y"] for p in metrics["series"]["tokens_per_s"]] == [150.0, 250.0, 350.0, 450.0]
    html = page.content.decode()
    assert "my_loss" in html and "tokens_per_s" in html

    second = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=model,
                                          backend=box_backend, procs_per_node=2, epochs=1)
    [second] = _wait_all(box, [second])
    assert second.state == S.SUCCEEDED, _explain(box, second)
    assert any(line.startswith("[environment] reusing environment") for line in _log(second)), _log(second)[:20]
    after = marker.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not built again
    assert len(list(env_dir.glob("*/.trainboard-ready"))) == 1
    assert _series(second, "my_loss") == _series(first, "my_loss")
    _report(capsys, "script job, then its re-use of the environment", t0, [first, second])


# ---------------------------------------------------------------------------------------------
# 3. The clean environment: none of the worker's variables, the job's env and secret, no leak
# ---------------------------------------------------------------------------------------------


def test_a_user_script_sees_none_of_the_workers_variables_and_its_secret_is_shown_nowhere(
        box, box_backend, user, digits_dataset, client, capsys):
    t0 = time.monotonic()
    token = f"tb-e2e-secret-{uuid.uuid4().hex}"
    services.backend_update(backend=box_backend, job_secrets={"TB_E2E_API_TOKEN": token})
    model = services.model_spec_create(owner=user, name="env-dump", kind="script",
                                       code=upload(zip_bytes({"dump.py": ENV_DUMP_PY.encode()}), "dump.zip"),
                                       entry_point="dump.py")
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=model, backend=box_backend,
                                       procs_per_node=2, epochs=1, env={"MY_SETTING": "hello from the job"})
    [job] = _wait_all(box, [job])
    assert job.state == S.SUCCEEDED, _explain(box, job)

    worker_env = box.worker.full_env
    for name in ("DATABASE_URL", "REDIS_URL", "DJANGO_SECRET_KEY", "TRAINBOARD_ENCRYPTION_KEY", *PLANTED):
        assert worker_env.get(name), f"{name} should be in the worker's environment for this test to mean anything"
    # What a job inherits from the worker (docs/user-code.md "GPU box: clean environment"), and what
    # torchrun and the launcher set in every rank, whose value may happen to be the worker's.
    inherited = {"PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "LOGNAME", "CUDA_VISIBLE_DEVICES"}
    set_in_every_rank = RESERVED_ENV | {"OMP_NUM_THREADS", "PYTHONUNBUFFERED"}
    worker_only = {k: v for k, v in worker_env.items()
                   if k not in inherited | set_in_every_rank and not k.startswith(("NCCL_", "TORCHELASTIC_", "TORCH_"))}
    for rank in (0, 1):
        seen = json.loads((box.run_dir(job) / "output" / f"environ-rank{rank}.json").read_text())
        assert seen["RANK"] == str(rank) and seen["WORLD_SIZE"] == "2"
        leaked = sorted(k for k in worker_only if k in seen and seen[k] == worker_only[k])
        assert leaked == [], f"rank {rank} sees the worker's {leaked}"
        for name in ("DATABASE_URL", "REDIS_URL", "DJANGO_SECRET_KEY", "TRAINBOARD_ENCRYPTION_KEY", *PLANTED):
            assert name not in seen, (rank, name)
            assert all(worker_env[name] not in value for value in seen.values()), (rank, name)
        assert seen["MY_SETTING"] == "hello from the job"
        assert seen["TB_E2E_API_TOKEN"] == token  # the backend's job secret arrived
        # the trainer snapshot and the job's code, not the worker's checkout
        paths = seen["PYTHONPATH"].split(":")
        assert str(box.run_dir(job) / "code") in paths and str(REPO_ROOT) not in paths, paths
        assert any(p.startswith(str(box.run_root / ".trainers") + "/") for p in paths), paths

    log = "\n".join(_log(job))
    assert "rank 0: my token is ***" in log and "rank 1: my token is ***" in log, log[-3000:]
    assert token not in log
    client.force_login(user)
    api = client.get(f"/api/jobs/{job.pk}/")
    assert api.status_code == 200 and token not in api.content.decode()
    for path in (f"/jobs/{job.pk}/", f"/jobs/{job.pk}/live/", f"/jobs/{job.pk}/metrics.json"):
        response = client.get(path)
        assert response.status_code == 200 and token not in response.content.decode(), path
    assert "my token is ***" in client.get(f"/jobs/{job.pk}/").content.decode()
    _report(capsys, "clean-environment job", t0, [job])


# ---------------------------------------------------------------------------------------------
# 4. A re-run trains what ran, whatever the model's archive and the checkout are now
# ---------------------------------------------------------------------------------------------


def test_a_rerun_trains_the_archive_and_trainer_snapshot_the_first_job_ran(box, box_backend, user, digits_dataset,
                                                                          capsys):
    t0 = time.monotonic()
    model = services.model_spec_create(owner=user, name="tinyformer-versions", kind="code",
                                       code=upload(zip_bytes(tinyformer_files("v1")), "v1.zip"),
                                       entry_point="tinyformer.model:build", params={"width": 16, "depth": 1})
    first = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=model, backend=box_backend,
                                         procs_per_node=2, epochs=1)
    [first] = _wait_all(box, [first])
    assert first.state == S.SUCCEEDED, _explain(box, first)

    model = services.model_spec_update(model_spec=model, code=upload(zip_bytes(tinyformer_files("v2")), "v2.zip"))
    assert model.code.sha256 != first.code.sha256
    rerun = services.training_job_rerun(job=first, owner=user)
    [rerun] = _wait_all(box, [rerun])
    assert rerun.state == S.SUCCEEDED, _explain(box, rerun)
    assert rerun.rerun_of_id == first.pk
    assert rerun.code.sha256 == first.code.sha256 == rerun.config["code"]["sha256"]
    assert 'MARK = "v1"' in (box.run_dir(rerun) / "code" / "tinyformer" / "model.py").read_text()
    assert any(line.startswith("tinyformer v1 rank ") for line in _log(rerun))
    assert not any(line.startswith("tinyformer v2") for line in _log(rerun))

    # The trainer the ranks import is a content-addressed snapshot of the checkout taken at submit,
    # recorded in the run directory, never the checkout itself: a later change to the checkout makes
    # a new snapshot for a later job and cannot reach this one.
    checkout_sha = packaging.build_archive(REPO_ROOT).sha256
    for job in (first, rerun):
        trainer = json.loads((box.run_dir(job) / "trainer.json").read_text())
        snapshot = Path(trainer["dir"])
        assert trainer["sha256"] == checkout_sha and snapshot == box.run_root / ".trainers" / checkout_sha[:16]
        assert Path(trainer["source"]) == REPO_ROOT
        assert ((snapshot / "trainer_pkg" / "train.py").read_bytes()
                == (REPO_ROOT / "trainer_pkg" / "train.py").read_bytes())
        imported = {line.rsplit(" ", 1)[1] for line in _log(job) if line.startswith("tinyformer v1 rank ")}
        assert imported == {str(snapshot / "trainer_pkg" / "__init__.py")}, imported
    _report(capsys, "job and its re-run", t0, [first, rerun])


# ---------------------------------------------------------------------------------------------
# 5. An error in the user's code fails the job fast, naming the rank and the error
# ---------------------------------------------------------------------------------------------


def test_an_import_error_in_the_users_model_fails_the_job_naming_the_rank(box, box_backend, user, digits_dataset,
                                                                         capsys):
    t0 = time.monotonic()
    model = services.model_spec_create(owner=user, name="broken", kind="code",
                                       code=upload(zip_bytes({"broken/__init__.py": b"",
                                                              "broken/net.py": BROKEN_PY.encode()}), "broken.zip"),
                                       entry_point="broken.net:build")
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=model, backend=box_backend,
                                       procs_per_node=2, epochs=1)
    [job] = _wait_all(box, [job], timeout=90)
    took = (job.ended_at - job.created_at).total_seconds()
    assert job.state == S.FAILED, _explain(box, job)
    assert took < 60, f"the job took {took:.0f} s to fail"
    reason = job.failure_reason
    assert re.match(r"trainer error: rank [01]: model\.entry_point broken\.net:build: importing broken\.net "
                    r"raised ModuleNotFoundError at broken/net\.py:2: No module named 'tb_e2e_no_such_module'",
                    reason), reason
    _report(capsys, f"import-error job: {reason}", t0, [job])
