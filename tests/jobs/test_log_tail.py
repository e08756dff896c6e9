"""The job page's log tail of a failed script job ends with the user's traceback: torchrun's own report
of the failure (its ChildFailedError traceback and summary) is folded into one line there, and kept in
the full log (jobs.selectors.training_job_log_tail)."""

from __future__ import annotations

import html

import pytest
from django.test import Client
from django.urls import reverse

from jobs import dispatch, services
from jobs.models import JobLogLine
from jobs.selectors import training_job_log_lines, training_job_log_tail
from taskkit import sent_tasks

pytestmark = pytest.mark.django_db

USER = """\
[launch] rank 0 (local rank 0, node_rank 0) of world size 2, platform local via torchrun, master localhost:1
Traceback (most recent call last):
  File "/runs/tb-job-1/code/train.py", line 3, in <module>
    load('shard-7')
  File "/runs/tb-job-1/code/helpers.py", line 2, in load
    raise ValueError(f'bad shard {name}')
ValueError: bad shard shard-7"""
# torchrun's report as torch 2.13 prints it (its traceback abridged to three frames).
TORCHRUN = """\
W1206 13:05:25.600000 22694 /venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 22702 closing signal SIGTERM
E1206 13:05:25.684000 22694 /venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 22701) of binary: /venv/bin/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
trainer_pkg.launch FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-06_13:05:25
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 22701)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================"""


def test_the_tail_ends_with_the_users_traceback_and_the_full_log_keeps_torchruns_report(
        user, digits_dataset, cnn_model, local_backend):
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                           backend=local_backend, procs_per_node=2, name="broken")
    lines = (USER + "\n" + TORCHRUN).splitlines()
    JobLogLine.objects.bulk_create(JobLogLine(job=job, seq=i, text=t) for i, t in enumerate(lines))

    tail = training_job_log_tail(job=job)
    assert tail[:-1] == USER.splitlines()
    assert tail[-1] == ("[trainboard] torchrun's failure report (22 lines) folded: the failed rank and its error "
                        "are in the failure reason; the full log has it")
    assert training_job_log_tail(job=job, lines=3) == lines[-3:]  # not the whole report: left as it is
    assert [line.text for line in training_job_log_lines(job=job)] == lines  # the full log: every line

    page = Client()
    page.force_login(user)
    body = html.unescape(page.get(reverse("job-detail", args=[job.pk])).content.decode())
    shown = body[body.index('id="log-tail"'):]
    shown = shown[:shown.index("</pre>")]
    assert "ValueError: bad shard shard-7" in shown and "ChildFailedError" not in shown
