"""A local webhook receiver for tests: an HTTP server on 127.0.0.1 (a thread running
``http.server``) that answers POSTs with a scripted list of status codes and records each request
(headers and raw body), plus :func:`valid_signature`, the receiver's side of the HMAC check.

    with webhook_receiver([500, 200]) as receiver:
        ... receiver.url, receiver.requests ...

``hold=True`` makes an endpoint that takes every request and answers none until ``release()``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    status: int  # what the receiver answered (or will, once released)
    received_at: float  # time.time() when its body was read


@dataclass
class Receiver:
    url: str
    statuses: list[int]
    hold_s: float = 0.0  # seconds to wait before answering the first request (a slow endpoint)
    requests: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    released: threading.Event | None = None  # set: requests are answered; None: never held
    answered: int = 0

    def release(self) -> None:
        """Answer the held requests, and every later one at once."""
        if self.released is not None:
            self.released.set()

    def next_status(self) -> int:
        with self.lock:
            return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]


def valid_signature(secret: str, body: bytes, header: str) -> bool:
    """Whether ``header`` (X-Trainboard-Signature) is ``sha256=`` + HMAC-SHA256(secret, body)."""
    expected = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, header)


@contextlib.contextmanager
def webhook_receiver(statuses: list[int], *, hold_s: float = 0.0, hold: bool = False) -> Iterator[Receiver]:
    """A receiver answering the i-th POST with ``statuses[i]`` (the last one repeats); ``hold_s``:
    the first request is answered only after that many seconds; ``hold``: no request is answered
    until ``receiver.release()`` (released at exit). Stopped (and its port closed) at exit."""
    state: dict[str, Receiver] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            receiver = state["r"]
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            first = not receiver.requests
            status = receiver.next_status()
            with receiver.lock:
                receiver.requests.append(Received(self.path, {k: v for k, v in self.headers.items()}, body, status,
                                                  received_at=time.time()))
            if first and receiver.hold_s:
                time.sleep(receiver.hold_s)
            if receiver.released is not None:
                receiver.released.wait()
            payload = b'{"ok": true}' if status < 300 else b"receiver says no"
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                with receiver.lock:
                    receiver.answered += 1
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state["r"] = Receiver(url=f"http://127.0.0.1:{server.server_port}/hook", statuses=list(statuses), hold_s=hold_s,
                          released=threading.Event() if hold else None)
    thread = threading.Thread(target=server.serve_forever, name="webhook-receiver", daemon=True)
    thread.start()
    try:
        yield state["r"]
    finally:
        state["r"].release()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
