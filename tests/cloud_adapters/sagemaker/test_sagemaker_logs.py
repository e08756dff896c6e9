"""SageMakerBackend.logs against moto's CloudWatch Logs: one stream per instance (clouds.md §1.4), a
cursor that resumes each stream, instance prefixes on plain lines, metric lines passed unchanged."""

from __future__ import annotations

import json
import time

import boto3
import pytest
from moto import mock_aws

from cloud_adapters.base import InvalidSpec, JobHandle
from cloud_adapters.sagemaker import logs as cw_logs
from sagemaker_standin import make_backend
from trainer_pkg.metrics import format_metric_line, parse_metric_line

NAME = "tb-job-5-abc"
GROUP = "/aws/sagemaker/TrainingJobs"
STREAM_1 = f"{NAME}/algo-1-1764417600"
STREAM_2 = f"{NAME}/algo-2-1764417601"
NOW_MS = int(time.time() * 1000) - 60_000  # CloudWatch refuses events older than 14 days


def handle(count: int = 2) -> JobHandle:
    return JobHandle(provider="sagemaker", job_name=NAME,
                     extra={"training_job_name": NAME, "region": "us-east-1", "instance_count": count})


def put(client, stream: str, messages: list[tuple[int, str]]) -> None:
    client.put_log_events(logGroupName=GROUP, logStreamName=stream,
                          logEvents=[{"timestamp": t, "message": m} for t, m in messages])


@pytest.fixture
def cw():
    with mock_aws():
        client = boto3.client("logs", region_name="us-east-1")
        client.create_log_group(logGroupName=GROUP)
        client.create_log_stream(logGroupName=GROUP, logStreamName=STREAM_1)
        yield client


def test_two_streams_cursor_resumes_metric_lines_unchanged(cw):
    backend = make_backend()
    record = {"event": "step", "step": 10, "epoch": 0, "train_loss": 0.5, "time": 1764417700.0, "world_size": 4}
    metric = format_metric_line(record)
    put(cw, STREAM_1, [(NOW_MS, "[launch] platform: sagemaker (SM_HOSTS is set)\n"),
                       (NOW_MS + 2000, metric + "\n")])

    lines, cursor = backend.logs(handle(), "")
    assert lines == ["[algo-1] [launch] platform: sagemaker (SM_HOSTS is set)", metric]
    assert parse_metric_line(lines[1]) == record
    assert set(json.loads(cursor)["streams"]) == {STREAM_1}

    # Nothing new: no lines, same position.
    again, cursor2 = backend.logs(handle(), cursor)
    assert again == [] and json.loads(cursor2) == json.loads(cursor)

    # The second instance starts logging; the first writes more. Merged by event time.
    cw.create_log_stream(logGroupName=GROUP, logStreamName=STREAM_2)
    put(cw, STREAM_2, [(NOW_MS + 1000, "[launch] node_rank 1 of 2 node(s)"), (NOW_MS + 5000, "rank 2 ready")])
    put(cw, STREAM_1, [(NOW_MS + 3000, "epoch 0 done\r\n")])
    lines, cursor3 = backend.logs(handle(), cursor)
    assert lines == ["[algo-2] [launch] node_rank 1 of 2 node(s)", "[algo-1] epoch 0 done", "[algo-2] rank 2 ready"]
    assert set(json.loads(cursor3)["streams"]) == {STREAM_1, STREAM_2}
    assert backend.logs(handle(), cursor3)[0] == []


def test_single_instance_lines_are_not_prefixed(cw):
    put(cw, STREAM_1, [(NOW_MS, "hello\nworld")])  # one event, two lines
    lines, _ = make_backend().logs(handle(count=1), "")
    assert lines == ["hello", "world"]


def test_no_log_group_yet_means_no_lines():
    with mock_aws():
        lines, cursor = make_backend().logs(handle(), "")
    assert lines == [] and cursor == ""


def test_a_foreign_cursor_is_rejected(cw):
    with pytest.raises(InvalidSpec):
        make_backend().logs(handle(), "12345")


def test_a_call_returns_at_most_max_lines(cw):
    put(cw, STREAM_1, [(NOW_MS + i, f"line {i}") for i in range(30)])
    client = make_backend().client("logs")
    first, cursor = cw_logs.tail(client, NAME, "", prefix_hosts=False, max_lines=20)
    rest, _ = cw_logs.tail(client, NAME, cursor, prefix_hosts=False, max_lines=20)
    assert first == [f"line {i}" for i in range(20)] and rest == [f"line {i}" for i in range(20, 30)]
