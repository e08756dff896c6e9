"""Backend secrets never reach a Celery worker's log, nor what a job shows.

test_secrets.py searches the web process's responses and log records; this test runs a real
``celery worker -B`` process at DEBUG (Celery's ``--loglevel`` and Django's root logger), with a
job on each of a SageMaker, an Azure ML and a Vertex backend with planted credentials, and searches
the worker's whole stdout/stderr for them (jobs on three backends):

* SageMaker (planted access key id, secret key and session token): every AWS call goes to a loopback
  provider that answers each request ``UnrecognizedClientException`` quoting the request's
  ``Authorization`` and ``X-Amz-Security-Token`` headers (a provider careless with its error text).
  The submit fails, the job fails with the provider's message.
* Azure ML (a planted service principal): Microsoft Entra ID cannot be reached from here, so the submit's
  token requests fail (MSAL and azure-core log them at DEBUG) and the submit is retried later.
* Vertex (a planted service-account key): the stand-in (tests/cloud_adapters/vertex/standin.py) checks
  the key's tokens on every request; the job is submitted (code upload to the GCS emulator), synced,
  its logs read; then three syncs are refused with 403 messages quoting the bearer token; then the job
  fails. Every token the stand-in saw or issued counts as planted too.

Besides the log, the jobs' failure reason, status warning and events (all shown in the UI) are
searched.

Run with your own database and Redis db::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/trainboard_h3 REDIS_URL=redis://127.0.0.1:6379/10 \\
        .venv/bin/python -m pytest -q tests/security/test_worker_secrets.py
"""

from __future__ import annotations

import datetime as dt
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from adapter_standins import gcs_emulator, standin
from workerkit import CeleryWorker, database_url, wait_for_sessions_to_close

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]

vertex_standin = standin("vertex")


# --- a careless AWS ---------------------------------------------------------------------------------


