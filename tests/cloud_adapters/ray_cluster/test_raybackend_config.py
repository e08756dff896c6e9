"""The Ray backend without a cluster: its settings, what it refuses before any call, the request it
builds (entrypoint, runtime_env, metadata), Ray's states, its price, and how it reads refusals from the
dashboard (an httpx transport answering as Ray 2.60's dashboard does; the real one is in
test_raybackend_cluster.py)."""

from __future__ import annotations

import io
import json
import random
import shlex
import zipfile
from decimal import Decimal

import httpx
import pytest

from cloud_adapters import packaging
from cloud_adapters.base import CredentialsError, InvalidSpec, JobSpec, JobState, ProviderError, Throttled
from cloud_adapters.pricing import INTERNAL_RATE_SOURCE, PriceRow, StaticPriceCatalog
from cloud_adapters.ray import logtail, states
from cloud_adapters.ray.backend import MAX_LOG_LINES, RayBackend
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


# -- the job's log, read from its end (Ray 2.60's State API: GET /api/v0/logs/file?lines=N) ----------

NODE = "c849fc8526a6670af0ce570b015b6875be5f40859f11fa2e4530ebf4"


class RayLog:
    """A Ray dashboard that serves one job's driver log as Ray 2.60 does: ``GET /api/jobs/<id>`` with its
    ``driver_node_id`` (None until the driver starts), and ``GET /api/v0/logs/file`` the file's last
    ``lines`` lines (an unterminated last line counts as one: log_agent.py
    ``find_start_offset_last_n_lines_from_offset``; Ray answers 500 without a ``node_id``). Each tail
    request's ``lines`` is kept; the whole-log endpoint fails the test."""

    def __init__(self, data: bytes | str = b"", *, node: str | None = NODE, status: str = "RUNNING"):
        self.data = data.encode() if isinstance(data, str) else data
        self.node, self.status = node, status
        self.asked: list[int] = []
        self.details_calls = 0

    def write(self, text: str) -> None:
        self.data += text.encode()

    def __call__(self, request):
        path, query = request.url.path, request.url.params
        assert not path.endswith("/logs"), "the whole log was requested"
        if path == "/api/jobs/tb-job-9-a":
            self.details_calls += 1
            return httpx.Response(200, json={"submission_id": "tb-job-9-a", "status": self.status,
                                             "driver_node_id": self.node, "message": "", "metadata": {}})
        assert path == "/api/v0/logs/file" and query["submission_id"] == "tb-job-9-a"
        if not query.get("node_id"):
            return httpx.Response(500, text="500 Internal Server Error\n\nServer got itself in trouble")
        if self.node is None:
            return httpx.Response(500, text="Job tb-job-9-a has no driver node id info. This is likely a bug.")
        assert query["node_id"] == self.node
        lines = int(query["lines"])
        self.asked.append(lines)
        parts = self.data.split(b"\n")
        units = [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
        return httpx.Response(200, content=b"".join(units[-lines:]), headers={"content-type": "text/plain"})


def read_all(ray, handle, cursor, calls=None):
    """Every line ``logs`` gives from ``cursor`` until it gives none (as the sync drains a log)."""
    lines = []
    while True:
        more, cursor = ray.logs(handle, cursor)
        assert len(more) <= MAX_LOG_LINES + 1
        if calls is not None:
            calls.append(len(more))
        if not more:
            return lines, cursor
        lines += more


def test_the_log_is_read_from_its_tail_each_line_once_in_order_as_it_grows():
    log = RayLog(node=None, status="PENDING")
    ray = answering(backend(), log)
    handle = ray._handle("tb-job-9-a", 2)
    assert ray.logs(handle, "") == ([], "")  # no driver yet: nothing to read, the same cursor

    log.node, log.status = NODE, "RUNNING"
    log.write("héllo\n(RayTrainWorker pid=1) TRAINBOARD_METRIC {}\npartial")
    lines, cursor = ray.logs(handle, "")
    assert lines == ["héllo", "(RayTrainWorker pid=1) TRAINBOARD_METRIC {}"]  # the partial line waits
    assert cursor.startswith("t1:2:2:") and cursor.endswith(f":0:{NODE}")
    assert ray.logs(handle, cursor) == ([], cursor)
    assert log.details_calls == 2  # the driver's node is looked up until it is known, then travels in the cursor

    # Repeated identical lines, runs longer than the context, and growths of every size up to a few
    # reads' worth (9,000 lines: the tail doubles, then the backlog is handed over 2,000 lines a call).
    written = ["héllo", "(RayTrainWorker pid=1) TRAINBOARD_METRIC {}"]
    log.write(" line\n")
    written.append("partial line")
    read = 2
    rnd = random.Random(7)
    step = 0
    for growth in [1, 5, 40, 700, 3, 2500, 9000, 17, 0, 1999, 4100, 2]:
        for _ in range(growth):
            if rnd.random() < 0.05:
                step += 1
                line = f"(RayTrainWorker pid=2) step {step}"
            else:
                line = rnd.choice(["waiting for the batch", "waiting for the batch", "", "same line again"])
            written.append(line)
            log.write(line + "\n")
        log.asked.clear()
        calls = []
        more, cursor = read_all(ray, handle, cursor, calls)
        assert more == written[read:]
        read = len(written)
        assert all(n <= logtail.MAX_TAIL_LINES for n in log.asked), log.asked  # never the whole log
        assert log.asked[-1] == logtail.FIRST_TAIL_LINES  # nothing more: one request of the first size
        assert all(n <= MAX_LOG_LINES for n in calls)
        if growth == 9000:
            assert calls == [2000, 2000, 2000, 2000, 1000, 0] and max(log.asked) <= 16_000
    # A read that ends inside a run of one line, and a log that goes on with more of it.
    for text in ("marker A\n" + "tick\n" * 40, "tick\n" * 30 + "marker B\n"):
        log.write(text)
        more, cursor = read_all(ray, handle, cursor)
        assert more == text.splitlines()
        written += more
    lines, end = read_all(ray, handle, "")  # again from the start: the whole log, once
    assert lines == written and end == cursor
    assert log.details_calls == 3


def test_a_quiet_log_costs_one_bounded_request_per_call():
    log = RayLog("".join(f"line {i}\n" for i in range(100_000)))
    ray = answering(backend(), log)
    handle = ray._handle("tb-job-9-a", 2)
    first, cursor = ray.logs(handle, "")
    assert first[0].startswith("[trainboard] at least 30,000 lines of the Ray job's log were skipped")
    assert first[1:] == [f"line {i}" for i in range(98_000, 100_000)]
    log.asked.clear()
    for _ in range(3):
        assert ray.logs(handle, cursor) == ([], cursor)
    assert log.asked == [logtail.FIRST_TAIL_LINES] * 3
    log.write("line 100000\n")
    assert ray.logs(handle, cursor)[0] == ["line 100000"]


def test_a_growth_past_one_read_gives_a_notice_and_the_latest_lines():
    log = RayLog("".join(f"early {i}\n" for i in range(3000)))
    ray = answering(backend(), log)
    handle = ray._handle("tb-job-9-a", 2)
    lines, cursor = read_all(ray, handle, "")
    assert lines == [f"early {i}" for i in range(3000)]
    log.write("".join(f"burst {i}\n" for i in range(40_000)))
    log.asked.clear()
    lines, cursor = ray.logs(handle, cursor)
    assert log.asked == [2000, 4000, 8000, 16_000, 32_000]  # doubled to the cap, never the 43,000 lines
    assert lines[0] == ("[trainboard] at least 29,985 lines of the Ray job's log were skipped: it wrote more than "
                        "32,000 lines since the last read, more than one read takes; the log goes on with its "
                        "latest lines.")
    assert lines[1:] == [f"burst {i}" for i in range(38_000, 40_000)]
    assert cursor.startswith("t1:?:")  # where the tail began is not known
    assert ray.logs(handle, cursor) == ([], cursor)
    log.write("after 0\nafter 1\n")
    assert ray.logs(handle, cursor)[0] == ["after 0", "after 1"]


def test_a_byte_offset_of_the_old_reader_goes_on_where_it_was_or_from_the_end():
    # The old reader's offsets counted the log as Ray's whole-log endpoint returned it: text mode, where a
    # lone \r or \r\n ends a line too; the lines are split the same way now.
    log = RayLog(b"a\r\nb\rc\nd\ne")
    ray = answering(backend(), log)
    handle = ray._handle("tb-job-9-a", 2)
    assert ray.logs(handle, "")[0] == ["a", "b", "c", "d"]
    lines, cursor = ray.logs(handle, "6")  # after "a\nb\nc\n"
    assert lines == ["d"] and cursor.startswith("t1:3:3:")
    assert ray.logs(handle, "8")[0] == []

    long = RayLog("".join(f"line {i}\n" for i in range(50_000)))
    ray = answering(backend(), long)
    lines, cursor = ray.logs(handle, "123456")
    assert len(lines) == 1 and lines[0].startswith("[trainboard] Trainboard's reader of Ray logs changed: this "
                                                   "log was read to byte 123,456 before")
    assert max(long.asked) == logtail.MAX_TAIL_LINES
    assert ray.logs(handle, cursor) == ([], cursor)  # from the end: nothing repeated
    long.write("line 50000\n")
    assert ray.logs(handle, cursor)[0] == ["line 50000"]


@pytest.mark.parametrize("cursor", ["-3", "t1:x", "t1:5:0::0:", f"t2:5:5:{'0' * 32}:0:{NODE}", "t1:5:5:00:0:"])
def test_a_cursor_that_is_not_this_backends_is_refused(cursor):
    ray = answering(backend(), RayLog(b"x\n"))
    with pytest.raises(InvalidSpec):
        ray.logs(ray._handle("tb-job-9-a", 2), cursor)


def test_a_log_ray_cannot_serve_gives_no_lines_and_the_same_cursor():
    lines, cursor = (ray := answering(backend(), RayLog(b"x\n"))).logs(ray._handle("tb-job-9-a", 2), "")
    assert lines == ["x"]
    for answer in (httpx.Response(404, text="Not Found"),
                   httpx.Response(500, text="Could not find a log file. Please make sure the given option exists "
                                            "in the cluster.\n\tsubmission_id: tb-job-9-a\n"),
                   httpx.Response(500, text=f"Agent for node id: {NODE} doesn't exist.")):
        gone = answering(backend(), lambda request, answer=answer: answer)
        assert gone.logs(gone._handle("tb-job-9-a", 2), cursor) == ([], cursor)
    busy = answering(backend(), lambda request: httpx.Response(429, json={"result": False, "msg": "Max number"}))
    with pytest.raises(Throttled):
        busy.logs(busy._handle("tb-job-9-a", 2), cursor)


def test_a_failed_jobs_reason_is_read_from_the_last_lines_of_its_log():
    log = RayLog("".join(f"(RayTrainWorker pid=3) step {i}\n" for i in range(50_000)), status="FAILED")
    log.write("(RayTrainWorker pid=3) [rank 1] trainer error: ValueError: bad shard 7\n")
    ray = answering(backend(), log)
    status = ray.describe(ray._handle("tb-job-9-a", 2))
    assert status.state is JobState.FAILED
    assert status.failure_reason == "trainer error: ValueError: bad shard 7"
    assert log.asked == [2000]


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
