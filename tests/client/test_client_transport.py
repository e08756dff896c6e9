"""The client's own HTTP behaviour against a scripted peer on loopback (a real HTTP server in a thread,
standing in for what the Trainboard server cannot be made to do on cue): a proxy's 502/503/504 retried
with backoff for reads and never for writes, a 500 not retried, and ``follow`` yielding a transition
before the log lines a sync stored with it."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from trainboard_client.api import ApiError, Client, Unreachable

Answer = tuple[int, object]
Script = Callable[[str, str], Answer]


@pytest.fixture
def peer() -> Iterator[Callable[[Script], tuple[str, list[tuple[str, str]]]]]:
    """Start a loopback HTTP server answering with a script ``(method, path) -> (status, JSON body)``;
    gives its URL and the list of requests it saw. Stopped at the end, even on failure."""
    servers: list[ThreadingHTTPServer] = []

    def start(script: Script) -> tuple[str, list[tuple[str, str]]]:
        seen: list[tuple[str, str]] = []

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                seen.append((self.command, self.path))
                status, body = script(self.command, self.path)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{server.server_address[1]}", seen

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_proxys_502_503_504_are_retried_with_backoff_for_reads(peer):
    answers = iter([(502, {"detail": "bad gateway"}), (503, {}), (504, {}), (200, {"id": 7, "state": "RUNNING"})])
    url, seen = peer(lambda method, path: next(answers))
    retries: list[tuple[int, int, float, str]] = []
    with Client(url, "t", retries=4, backoff_s=0.001, on_retry=lambda *a: retries.append(a)) as client:
        assert client.job(7) == {"id": 7, "state": "RUNNING"}
    assert [path for _, path in seen] == ["/api/jobs/7/"] * 4
    assert [(a, n, reason) for a, n, _, reason in retries] == [
        (1, 5, f"{url} answered HTTP 502"), (2, 5, f"{url} answered HTTP 503"), (3, 5, f"{url} answered HTTP 504")]
    assert [delay for _, _, delay, _ in retries] == [0.001, 0.002, 0.004]  # doubling


def test_reads_give_up_after_the_retries_with_a_clear_error_and_writes_are_never_repeated(peer):
    url, seen = peer(lambda method, path: (503, {"detail": "unavailable"}))
    with Client(url, "t", retries=2, backoff_s=0.001) as client:
        with pytest.raises(Unreachable) as excinfo:
            client.job(1)
        assert str(excinfo.value) == (f"Server unreachable: {url} answered HTTP 503; gave up after 3 tries. Is the "
                                      f"server running, and is the URL right?")
        assert len(seen) == 3
        with pytest.raises(ApiError) as excinfo:  # a POST may have been acted on: one try, the answer shown
            client.cancel(1)
        assert excinfo.value.status == 503 and excinfo.value.lines() == ["unavailable"]
    assert [m for m, _ in seen] == ["GET", "GET", "GET", "POST"]


def test_a_500_is_an_answer_not_retried(peer):
    url, seen = peer(lambda method, path: (500, {"detail": "server error"}))
    with Client(url, "t", retries=4, backoff_s=0.001) as client:
        with pytest.raises(ApiError) as excinfo:
            client.job(1)
    assert (excinfo.value.status, len(seen)) == (500, 1)


def test_follow_yields_the_move_to_running_before_the_lines_the_same_sync_stored(peer):
    """A sync stores the move to RUNNING and the first epochs' lines together. Whenever it lands
    between the client's reads, the transition is printed first: the lines are read, then the job."""
    server = {"state": "PENDING", "events": [{"from_state": "", "to_state": "PENDING"}], "lines": []}

    def sync() -> None:
        server["state"] = "RUNNING"
        server["events"].append({"from_state": "PENDING", "to_state": "RUNNING"})
        server["lines"] += ["epoch 0 loss 1.0", "epoch 1 loss 0.5"]

    def script(method: str, path: str) -> Answer:
        if path.startswith("/api/jobs/3/logs/"):
            if server["state"] == "PENDING":
                sync()  # the sync commits just before this read
            elif server["state"] == "RUNNING":
                server["state"] = "SUCCEEDED"
                server["events"].append({"from_state": "RUNNING", "to_state": "SUCCEEDED"})
            after = int(path.split("after=")[1].split("&")[0])
            lines = [{"seq": i, "text": t} for i, t in enumerate(server["lines"]) if i > after]
            return 200, {"lines": lines, "next": len(server["lines"]) - 1, "more": False}
        return 200, {"id": 3, "state": server["state"], "events": list(server["events"])}

    url, _ = peer(script)
    with Client(url, "t") as client:
        got = [(kind, value["to_state"] if kind == "event" else value["state"] if kind == "state" else value)
               for kind, value in client.follow(3, poll_s=0.001)]
    assert got == [("event", "PENDING"), ("event", "RUNNING"), ("state", "RUNNING"), ("line", "epoch 0 loss 1.0"),
                   ("line", "epoch 1 loss 0.5"), ("event", "SUCCEEDED"), ("state", "SUCCEEDED")]


def test_follow_ends_when_its_stop_is_set_between_calls_and_while_waiting(peer):
    """``stop`` (a Ctrl-C handler's flag): follow returns at its next check, never inside a call; a long
    poll interval is cut short."""
    import time

    url, seen = peer(lambda method, path: (200, {"lines": [], "next": -1, "more": False}) if "/logs/" in path
                     else (200, {"id": 5, "state": "RUNNING", "events": []}))
    stop = threading.Event()
    with Client(url, "t") as client:
        started = time.monotonic()
        for kind, _ in client.follow(5, poll_s=600, stop=stop):
            if kind == "state":
                stop.set()  # as the handler would, mid-poll
        assert time.monotonic() - started < 60  # not the 600 s poll interval
    assert [path.split("?")[0] for _, path in seen] == ["/api/jobs/5/logs/", "/api/jobs/5/"]