class EchoingAws:
    """A loopback "AWS" that refuses every request, quoting the credentials it carried."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        aws = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = dict(self.headers.items())
                aws.seen.append(headers)
                body = json.dumps({
                    "__type": "com.amazon.coral.service#UnrecognizedClientException",
                    "message": f"The security token included in the request is invalid. Authorization: "
                               f"{headers.get('Authorization')}; X-Amz-Security-Token: "
                               f"{headers.get('X-Amz-Security-Token')}"}).encode()
                self.send_response(400)
                self.send_header("Content-Type", "application/x-amz-json-1.1")
                self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_GET = do_PUT = do_HEAD = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --- the worker -------------------------------------------------------------------------------------


class DebugWorker(CeleryWorker):
    """``celery worker -B`` at DEBUG in its own process group; all output in ``log_path``."""

    def __init__(self, tmp_path: Path, db_url: str, broker_url: str, encryption_keys: tuple[str, ...]) -> None:
        var_dir = tmp_path / "worker-var"
        var_dir.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "GOOGLE_", "AZURE_"))}
        env.update({
            "DJANGO_SETTINGS_MODULE": "webapp.settings",
            "DATABASE_URL": db_url,
            "REDIS_URL": broker_url,
            "TRAINBOARD_VAR_DIR": str(var_dir),
            "TRAINBOARD_RUN_ROOT": str(tmp_path / "runs"),
            "TRAINBOARD_ENCRYPTION_KEY": ",".join(encryption_keys),  # the rows were encrypted here
            "TRAINBOARD_LOG_LEVEL": "DEBUG",
            "TRAINBOARD_SYNC_INTERVAL_S": "1",
            "DJANGO_SECRET_KEY": "worker-secrets-test-key-not-for-production",
            "PYTHONPATH": str(REPO_ROOT),
            "PYTHONUNBUFFERED": "1",
            # No ambient cloud credentials: only the backends' stored ones can be in play.
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
            "CLOUDSDK_CONFIG": str(tmp_path / "no-gcloud"),
            "NO_GCE_CHECK": "True",
        })
        command = [sys.executable, "-m", "celery", "-A", "webapp", "worker", "-B",
                   "--scheduler", "celery.beat:PersistentScheduler", "-s", str(tmp_path / "beat-schedule"),
                   "-Q", "celery", "--pool", "prefork", "-c", "2", "-n", f"secrets-{uuid.uuid4().hex[:8]}@%h",
                   "--loglevel", "DEBUG", "--without-gossip", "--without-mingle"]
        log_path = tmp_path / "worker.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        super().__init__(proc, log_path)


@pytest.fixture
def debug_worker(transactional_db, tmp_path, settings):
    import redis
    from django.db import connection

    from webapp.celery import app

    broker_url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/10"
    redis.Redis.from_url(broker_url).flushdb()
    saved = app.conf.broker_url
    if app.conf.broker_url != broker_url:
        app.conf.broker_url = broker_url
        app.pool.force_close_all()
        app._pool = None
    worker = DebugWorker(tmp_path, database_url(connection.settings_dict), broker_url,
                         tuple(settings.TRAINBOARD_ENCRYPTION_KEYS))
    try:
        worker.wait_for(lambda: " ready." in worker.log(), timeout=120, what="the Celery worker to be ready")
        yield worker
    finally:
        worker.stop()
        wait_for_sessions_to_close(connection)
        if saved != app.conf.broker_url:
            app.conf.broker_url = saved
            app.pool.force_close_all()
            app._pool = None


@pytest.fixture
def vertex():
    server = vertex_standin.VertexStandIn().start()
    yield server
    server.stop()


@pytest.fixture
def gcs():
    with gcs_emulator() as url:
        yield url


@pytest.fixture
def echoing_aws():
    aws = EchoingAws()
    yield aws
    aws.stop()


# --- the test ---------------------------------------------------------------------------------------


def _finished_syncs(log: str) -> int:
    """Sync passes the worker has finished (Celery logs each task's end: "Task ...sync_backend[id] succeeded")."""
    return len(re.findall(r"sync_backend\[[^\]]+\] succeeded", log))


def _reload(job):
    job.refresh_from_db()
    return job


@pytest.mark.slow
def test_a_worker_at_debug_logs_no_planted_secret(debug_worker, user, digits_dataset, cnn_model, vertex, gcs,
                                                  echoing_aws):
    from jobs import services
    from jobs.models import JobEvent, TrainingJob

    # SageMaker, with keys and a session token planted.
    key_id = "AKIA" + uuid.uuid4().hex[:16].upper()
    aws_secret = "PLANTED-" + uuid.uuid4().hex
    session_token = "PLANTED-TOKEN-" + uuid.uuid4().hex
    sm = services.backend_create(owner=user, name="sm", kind="sagemaker", config={
        "region": "us-east-1", "role_arn": "arn:aws:iam::123456789012:role/SageMakerTraining", "bucket": "tb-bucket",
        "endpoint_url": echoing_aws.url}, secrets={"aws_access_key_id": key_id, "aws_secret_access_key": aws_secret,
                                                   "aws_session_token": session_token})
    # Vertex, with a planted service-account key the stand-in knows.
    email = f"tb-{uuid.uuid4().hex[:8]}@my-proj.iam.gserviceaccount.com"
    key_json, public = vertex_standin.service_account_key(email, token_uri=f"{vertex.url}/token")
    vertex.accept_key(email, public)
    vx = services.backend_create(owner=user, name="vx", kind="vertex", config={
        "project": "my-proj", "staging_bucket": "gs://stage/tb", "api_endpoint": vertex.url, "storage_endpoint": gcs,
        "accelerator_type": "NVIDIA_TESLA_T4", "accelerator_count": 1}, secrets={"service_account_json": key_json})

    # Azure ML, with a planted service principal: Entra ID is out of reach (no DNS here), so every
    # submit attempt fails getting a token, transiently.
    tenant, client, az_secret = str(uuid.uuid4()), str(uuid.uuid4()), "PLANTED-" + uuid.uuid4().hex
    az = services.backend_create(owner=user, name="az", kind="azureml", config={
        "subscription_id": str(uuid.uuid4()), "resource_group": "rg", "workspace": "tb-workspace", "compute": "gpu-cluster"},
        secrets={"tenant_id": tenant, "client_id": client, "client_secret": az_secret})

    def create(backend, name):
        return services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                            backend=backend, nodes=1, procs_per_node=1, epochs=1, name=name)

    sm_job = create(sm, "sm-job")
    vx_job = create(vx, "vx-job")
    create(az, "az-job")

    # SageMaker: the submit's first call is refused with the credentials quoted; the job fails.
    debug_worker.wait_for(lambda: _reload(sm_job).is_terminal, timeout=120, what="the SageMaker job to fail")
    assert sm_job.state == "FAILED", sm_job.failure_reason
    assert "UnrecognizedClientException" in sm_job.failure_reason
    assert echoing_aws.seen and all(f"Credential={key_id}/" in h["Authorization"] for h in echoing_aws.seen)
    assert {h["X-Amz-Security-Token"] for h in echoing_aws.seen} == {session_token}

    # Vertex: submitted, synced, logs read (every request with the stored key's credentials).
    debug_worker.wait_for(lambda: _reload(vx_job).provider_job_name and vertex.calls("POST", r"^/v2/entries:list$"),
                          timeout=180, what="the Vertex job to be submitted, synced and its logs read")
    assert vertex.created and {r.identity for r in vertex.requests if r.path.startswith("/v1/")} == {email}
    # Three syncs refused, the message quoting the bearer token; then the job fails at the provider.
    vertex.fail(403, method="GET", path_re=r"/customJobs", times=3, echo=True,
                message="Permission 'aiplatform.customJobs.list' denied on resource")
    fault = vertex.faults[-1]
    debug_worker.wait_for(lambda: fault.times == 0, timeout=60, what="three refused syncs")
    (name,) = vertex.jobs
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")  # the sync asks for changes since its last
    vertex.script(name, [{"state": "JOB_STATE_FAILED", "endTime": now, "updateTime": now,
                          "error": {"code": 13, "message": "The replica workerpool0-0 exited with a non-zero status."}}])
    vertex.step()
    debug_worker.wait_for(lambda: _reload(vx_job).is_terminal, timeout=60, what="the Vertex job to fail")
    assert vx_job.state == "FAILED"
    # Azure ML: the submit's token requests failed (retried with backoff), said so, and the job waits.
    debug_worker.wait_for(lambda: "could not reach Microsoft Entra ID" in debug_worker.log(), timeout=120,
                          what="the Azure ML submit to give up getting a token")
    # One more sync pass after that, so its lines are in the log searched below.
    syncs = _finished_syncs(debug_worker.log())
    debug_worker.wait_for(lambda: _finished_syncs(debug_worker.log()) > syncs, timeout=30, what="one more sync pass")

    # What was planted, and every credential derived from it that went over the wire.
    private_key_lines = [line for line in json.loads(key_json)["private_key"].splitlines()
                         if len(line) >= 40 and "-----" not in line]
    bearer = {r.headers["Authorization"].split(" ", 1)[1] for r in vertex.requests
              if r.headers.get("Authorization", "").startswith("Bearer ")}
    assert bearer and vertex.tokens
    planted = {"aws access key id": [key_id], "aws secret": [aws_secret], "aws session token": [session_token],
               "gcp private key": private_key_lines, "gcp tokens": sorted(bearer | set(vertex.tokens)),
               "azure service principal": [tenant, client, az_secret]}

    log = debug_worker.log()
    # The log is a DEBUG log of the worker that did all this, SDK requests included: the search has
    # something to search, and the credentials were where a log would have had them.
    assert log.count("Task jobs.tasks.submit_job[") >= 6  # received and done, three jobs
    assert "DEBUG botocore.endpoint: Sending http request:" in log and "DEBUG botocore.auth: CanonicalRequest:" in log
    assert "x-amz-security-token:[redacted]" in log and "Credential=[redacted]/" in log
    assert log.count("sync skipped: Vertex AI 403 Forbidden") == 3
    assert log.count("(request credentials: Bearer [redacted])") == 3
    leaks = {what: [v[:24] for v in values if v in log] for what, values in planted.items()}
    assert not any(leaks.values()), f"planted secrets in the worker's log: {leaks}"

    shown = [j.failure_reason + " " + j.status_warning for j in TrainingJob.objects.all()]
    shown += list(JobEvent.objects.values_list("message", flat=True))
    leaks = {what: [v[:24] for v in values if any(v in text for text in shown)] for what, values in planted.items()}
    assert not any(leaks.values()), f"planted secrets in what the jobs show: {leaks}"
