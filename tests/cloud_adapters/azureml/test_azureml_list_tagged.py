"""AzureMLBackend.list_tagged against the Azure ML transport stand-in: a tagged job that has not ended
is listed with its name, tagged job id and a handle cancel() accepts; an untagged running job and
tagged jobs that ended are not; one paginated jobs list, no call per job."""

from __future__ import annotations

import pytest
from azureml_standin import AzureMLStandin, make_backend

from cloud_adapters.base import JobState

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                                        "ignore::UserWarning")  # azure-ai-ml's marshmallow schemas


def tags(name: str, job_id: str) -> dict[str, str]:
    return {"trainboard-job-name": name, "trainboard-job-id": job_id, "trainboard-owner-id": "1"}


def test_tagged_unfinished_jobs_are_listed_untagged_and_ended_are_not():
    st = AzureMLStandin(list_page_size=2)
    backend = make_backend(st)
    st.add_job("tb-job-41-aa", "Running", tags=tags("tb-job-41-aa", "41"))
    st.add_job("tb-job-43-cc", "Queued", tags=tags("tb-job-43-cc", "43"))
    st.add_job("tb-job-42-bb", "Completed", tags=tags("tb-job-42-bb", "42"))
    st.add_job("tb-job-44-dd", "Canceled", tags=tags("tb-job-44-dd", "44"))
    st.add_job("someone-elses", "Running", tags={"team": "vision"})

    listed = backend.list_tagged()

    assert sorted((p.name, p.job_id, p.state, p.raw_state) for p in listed) == [
        ("tb-job-41-aa", 41, JobState.RUNNING, "Running"),
        ("tb-job-43-cc", 43, JobState.PENDING, "Queued"),
    ]
    lists = st.calls("GET", r"/jobs$")
    assert len(lists) == 2 and all(c.query["tag"] == "trainboard-job-name" for c in lists)  # 4 tagged, 2 a page
    assert not st.calls("GET", r"/jobs/[^/]+$")  # no get per job

    backend.cancel(next(p.handle for p in listed if p.name == "tb-job-41-aa"))
    assert st.jobs["tb-job-41-aa"]["properties"]["status"] == "CancelRequested"
    assert {(p.name, p.state) for p in backend.list_tagged()} == {
        ("tb-job-41-aa", JobState.STOPPING), ("tb-job-43-cc", JobState.PENDING)}
