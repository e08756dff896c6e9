"""The Ray backend without a cluster: its settings, what it refuses before any call, the request it
builds (entrypoint, runtime_env, metadata), Ray's states, its price, and how it reads refusals from the
dashboard (an httpx transport answering as Ray 2.60's dashboard does; the real one is in
test_raybackend_cluster.py)."""

from __future__ import annotations

import io
import json
import shlex
import zipfile
from decimal import Decimal

import httpx
import pytest

from cloud_adapters import packaging
from cloud_adapters.base import CredentialsError, InvalidSpec, JobSpec, JobState, ProviderError
from cloud_adapters.pricing import INTERNAL_RATE_SOURCE, PriceRow, StaticPriceCatalog
from cloud_adapters.ray import states
from cloud_adapters.ray.backend import RayBackend
from cloud_adapters.registry import create_backend

ADDRESS = "http://ray-head.example:8265"


def backend(**config):
    return create_backend("ray", {"address": ADDRESS, **config})


def spec(**kw):
    return JobSpec(**{"job_name": "tb-job-9-a", "config": {"train": {"epochs": 1}}, "nodes": 1, "procs_per_node": 2,
                      "max_runtime_s": 3600, "tags": {"trainboard-job-id": "9"}, **kw})


def test_settings_are_checked_all_at_once_with_their_labels():
    with pytest.raises(InvalidSpec) as exc:
        create_backend("ray", {"python": "python; rm -rf /", "output_path": "relative/dir", "gpus_per_worker": -1,
                               "placement": "ANYWHERE", "region": "x"})
    assert exc.value.errors == {
        "region": ["region: unknown Ray setting (known: address, cluster, cpus_per_worker, gpus_per_worker, "
                   "max_workers, output_path, placement, python)."],
        "gpus_per_worker": ["GPUs per worker: expected a number from 0 to 64, got -1."],
        "placement": ["Placement: expected one of 'PACK', 'SPREAD', 'STRICT_PACK', 'STRICT_SPREAD', got 'ANYWHERE'."],
        "address": ["Dashboard address: required; the operator sets TRAINBOARD_RAY_ADDRESS (the Ray dashboard's "
                    "http://<head>:8265)."],
        "python": ["Python on the cluster: expected an absolute path or a command name, got 'python; rm -rf /'."],
        "output_path": ["Output directory: expected an absolute path of letters, digits and _ . + - /, got "
                        "'relative/dir'."],
    }


@pytest.mark.parametrize("address,message", [
    ("ray-head:8265", "expected the dashboard's http://<head>:8265, got 'ray-head:8265'."),
    ("ftp://ray-head:8265", "expected the dashboard's http://<head>:8265"),
    ("http://admin:pw@ray-head:8265", "no user, password, query or fragment in the URL"),
    ("http://ray-head:8265/?next=x", "no user, password, query or fragment in the URL"),
    ("http://ray-head:99999", "is not a URL"),
])
def test_the_address_is_a_plain_http_url(address, message):
    with pytest.raises(InvalidSpec) as exc:
        backend(address=address)
    assert message in exc.value.errors["address"][0]


def test_the_defaults_and_a_normalised_address():
    ray = backend(address="https://ray-head.example:8265/")
    assert ray.config == {"address": "https://ray-head.example:8265", "python": "python", "cluster": "",
                          "cpus_per_worker": 1, "gpus_per_worker": 0, "placement": "PACK", "max_workers": 16,
                          "output_path": "/tmp/trainboard-ray"}
    assert ray.capabilities.max_nodes == 16 and not ray.capabilities.spot
    assert RayBackend.queue == "celery" and not RayBackend.ambient_identity


@pytest.mark.parametrize("changes,field,message", [
    ({"nodes": 4, "procs_per_node": 8}, "nodes",
     "4 nodes × 8 processes = 32 Ray Train workers, but this Ray backend runs at most 16 per job."),
    ({"instance_type": "m5.large"}, "instance_type", "a Ray cluster places each worker by its resources"),
    ({"image": "ghcr.io/acme/train:1"}, "image", "runs in the Python environment of the cluster's nodes"),
    ({"spot": True}, "spot", "This backend has no spot capacity"),
])
def test_what_the_cluster_cannot_run_is_refused_before_any_call(changes, field, message):
    with pytest.raises(InvalidSpec) as exc:
        backend().validate(spec(**changes))
    assert exc.value.field == field and message in str(exc.value)


