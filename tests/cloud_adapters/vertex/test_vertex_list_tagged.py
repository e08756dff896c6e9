"""VertexBackend.list_tagged against the Vertex AI REST stand-in: a labelled job that has not ended is
listed with its name and tagged job id and a handle cancel() accepts; an unlabelled running job and a
labelled job that ended are not; one filtered ListCustomJobs per non-final state."""

from __future__ import annotations

from cloud_adapters.base import JobSpec, JobState

PARENT = "projects/my-proj/locations/us-central1"


def spec(name: str, job_id: str) -> JobSpec:
    return JobSpec(job_name=name, config={"train": {"epochs": 1}}, nodes=1, procs_per_node=1, max_runtime_s=600,
                   tags={"trainboard-job-id": job_id, "trainboard-owner-id": "1"})


def test_labelled_unfinished_job_is_listed_unlabelled_and_ended_are_not(backend, vertex):
    running = backend.submit(spec("tb-job-41-aa", "41"))
    ended = backend.submit(spec("tb-job-42-bb", "42"))
    queued = backend.submit(spec("tb-job-43-cc", "43"))
    vertex.jobs[running.provider_job_id].update(state="JOB_STATE_RUNNING")
    vertex.jobs[ended.provider_job_id].update(state="JOB_STATE_SUCCEEDED")
    stranger = vertex.insert(PARENT, {"displayName": "not ours", "labels": {"team": "vision"}})
    vertex.jobs[stranger["name"]].update(state="JOB_STATE_RUNNING")
    before = len(vertex.requests)

    listed = backend.list_tagged()

    calls = vertex.requests[before:]
    assert sorted((p.name, p.job_id, p.state, p.raw_state) for p in listed) == [
        ("tb-job-41-aa", 41, JobState.RUNNING, "JOB_STATE_RUNNING"),
        ("tb-job-43-cc", 43, JobState.PENDING, "JOB_STATE_QUEUED"),
    ]
    assert {p.name: p.handle.provider_job_id for p in listed} == {
        "tb-job-41-aa": running.provider_job_id, "tb-job-43-cc": queued.provider_job_id}
    assert all(p.created_at is not None for p in listed)
    assert len(calls) == 6 and all(c.method == "GET" and c.path.endswith("/customJobs") for c in calls)
    assert sorted(c.query["filter"] for c in calls)[0] == \
        'labels.trainboard-job-name:* AND state="JOB_STATE_CANCELLING"'

    backend.cancel(next(p.handle for p in listed if p.name == "tb-job-41-aa"))
    assert vertex.jobs[running.provider_job_id]["state"] == "JOB_STATE_CANCELLING"
    assert {(p.name, p.state) for p in backend.list_tagged()} == {
        ("tb-job-41-aa", JobState.STOPPING), ("tb-job-43-cc", JobState.PENDING)}
