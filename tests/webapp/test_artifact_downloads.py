"""A GPU-box job's artifacts on the job page and in the API: listed with size and sha256 (hashed once,
kept while the file is unchanged), downloaded as a stream with its headers, refused for a name the
job does not list, and guarded like the job (teammate 200, stranger 404, anonymous login / 401)."""

from __future__ import annotations

import datetime as dt
import hashlib
import os

import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from jobs import services
from jobs.models import JobArtifact, Team, TrainingJob

pytestmark = pytest.mark.django_db

MODEL = b"weights " * 1000
CKPT = b"checkpoint-bytes" * 77


@pytest.fixture
def box_job(user, digits_dataset, cnn_model, local_backend, run_root):
    """A job on the local GPU box whose run directory holds a model, metrics, a checkpoint, a log
    and a symbolic link to a file outside it."""
    job = services.training_job_create(owner=user, dataset=digits_dataset.pk, model_spec=cnn_model.pk,
                                       backend=local_backend.pk, nodes=1, procs_per_node=1, epochs=1,
                                       name="artifacts-job")
    run = run_root / "tb-job-art"
    (run / "output" / "checkpoints").mkdir(parents=True)
    (run / "output" / "model.pt").write_bytes(MODEL)
    (run / "output" / "metrics.jsonl").write_text('{"event": "epoch", "epoch": 0}\n')
    (run / "output" / "checkpoints" / "last.pt").write_bytes(CKPT)
    (run / "train.log").write_text("[rank0] done\n")
    (run_root / "secret.txt").write_text("a host file")
    os.symlink(run_root / "secret.txt", run / "output" / "leak.txt")
    TrainingJob.objects.filter(pk=job.pk).update(
        state="RUNNING", provider_handle={"provider": "gpubox", "job_name": run.name, "provider_job_id": str(run)})
    job.refresh_from_db()
    job.run_dir = run
    return job


def _api(user) -> APIClient:
    api = APIClient()
    api.force_authenticate(user)
    return api


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_api_lists_every_file_with_size_and_sha256_and_no_link(box_job, user):
    r = _api(user).get(f"/api/jobs/{box_job.pk}/artifacts/")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["error"] == ""
    rows = {a["name"]: (a["kind"], a["size_bytes"], a["sha256"], a["sha256_source"]) for a in body["results"]}
    assert rows == {
        "checkpoints/last.pt": ("checkpoint", len(CKPT), _sha(CKPT), "computed"),
        "logs/train.log": ("log", 13, _sha(b"[rank0] done\n"), "computed"),
        "metrics.jsonl": ("metrics", 31, _sha(b'{"event": "epoch", "epoch": 0}\n'), "computed"),
        "model.pt": ("model", len(MODEL), _sha(MODEL), "computed"),
    }
    model = next(a for a in body["results"] if a["name"] == "model.pt")
    assert model["download_url"] == f"http://testserver/api/jobs/{box_job.pk}/artifacts/model.pt/download/"


def test_an_unchanged_file_is_not_read_again_and_a_changed_one_is(box_job, user):
    api = _api(user)
    api.get(f"/api/jobs/{box_job.pk}/artifacts/")
    model = box_job.run_dir / "output" / "model.pt"
    stat = model.stat()
    # Same size and time, other bytes: the stored hash is kept, so the file was not read again.
    model.write_bytes(b"W" * len(MODEL))
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    rows = {a["name"]: a["sha256"] for a in api.get(f"/api/jobs/{box_job.pk}/artifacts/").json()["results"]}
    assert rows["model.pt"] == _sha(MODEL)
    # A new size: read and hashed anew.
    model.write_bytes(b"new weights")
    rows = {a["name"]: a["sha256"] for a in api.get(f"/api/jobs/{box_job.pk}/artifacts/").json()["results"]}
    assert rows["model.pt"] == _sha(b"new weights")
    # A file removed from the run directory leaves the listing.
    (box_job.run_dir / "train.log").unlink()
    names = [a["name"] for a in api.get(f"/api/jobs/{box_job.pk}/artifacts/").json()["results"]]
    assert names == ["checkpoints/last.pt", "metrics.jsonl", "model.pt"]
    assert sorted(JobArtifact.objects.filter(job=box_job).values_list("name", flat=True)) == names


def test_a_finished_job_is_listed_once_after_it_ended(box_job, user):
    TrainingJob.objects.filter(pk=box_job.pk).update(state="SUCCEEDED", ended_at=timezone.now() - dt.timedelta(seconds=5))
    api = _api(user)
    first = api.get(f"/api/jobs/{box_job.pk}/artifacts/").json()["results"]
    (box_job.run_dir / "output" / "extra.bin").write_bytes(b"late")
    second = api.get(f"/api/jobs/{box_job.pk}/artifacts/").json()["results"]
    assert [a["name"] for a in second] == [a["name"] for a in first]
    assert "extra.bin" not in [a["name"] for a in second]


def test_web_download_streams_the_file_as_an_attachment(box_job, owner_client):
    r = owner_client.get(f"/jobs/{box_job.pk}/artifacts/checkpoints/last.pt")
    assert r.status_code == 200
    assert b"".join(r.streaming_content) == CKPT
    assert r["Content-Length"] == str(len(CKPT))
    assert r["Content-Disposition"] == 'attachment; filename="last.pt"'
    assert r["Content-Type"] == "application/octet-stream"
    assert "no-store" in r["Cache-Control"]