@pytest.mark.parametrize("changes,message", [
    ({"job_name": "tb job; echo"}, "job name 'tb job; echo': must be 1–63 letters, digits or '-'"),
    ({"env": {"RAY_ADDRESS": "ray://elsewhere:10001"}}, "env: RAY_ADDRESS is Ray's; remove it."),
    ({"secret_env": {"MASTER_PORT": "1"}}, "secret_env: MASTER_PORT is set by Trainboard for every job"),
    ({"env": {"TRAINBOARD_JOB_CONFIG": "{}"}}, "env: TRAINBOARD_JOB_CONFIG is set by Trainboard"),
    ({"config": {"code": {"script": "train.py", "framework": "tensorflow"}}},
     "code.framework 'tensorflow': a Ray backend runs torch ranks under Ray Train, or a Ray script"),
])
def test_the_job_itself_is_checked(changes, message):
    with pytest.raises(InvalidSpec) as exc:
        backend().validate(spec(**changes))
    assert message in str(exc.value)


def test_the_request_is_built_from_our_argv_and_the_job_config():
    ray = backend(python="/opt/ray/bin/python", cpus_per_worker=2, placement="SPREAD", output_path="/shared/tb")
    job = spec(nodes=2, procs_per_node=2, env={"TB_PLAIN": "x"}, secret_env={"TB_SECRET": "s3cr3t"},
               dataset_uri="s3://data/digits")
    assert shlex.split(ray.entrypoint(job)) == [
        "/opt/ray/bin/python", "-m", "trainer_pkg.ray_entry", "--workers", "4", "--cpus-per-worker", "2",
        "--gpus-per-worker", "0", "--placement", "SPREAD", "--max-runtime-s", "3600", "--name", "tb-job-9-a"]
    env = ray.runtime_env(job, "_ray_pkg_abc.zip")
    assert env["working_dir"] == "gcs://_ray_pkg_abc.zip" and "pip" not in env
    config = json.loads(env["env_vars"].pop("TRAINBOARD_JOB_CONFIG"))
    assert env["env_vars"] == {"PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0", "RAY_COLOR_PREFIX": "0",
                               "TB_PLAIN": "x", "TB_SECRET": "s3cr3t"}
    assert config["output"] == {"output_dir": "/shared/tb/tb-job-9-a", "checkpoint_dir": "/shared/tb/tb-job-9-a/checkpoints"}
    assert config["parallel"] == {"nodes": 2, "procs_per_node": 2} and config["data"] == {"uri": "s3://data/digits"}
    assert ray.metadata(job) == {"trainboard-job-id": "9", "trainboard-job-name": "tb-job-9-a",
                                 "trainboard-workers": "4"}
    assert "s3cr3t" not in ray.entrypoint(job) and "s3cr3t" not in json.dumps(ray.metadata(job))


def test_the_working_dir_zip_is_the_trainer_archive_and_depends_only_on_the_files():
    entries = packaging.archive_entries()
    first, second = packaging.deterministic_zip(entries), packaging.deterministic_zip(list(reversed(entries)))
    assert first == second
    with zipfile.ZipFile(io.BytesIO(first)) as archive:
        names = archive.namelist()
        assert "trainer_pkg/ray_entry.py" in names and "trainer_pkg/launch.py" in names
        # More than one top-level entry: Ray unpacks it as it is (a lone top directory would be stripped).
        assert len({n.split("/")[0] for n in names}) > 1
        assert {info.date_time for info in archive.infolist()} == {(1980, 1, 1, 0, 0, 0)}


@pytest.mark.parametrize("raw,state", [("PENDING", JobState.PENDING), ("RUNNING", JobState.RUNNING),
                                       ("STOPPED", JobState.CANCELLED), ("SUCCEEDED", JobState.SUCCEEDED),
                                       ("FAILED", JobState.FAILED), ("PAUSED", None)])
def test_rays_job_states_map_to_ours(raw, state):
    assert states.job_state(raw) is state


def test_rays_forwarded_line_prefix_is_read_off():
    line = "(RayTrainWorker pid=22368, ip=10.0.0.5) [launch] rank 0 of world size 2"
    assert states.unprefixed(line) == "[launch] rank 0 of world size 2"
    assert states.unprefixed("\x1b[36m(TrainController pid=7)\x1b[0m hi") == "hi"
    assert states.unprefixed("plain driver line") == "plain driver line"


def test_the_price_is_the_internal_rate_per_worker_hour():
    catalog = StaticPriceCatalog([PriceRow("ray", "lab", "worker", Decimal("0.30"), source=INTERNAL_RATE_SOURCE,
                                           usd_per_gpu_hour=Decimal("1.10"))])
    gpu = create_backend("ray", {"address": ADDRESS, "cluster": "lab", "gpus_per_worker": 2}, prices=catalog)
    assert gpu.price() == pytest.approx(2.50) and gpu.price_note() == ""  # 0.30 + 2 × 1.10
    other = create_backend("ray", {"address": ADDRESS, "cluster": "other"}, prices=catalog)
    assert other.price() == 0.0
    assert other.price_note() == ("no internal rate is set for Ray cluster other, so jobs here cost $0; an admin sets "
                                  "it in the price catalog (provider ray, region other, instance type worker, per "
                                  "worker-hour)")


