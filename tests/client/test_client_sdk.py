"""The Python SDK (``trainboard_client.Client``) against a live server (issue 32): log in, estimate,
create, list, follow, cancel, errors by field."""

from __future__ import annotations

import pytest

from jobs import dispatch, states
from jobs.models import TrainingJob
from taskkit import sent_tasks
from trainboard_client import ApiError, AuthError, Client
from trainboard_client.schema import job_fields

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_sdk_creates_lists_follows_and_cancels_a_job(live_server, user, digits_dataset, cnn_model, local_backend):
    with Client.login(live_server.url, "alice", "pw-alice-123", retries=0) as tb:
        fields = {f.name: f for f in job_fields(tb.schema())}
        assert fields["procs_per_node"].kind == "integer" and fields["procs_per_node"].minimum == 1
        assert fields["strategy"].choices == ("ddp", "fsdp", "pipeline")
        assert fields["backend"].required and not fields["epochs"].required and fields["epochs"].default == 3

        priced = tb.estimate(dataset="digits", model_spec="digits-cnn", backend="local", procs_per_node=2,
                             max_runtime_s=1800)
        assert (priced["estimated_cost_usd"], priced["world_size"], priced["job"]["id"]) == ("1.8000", 2, None)
        assert priced["job"]["config"]["parallel"]["procs_per_node"] == 2
        with pytest.raises(ApiError) as refused:
            tb.estimate(dataset="digits", model_spec="digits-cnn", backend="local", nodes=0, lr="fast")
        assert refused.value.status == 400
        assert refused.value.errors == {"nodes": ["Ensure this value is greater than or equal to 1."],
                                        "lr": ["A valid number is required."]}
        assert TrainingJob.objects.count() == 0

        with sent_tasks(dispatch.SUBMIT_JOB) as submit:
            made = tb.create_job(name="sdk-job", dataset="digits", model_spec="digits-cnn", backend="local",
                                 procs_per_node=2, epochs=2)
        submit.assert_called_once()
        job = TrainingJob.objects.get()
        assert (made["id"], made["state"]) == (job.pk, "QUEUED")
        assert (job.name, job.dataset_id, job.model_spec_id, job.procs_per_node, job.config["train"]["epochs"]) == (
            "sdk-job", digits_dataset.pk, cnn_model.pk, 2, 2)
        assert [j["id"] for j in tb.jobs(state="QUEUED")["results"]] == [job.pk]
        assert tb.jobs(state="FAILED")["results"] == []

        # The job moves as a worker's sync would move it; follow() reports each transition in order.
        states.transition(job, "SUBMITTING", message="Submitting")
        states.transition(job, "FAILED", message="exited 3", failure_reason="rank 0 exited with code 3")
        seen = [(kind, value["to_state"] if kind == "event" else value["state"])
                for kind, value in tb.follow(job.pk, poll_s=0.1) if kind != "line"]
        assert seen == [("event", "QUEUED"), ("event", "SUBMITTING"), ("event", "FAILED"), ("state", "FAILED")]
        assert tb.wait(job.pk)["failure_reason"] == "rank 0 exited with code 3"
        with pytest.raises(ApiError) as finished:
            tb.cancel(job.pk)
        assert finished.value.status == 400

    with Client(live_server.url, "not-a-token", retries=0) as stranger, pytest.raises(AuthError) as denied:
        stranger.jobs()
    assert denied.value.exit_code == 2 and "Log in again" in str(denied.value)
