"""A user's script that fails on the GPU box (real torchrun, real processes): the job's failure reason
names the file and line of the user's code and its frame — ``train.py:3: SyntaxError: invalid syntax``
with the offending line — not the last line alone, nor torchrun's summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cloud_adapters.base import JobSpec, JobState
from cloud_adapters.gpubox import GpuBoxBackend
from cloud_adapters.torchrun_log import failure_summary_span
from test_gpubox_user_code import code_bundle, wait_terminal

SCRIPT = {"code": {"script": "train.py", "args": []}, "parallel": {"procs_per_node": 2}}


@pytest.fixture
def backend(tmp_path):
    return GpuBoxBackend({"run_root": str(tmp_path / "runs"), "max_procs_per_node": 2, "grace_period_s": 8})


@pytest.mark.parametrize("files, expected", [
    ({"train.py": "import sys\n\nx = = 1\n"},
     ["train.py:3: SyntaxError: invalid syntax", "x = = 1"]),
    ({"train.py": "from helpers import load\n\nload('shard-7')\n",
      "helpers.py": "def load(name):\n    raise ValueError(f'bad shard {name}')\n"},
     ["helpers.py:2 in load: ValueError: bad shard shard-7", "raise ValueError(f'bad shard {name}')"]),
])
def test_a_failing_script_names_its_file_line_and_frame_and_its_traceback_ends_the_log(
        backend, tmp_path, files, expected):
    bundle = code_bundle(tmp_path / "store", files)
    handle = backend.submit(JobSpec(job_name="tb-broken", config=json.loads(json.dumps(SCRIPT)), procs_per_node=2,
                                    code=bundle))
    status = wait_terminal(backend, handle)
    assert status.state is JobState.FAILED
    reason = status.failure_reason
    assert reason.startswith("rank ") and f": {expected[0]}" in reason, reason
    assert expected[1] in reason, reason
    assert "ChildFailedError" not in reason and "Root Cause" not in reason
    # The log with torchrun's own report (its traceback and summary) taken out ends with the
    # user's traceback: what the job page's log tail shows (jobs.selectors.training_job_log_tail).
    lines = (Path(handle.provider_job_id) / "train.log").read_text().splitlines()
    first, last = failure_summary_span(lines)
    assert "ChildFailedError" in "\n".join(lines[first:last + 1]) and lines[last].startswith("====")
    # torchrun's own log lines (its agent's "Sending process N closing signal SIGTERM" when one rank
    # outlives the other's failure, which load decides) are its report too.
    left = [ln for ln in lines[:first] + lines[last + 1:] if ln.strip() and "torch/distributed/elastic/" not in ln]
    # Both ranks raise at once: under load their tracebacks interleave line by line, so the user's
    # exception line is among the last few lines, not always the very last (seen once in a loaded run).
    assert expected[0].split(": ", 1)[1] in left[-4:], left[-12:]
    assert "torch/distributed" not in "\n".join(left), left[-12:]
