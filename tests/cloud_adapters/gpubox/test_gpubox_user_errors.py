"""A user's script that fails on the GPU box (real torchrun, real processes): the job's failure reason
names the file and line of the user's code and its frame — ``train.py:3: SyntaxError: invalid syntax``
with the offending line — not the last line alone, nor torchrun's summary."""

from __future__ import annotations

import json

import pytest

from cloud_adapters.base import JobSpec, JobState
from cloud_adapters.gpubox import GpuBoxBackend
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
def test_a_failing_script_names_its_file_line_and_frame(backend, tmp_path, files, expected):
    bundle = code_bundle(tmp_path / "store", files)
    handle = backend.submit(JobSpec(job_name="tb-broken", config=json.loads(json.dumps(SCRIPT)), procs_per_node=2,
                                    code=bundle))
    status = wait_terminal(backend, handle)
    assert status.state is JobState.FAILED
    reason = status.failure_reason
    assert reason.startswith("rank ") and f": {expected[0]}" in reason, reason
    assert expected[1] in reason, reason
    assert "ChildFailedError" not in reason and "Root Cause" not in reason
