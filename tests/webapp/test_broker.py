"""The embedded broker (webapp.broker): message files appear in the queue folder whole."""

import json
import os
import subprocess
import sys
import time

from kombu import Connection

from webapp import broker


def _options(tmp_path):
    folders = {name: tmp_path / name for name in ("queue", "staging", "processed", "control")}
    for folder in folders.values():
        folder.mkdir()
    return {
        "data_folder_in": str(folders["queue"]),
        "data_folder_out": str(folders["queue"]),
        "data_folder_processed": str(folders["processed"]),
        "staging_folder": str(folders["staging"]),
        "control_folder": str(folders["control"]),
    }


def test_a_message_is_complete_before_it_enters_the_queue_folder(tmp_path, monkeypatch):
    options = _options(tmp_path)
    renames = []
    real_replace = os.replace

    def spy(src, dst):
        # At the moment it becomes visible, the file is already whole and nothing of it is in the queue.
        renames.append((src, dst, open(src, "rb").read(), os.listdir(options["data_folder_out"])))
        real_replace(src, dst)

    monkeypatch.setattr(broker.os, "replace", spy)
    with Connection("filesystem://", transport=broker.Transport, transport_options=options) as conn:
        conn.SimpleQueue("jobs").put({"job_id": 7})
        src, dst, body, queue_before = renames[0]
        assert os.path.dirname(src) == options["staging_folder"]
        assert os.path.dirname(dst) == options["data_folder_out"] and dst.endswith(".jobs.msg")
        assert queue_before == []
        assert json.loads(body)["properties"]["delivery_info"]["routing_key"] == "jobs"
        message = conn.SimpleQueue("jobs").get(timeout=5)
        assert message.payload == {"job_id": 7}
        message.ack()
    assert os.listdir(options["staging_folder"]) == []


PRODUCER = """
import sys
from kombu import Connection
from webapp import broker
import json
options = json.loads(sys.argv[1])
with Connection("filesystem://", transport=broker.Transport, transport_options=options) as conn:
    queue = conn.SimpleQueue("load")
    for i in range(int(sys.argv[2])):
        queue.put({"i": i, "pad": "x" * 20000})
"""


def test_a_consumer_reads_every_message_of_a_concurrent_producer_intact(tmp_path):
    options = _options(tmp_path)
    count = 300
    producer = subprocess.Popen([sys.executable, "-c", PRODUCER, json.dumps(options), str(count)],
                                cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    seen = []
    deadline = time.monotonic() + 60
    with Connection("filesystem://", transport=broker.Transport, transport_options=options) as conn:
        queue = conn.SimpleQueue("load")
        while len(seen) < count and time.monotonic() < deadline:
            try:
                message = queue.get(timeout=0.5)
            except queue.Empty:
                continue
            assert message.payload["pad"] == "x" * 20000
            seen.append(message.payload["i"])
            message.ack()
    assert producer.wait(timeout=30) == 0
    assert sorted(seen) == list(range(count))