def test_api_download_streams_the_same_bytes(box_job, user):
    r = _api(user).get(f"/api/jobs/{box_job.pk}/artifacts/model.pt/download/")
    assert r.status_code == 200
    data = b"".join(r.streaming_content)
    assert _sha(data) == _sha(MODEL) and r["Content-Length"] == str(len(MODEL))
    assert r["Content-Disposition"] == 'attachment; filename="model.pt"'


@pytest.mark.parametrize("name", ["../secret.txt", "checkpoints/../../secret.txt", "%2e%2e/secret.txt",
                                  "leak.txt", "no-such.pt", "checkpoints//last.pt", "./model.pt"])
def test_a_name_the_job_does_not_list_is_404(box_job, owner_client, user, name):
    assert owner_client.get(f"/jobs/{box_job.pk}/artifacts/{name}").status_code == 404
    assert _api(user).get(f"/api/jobs/{box_job.pk}/artifacts/{name}/download/").status_code == 404


def test_teammate_downloads_stranger_gets_404_anonymous_login(box_job, user, django_user_model):
    team = Team.objects.create(name="vision")
    mate = django_user_model.objects.create_user(username="mate", password="pw-mate-123")
    stranger = django_user_model.objects.create_user(username="stranger", password="pw-str-123")
    team.members.add(user, mate)
    TrainingJob.objects.filter(pk=box_job.pk).update(team=team)
    web = Client()
    web.force_login(mate)
    r = web.get(f"/jobs/{box_job.pk}/artifacts/model.pt")
    assert r.status_code == 200 and b"".join(r.streaming_content) == MODEL
    assert _api(mate).get(f"/api/jobs/{box_job.pk}/artifacts/").status_code == 200
    web.force_login(stranger)
    assert web.get(f"/jobs/{box_job.pk}/artifacts/model.pt").status_code == 404
    assert web.get(f"/jobs/{box_job.pk}/artifacts/").status_code == 404
    assert _api(stranger).get(f"/api/jobs/{box_job.pk}/artifacts/").status_code == 404
    assert _api(stranger).get(f"/api/jobs/{box_job.pk}/artifacts/model.pt/download/").status_code == 404
    anon = Client().get(f"/jobs/{box_job.pk}/artifacts/model.pt")
    assert anon.status_code == 302 and anon["Location"].startswith("/login/")
    assert APIClient().get(f"/api/jobs/{box_job.pk}/artifacts/model.pt/download/").status_code == 401


def test_job_page_fragment_shows_names_sizes_hashes_and_links(box_job, owner_client):
    page = owner_client.get(f"/jobs/{box_job.pk}/").content.decode()
    assert f'hx-get="/jobs/{box_job.pk}/artifacts/"' in page
    html = owner_client.get(f"/jobs/{box_job.pk}/artifacts/").content.decode()
    assert f'href="/jobs/{box_job.pk}/artifacts/checkpoints/last.pt"' in html
    assert f'title="{_sha(MODEL)}"' in html
    assert "7.8\xa0KB" in html  # 8,000 bytes
    assert "leak.txt" not in html


def test_a_lost_run_directory_says_so_and_keeps_the_last_listing(box_job, user, owner_client):
    api = _api(user)
    api.get(f"/api/jobs/{box_job.pk}/artifacts/")
    os.rename(box_job.run_dir, box_job.run_dir.with_name("moved"))
    body = api.get(f"/api/jobs/{box_job.pk}/artifacts/").json()
    assert "no longer exists" in body["error"]
    assert len(body["results"]) == 4
    r = owner_client.get(f"/jobs/{box_job.pk}/artifacts/model.pt")
    assert r.status_code == 502 and b"no longer exists" in r.content


def test_a_job_not_submitted_has_no_artifacts(user, digits_dataset, cnn_model, local_backend, owner_client):
    job = services.training_job_create(owner=user, dataset=digits_dataset.pk, model_spec=cnn_model.pk,
                                       backend=local_backend.pk, nodes=1, procs_per_node=1, epochs=1)
    assert _api(user).get(f"/api/jobs/{job.pk}/artifacts/").json() == {"results": [], "error": ""}
    assert "the job has not been submitted" in owner_client.get(f"/jobs/{job.pk}/artifacts/").content.decode()
    assert owner_client.get(f"/jobs/{job.pk}/artifacts/model.pt").status_code == 404


def test_a_running_jobs_new_file_downloads_without_hashing_anything(box_job, user):
    api = _api(user)
    api.get(f"/api/jobs/{box_job.pk}/artifacts/")
    hashed = dict(JobArtifact.objects.filter(job=box_job).values_list("name", "sha256"))
    (box_job.run_dir / "output" / "checkpoints" / "epoch-1.pt").write_bytes(b"written since the listing")
    (box_job.run_dir / "output" / "model.pt").write_bytes(b"rewritten")
    r = api.get(f"/api/jobs/{box_job.pk}/artifacts/checkpoints/epoch-1.pt/download/")
    assert r.status_code == 200 and b"".join(r.streaming_content) == b"written since the listing"
    r = api.get(f"/api/jobs/{box_job.pk}/artifacts/model.pt/download/")
    assert b"".join(r.streaming_content) == b"rewritten" and r["Content-Length"] == "9"
    # The downloads checked the names against the box's listing and stored nothing: the rows are
    # the list view's, hashes and all.
    assert dict(JobArtifact.objects.filter(job=box_job).values_list("name", "sha256")) == hashed
