"""The backend page (``/backends/<id>/``) and ``GET /api/backends/{id}/queue/``, ``running-jobs/``,
``waiting-jobs/``: the backend's queue, its running jobs with the GPUs each holds, its waiting jobs in
the order they will start with why each waits; scoped to what the user may see, paged."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from jobs import services
from jobs.models import JobStateChoices as S, Team, TrainingJob

pytestmark = pytest.mark.django_db


def _job(owner, dataset, model, backend, *, state=S.QUEUED, gpus=(), reason="", priority=0, name=""):
    job = services.training_job_create(owner=owner, dataset=dataset, model_spec=model, backend=backend,
                                       nodes=1, procs_per_node=1, epochs=1, name=name)
    # What the box's admission writes (jobs.admission), set directly: the rows are real, the box is not.
    TrainingJob.objects.filter(pk=job.pk).update(state=state, allocated_gpus=list(gpus), wait_reason=reason,
                                                 priority=priority)
    job.refresh_from_db()
    return job


@pytest.fixture
def shared_box(user, other_user, digits_dataset, cnn_model, local_backend):
    """alice's box "local", shared with bob through their team: alice's running job holds GPU 0,1,
    bob's GPU 2; three of alice's jobs wait (one of priority 5), one of bob's; one of alice's ended."""
    team = Team.objects.create(name="vision")
    team.members.add(user, other_user)
    for obj in (local_backend, digits_dataset, cnn_model):
        obj.team = team
        obj.save(update_fields=["team"])
    jobs = {
        "running": _job(user, digits_dataset, cnn_model, local_backend, state=S.RUNNING, gpus=[1, 0], name="big"),
        "bobs_running": _job(other_user, digits_dataset, cnn_model, local_backend, state=S.PENDING, gpus=[2]),
        "first": _job(user, digits_dataset, cnn_model, local_backend, reason="waiting for 4 GPUs on local (1 free)"),
        "second": _job(user, digits_dataset, cnn_model, local_backend, reason=""),
        "urgent": _job(user, digits_dataset, cnn_model, local_backend, priority=5,
                       reason="waiting: 2 jobs running, the limit of local is 2"),
        "bobs_waiting": _job(other_user, digits_dataset, cnn_model, local_backend, reason="waiting behind job #1"),
        "ended": _job(user, digits_dataset, cnn_model, local_backend, state=S.SUCCEEDED, gpus=[3]),
    }
    # bob's jobs are his own, not the team's: alice sees that they exist and hold devices, nothing else.
    return jobs


def _rows(page: str, section: str) -> list[str]:
    block = re.search(rf'<section class="card" id="{section}">(.*?)</section>', page, re.S).group(1)
    return [re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", row)).strip()
            for row in re.findall(r"<(?:tr|li)\b[^>]*>(.*?)</(?:tr|li)>", block, re.S)]


def _text(page: str, element_id: str) -> str:
    block = re.search(rf'<(\w+) [^>]*id="{element_id}"[^>]*>(.*?)</\1>', page, re.S).group(2)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", block)).replace(" )", ")").replace("( ", "(").strip()


def test_the_page_shows_the_queue_gpus_running_and_waiting_in_start_order(owner_client, local_backend, shared_box):
    j = shared_box
    response = owner_client.get(reverse("backend-detail", args=[local_backend.pk]))
    assert response.status_code == 200
    page = response.content.decode()
    assert '<code id="backend-queue">gpubox.local</code>' in page
    assert "Local GPU box (torchrun)" in page
    assert _rows(page, "backend-devices") == [f"device 0,1 → job #{j['running'].pk}", "device 2 → a job you cannot see"]
    # The box finds its GPUs itself (NVML on its own machine): the web says what is held, not what is free.
    assert _text(page, "devices-free").startswith("3 held. The box counts its devices itself")
    running = _rows(page, "backend-running")
    assert running[1:] == [f"big #{j['running'].pk} Running alice 0,1 –"]
    assert "1 + 1 you cannot see" in page
    waiting = _rows(page, "backend-waiting")[1:]
    assert [row.split(" ")[:2] for row in waiting] == [
        ["1", f"job-{j['urgent'].pk}"], ["2", f"job-{j['first'].pk}"], ["3", f"job-{j['second'].pk}"]]
    assert waiting[0].endswith("waiting: 2 jobs running, the limit of local is 2")
    assert waiting[1].endswith("waiting for 4 GPUs on local (1 free)")
    assert waiting[2].endswith("not yet picked up by a worker of gpubox.local")
    assert "3 + 1 you cannot see" in page
    assert f"#{j['ended'].pk}" not in page and f"#{j['bobs_waiting'].pk}" not in page


def test_a_box_whose_gpus_are_named_on_the_backend_shows_the_free_ones(owner_client, api_client, local_backend,
                                                                        shared_box):
    # Staff named the box's GPUs on the backend itself: every process reads the same list.
    services.backend_update(backend=local_backend, config={**local_backend.config, "gpu_ids": "0,1,2,3,5"})
    page = owner_client.get(reverse("backend-detail", args=[local_backend.pk])).content.decode()
    assert _text(page, "devices-free") == "Free: GPU 3,5 (2 of 5, from the backend's gpu_ids setting)"
    body = api_client.get(f"/api/backends/{local_backend.pk}/queue/").json()
    assert (body["devices_held"], body["devices_free"], body["device_kind"]) == ([0, 1, 2], [3, 5], "gpu")


def test_the_backends_list_and_a_jobs_page_link_the_backend_page(owner_client, local_backend, shared_box):
    url = reverse("backend-detail", args=[local_backend.pk])
    assert f'<a href="{url}"><strong>local</strong></a>' in owner_client.get(reverse("backend-list")).content.decode()
    job_page = owner_client.get(reverse("job-detail", args=[shared_box["first"].pk])).content.decode()
    assert f'<a href="{url}" id="job-backend-link">local</a>' in job_page


def test_a_teammate_sees_the_shared_box_with_his_own_jobs_only(other_client, local_backend, shared_box):
    j = shared_box
    page = other_client.get(reverse("backend-detail", args=[local_backend.pk])).content.decode()
    assert _rows(page, "backend-devices") == ["device 0,1 → a job you cannot see", f"device 2 → job #{j['bobs_running'].pk}"]
    waiting = _rows(page, "backend-waiting")[1:]
    assert len(waiting) == 1 and waiting[0].startswith(f"1 job-{j['bobs_waiting'].pk}")
    assert "1 + 3 you cannot see" in page


def test_a_stranger_gets_404_on_the_page_and_the_api(client, api_client, django_user_model, local_backend, shared_box):
    mallory = django_user_model.objects.create_user("mallory", password="pw")
    client.force_login(mallory)
    assert client.get(reverse("backend-detail", args=[local_backend.pk])).status_code == 404
    api_client.force_authenticate(mallory)
    for path in ("queue", "running-jobs", "waiting-jobs"):
        assert api_client.get(f"/api/backends/{local_backend.pk}/{path}/").status_code == 404
    assert client.get(reverse("backend-detail", args=[999999])).status_code == 404


def test_the_api_gives_the_queue_and_pages_the_jobs(api_client, local_backend, shared_box):
    j = shared_box
    body = api_client.get(f"/api/backends/{local_backend.pk}/queue/").json()
    assert body == {
        "queue": "gpubox.local", "running_count": 1, "waiting_count": 3, "others_running": 1, "others_waiting": 1,
        "devices_in_use": [{"devices": [0, 1], "job": j["running"].pk}, {"devices": [2], "job": None}],
        "devices_held": [0, 1, 2], "devices_free": None, "device_kind": None,
    }
    waiting = api_client.get(f"/api/backends/{local_backend.pk}/waiting-jobs/?limit=2").json()
    assert waiting["count"] == 3 and waiting["next"] is not None
    assert [(row["id"], row["priority"], row["wait_reason"]) for row in waiting["results"]] == [
        (j["urgent"].pk, 5, "waiting: 2 jobs running, the limit of local is 2"),
        (j["first"].pk, 0, "waiting for 4 GPUs on local (1 free)")]
    rest = api_client.get(waiting["next"]).json()
    assert [row["id"] for row in rest["results"]] == [j["second"].pk] and rest["next"] is None
    running = api_client.get(f"/api/backends/{local_backend.pk}/running-jobs/").json()
    assert [(row["id"], row["state"], row["owner"], row["allocated_gpus"]) for row in running["results"]] == [
        (j["running"].pk, "RUNNING", "alice", [1, 0])]


def test_the_waiting_list_is_paged_and_a_bad_page_shows_the_nearest(owner_client, user, digits_dataset, cnn_model,
                                                                   local_backend):
    template = _job(user, digits_dataset, cnn_model, local_backend, reason="waiting for 1 GPU on local (0 free)")
    clones = []
    for i in range(26):
        clone = TrainingJob.objects.get(pk=template.pk)
        clone.pk = None
        clone.name = f"clone-{i:02d}"
        clones.append(clone)
    TrainingJob.objects.bulk_create(clones)
    url = reverse("backend-detail", args=[local_backend.pk])
    first = owner_client.get(url).content.decode()
    assert len(_rows(first, "backend-waiting")) == 1 + 25
    assert "Page 1 of 2" in first and "?waiting=2" in first
    second = owner_client.get(url + "?waiting=2").content.decode()
    rows = _rows(second, "backend-waiting")[1:]
    assert len(rows) == 2 and rows[0].startswith("26 ") and rows[1].startswith("27 ")
    for bad in ("0", "-1", "x", "99", "1" * 40):
        response = owner_client.get(url + f"?waiting={bad}&running={bad}")
        assert response.status_code == 200


def test_a_backend_whose_scheduler_queues_shows_no_devices_and_the_schedulers_state(owner_client, user,
                                                                                  digits_dataset, cnn_model):
    # A cloud backend stands for every backend that submits at once (Slurm, Kubernetes, the clouds): its
    # jobs wait in the provider's queue, which says why (Slurm's pending reason), not in Trainboard's.
    backend = services.backend_create(owner=user, name="sm", kind="sagemaker",
                                      config={"role_arn": "arn:aws:iam::123456789012:role/x", "bucket": "tb-bucket",
                                              "region": "us-east-1"},
                                      secrets={"aws_access_key_id": "AKIAEXAMPLE", "aws_secret_access_key": "s"})
    pending = _job(user, digits_dataset, cnn_model, backend, state=S.PENDING, name="in-line")
    TrainingJob.objects.filter(pk=pending.pk).update(raw_state="InProgress", secondary_state="Starting")
    queued = _job(user, digits_dataset, cnn_model, backend, name="not-sent")
    page = owner_client.get(reverse("backend-detail", args=[backend.pk])).content.decode()
    assert 'id="backend-devices"' not in page and "GPU" not in page
    assert _rows(page, "backend-running")[1].split(" ")[:3] == ["in-line", f"#{pending.pk}", "Pending"]
    assert "InProgress (Starting)" in _rows(page, "backend-running")[1]
    assert "not yet submitted: once submitted, the backend's own scheduler queues them" in page
    assert _rows(page, "backend-waiting")[1].startswith(f"1 not-sent #{queued.pk}")