# -- the dashboard's refusals, as Ray 2.60 answers them ----------------------------------------


def answering(ray: RayBackend, handler) -> RayBackend:
    ray._http = httpx.Client(base_url=ADDRESS, transport=httpx.MockTransport(handler))
    return ray


def test_a_refused_token_is_a_credentials_error_naming_what_to_store():
    seen = []

    def handler(request):
        seen.append(request.headers.get("authorization"))
        return httpx.Response(401, text="Unauthorized: missing or invalid token")

    ray = create_backend("ray", {"address": ADDRESS}, secrets={"token": "t0ken"})
    ray._http = None
    client = ray._client()
    assert client.headers["authorization"] == "Bearer t0ken"
    answering(ray, handler)
    with pytest.raises(CredentialsError) as exc:
        ray.describe(ray._handle("tb-job-9-a", 2))
    assert "the stored token is not accepted" in str(exc.value) and "t0ken" not in str(exc.value)


def test_a_job_of_the_same_name_that_is_not_trainboards_is_never_adopted():
    def handler(request):
        assert request.method == "GET" and request.url.path == "/api/jobs/tb-job-9-a"
        return httpx.Response(200, json={"submission_id": "tb-job-9-a", "status": "RUNNING", "metadata": {}})

    with pytest.raises(ProviderError) as exc:
        answering(backend(), handler).submit(spec())
    assert "has a job 'tb-job-9-a' that is not Trainboard's" in str(exc.value)


def test_a_job_the_cluster_forgot_is_a_lost_run_and_a_stop_of_it_is_no_error():
    ray = answering(backend(), lambda request: httpx.Response(404, text="Job tb-job-9-a does not exist"))
    status = ray.describe(ray._handle("tb-job-9-a", 2))
    assert (status.state, status.lost, status.instance_count) == (JobState.FAILED, True, 2)
    assert "no longer knows job tb-job-9-a: its head restarted" in status.failure_reason
    ray.cancel(ray._handle("tb-job-9-a", 2))
    assert ray.logs(ray._handle("tb-job-9-a", 2), "17") == ([], "17")


def test_the_log_cursor_is_a_byte_offset_and_a_partial_line_waits():
    text = "héllo\n(RayTrainWorker pid=1) TRAINBOARD_METRIC {}\npartial"
    ray = answering(backend(), lambda request: httpx.Response(200, json={"logs": text}))
    handle = ray._handle("tb-job-9-a", 2)
    lines, cursor = ray.logs(handle, "")
    assert lines == ["héllo", "(RayTrainWorker pid=1) TRAINBOARD_METRIC {}"]
    assert int(cursor) == len("héllo\n(RayTrainWorker pid=1) TRAINBOARD_METRIC {}\n".encode())
    assert ray.logs(handle, cursor) == ([], cursor)
    with pytest.raises(InvalidSpec):
        ray.logs(handle, "-3")


def test_many_jobs_are_described_from_one_listing():
    calls = []

    def handler(request):
        calls.append((request.method, request.url.path))
        if request.url.path == "/api/jobs/":
            return httpx.Response(200, json=[
                {"submission_id": "tb-job-1-a", "status": "RUNNING", "start_time": 1796650237388, "metadata": {}},
                {"submission_id": "tb-job-2-a", "status": "STOPPED", "message": "Job was intentionally stopped.",
                 "start_time": 1796650237388, "end_time": 1796650296113, "metadata": {}},
                {"submission_id": "someone-else", "status": "PENDING", "metadata": {}}])
        return httpx.Response(404, text="not found")

    ray = answering(backend(), handler)
    found = ray.describe_many([ray._handle(name, 2) for name in ("tb-job-1-a", "tb-job-2-a", "tb-job-3-a")])
    assert calls == [("GET", "/api/jobs/")]
    assert found["tb-job-1-a"].state is JobState.RUNNING and found["tb-job-1-a"].started_at.year == 2026
    assert found["tb-job-2-a"].state is JobState.CANCELLED
    assert found["tb-job-2-a"].failure_reason == "stopped on the Ray cluster (Job was intentionally stopped.)"
    assert found["tb-job-3-a"].state is JobState.FAILED and found["tb-job-3-a"].lost


def test_the_entrypoint_module_imports_neither_torch_nor_ray():
    import subprocess
    import sys
    from pathlib import Path

    probe = "import sys, trainer_pkg.ray_entry; print(sorted(m for m in ('torch', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[3], capture_output=True,
                         text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
