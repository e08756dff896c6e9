"""Reading a Ray job's driver log from its end, a bounded amount per call (:meth:`RayBackend.logs`).

Ray 2.60 serves a log file's last lines: ``GET /api/v0/logs/file?submission_id=<id>&node_id=<driver node>
&lines=<N>`` (the State API, python/ray/dashboard/modules/state/state_head.py ``get_logs``;
ray/util/state/common.py ``GetLogOptions``). The dashboard agent on the driver's node reads the file
backwards in 64 KiB blocks until it has counted N newlines and streams from there to the end
(ray/dashboard/modules/log/log_agent.py ``find_start_offset_last_n_lines_from_offset``; an unterminated
last line counts as one of the N). ``node_id`` is required (without it Ray answers 500), though with a
``submission_id`` Ray reads the job's own ``driver_node_id`` (log_manager.py ``_resolve_job_filename``).
It takes no offset, so a read cannot ask for "what follows byte B"; it asks for a tail and finds in it
where the previous read ended. Ray bounds a tail by lines, not bytes: a request costs N lines' bytes.

The cursor says what was read: how many of the log's lines (when known), and a digest of the last
lines read (the *context*). A call fetches the last :data:`FIRST_TAIL_LINES` lines, doubling up to
:data:`MAX_TAIL_LINES` while the context is not inside the tail, and returns the lines after it:

* a tail shorter than asked is the whole file, and the line count places the previous end exactly
  (logs repeat lines: counting, not matching, decides there);
* in a longer tail the context is matched; of several matches the last wins (repeating no line).
  The context is the shortest suffix of what was read with :data:`CONTEXT_LINES` lines of which
  :data:`CONTEXT_DISTINCT` differ, at most :data:`MAX_CONTEXT_LINES`: a run of one repeated line at the
  end of a read does not match a later run. A log that is one repeated pattern longer than that can
  still match too late, and those repeats are not returned;
* when no tail up to :data:`MAX_TAIL_LINES` lines holds the context, more lines were written since the
  last read than one call reads: the call returns one ``[trainboard]`` line saying so, then the log's
  latest lines.

A cursor of the reader before this one (a byte offset into the whole log, Ray's ``GET
/api/jobs/<id>/logs``) goes on at that offset when the log still fits in one tail; when it does not, the
read goes on from the log's end after a ``[trainboard]`` line (never repeating lines already stored).

A line is returned once its newline is written (Ray's tail counts lines by ``\n``), split at a lone
``\r`` as the old reader's text-mode read split it (:func:`text_lines`).

Cursor text: ``t1:<lines read, or ?>:<context lines>:<context digest>:<lines after it, seen>:<driver node>``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Callable

from cloud_adapters.base import InvalidSpec

FIRST_TAIL_LINES = 2000
"""Lines the first request of a call asks for: a few seconds' output of a busy job, and the context."""
MAX_TAIL_LINES = 32_000
"""The most lines one request asks for (:data:`FIRST_TAIL_LINES` doubled 4 times): what bounds a call's cost."""
CONTEXT_LINES = 16
CONTEXT_DISTINCT = 4
MAX_CONTEXT_LINES = 256
_HASH_BYTES = 8  # per line; the context digest is 16 bytes
_VERSION = "t1"
_NODE_RE = re.compile(r"[0-9a-f]{8,128}")
_DIGEST_RE = re.compile(r"[0-9a-f]{32}")


@dataclasses.dataclass(frozen=True)
class TailCursor:
    """A parsed ``logs()`` cursor."""

    lines: int | None = 0
    """The log's lines read (the index of the next line); None after a skip: the tail's start was unknown."""
    context: int = 0
    """How many of the last lines read the digest covers; 0 = none read."""
    digest: str = ""
    """blake2b-128 (hex) of the context's line hashes."""
    ahead: int = 0
    """Lines the read saw after this point and left for the next call: the next call asks for a tail
    that holds them at once."""
    node: str = ""
    """The driver's node id (Ray's ``driver_node_id``), "" before it is known."""
    byte_offset: int | None = None
    """A cursor of the reader before this one: a byte offset into the whole log. None for ours."""

    @classmethod
    def parse(cls, cursor: str) -> "TailCursor":
        """``cursor`` as a TailCursor; "" (and the old reader's "0") is the log's start. InvalidSpec
        for a negative offset or text that is no cursor of this backend."""
        cursor = str(cursor or "")
        if cursor in ("", "0"):
            return cls()
        if re.fullmatch(r"-?[0-9]{1,20}", cursor):
            offset = int(cursor)
            if offset < 0:
                raise InvalidSpec(f"log cursor must be 0 or more, got {offset}.")
            return cls(lines=None, byte_offset=offset)
        parts = cursor.split(":")
        try:
            version, lines, context, digest, ahead, node = parts
            parsed = cls(lines=None if lines == "?" else int(lines), context=int(context), digest=digest,
                         ahead=int(ahead), node=node)
        except ValueError:
            raise InvalidSpec(f"log cursor {cursor[:80]!r} is not a Ray log cursor.") from None
        # A context exactly when lines were read (lines None: after a skip, which returned some).
        if (version != _VERSION or (parsed.lines is not None and parsed.lines < 0) or parsed.ahead < 0
                or not 0 <= parsed.context <= MAX_CONTEXT_LINES
                or (parsed.context == 0) != (parsed.lines == 0)
                or (parsed.lines is not None and parsed.context > parsed.lines)
                or (parsed.context and not _DIGEST_RE.fullmatch(digest)) or (not parsed.context and digest)
                or (node and not _NODE_RE.fullmatch(node))):
            raise InvalidSpec(f"log cursor {cursor[:80]!r} is not a Ray log cursor.")
        return parsed

    def text(self) -> str:
        """The cursor as stored (:meth:`parse` reads it back); one text per state, so a read that finds
        nothing new returns the cursor it was given."""
        lines = "?" if self.lines is None else str(self.lines)
        return ":".join((_VERSION, lines, str(self.context), self.digest, str(self.ahead), self.node))


def line_hash(line: bytes) -> bytes:
    return hashlib.blake2b(line, digest_size=_HASH_BYTES).digest()


def text_lines(raw: bytes) -> list[str]:
    """One log line (its bytes without the newline) as the lines the reader before this one gave: UTF-8
    with bad bytes replaced, split at a lone carriage return (Ray's ``GET /api/jobs/<id>/logs`` read the
    file in text mode, whose universal newlines end a line at ``\\r``, ``\\r\\n`` or ``\\n``)."""
    text = raw.decode("utf-8", "replace")
    if "\r" not in text:
        return [text]
    return (text + "\n").replace("\r\n", "\n").replace("\r", "\n").split("\n")[:-1]


def _old_reader_bytes(raw: bytes) -> int:
    """The bytes line ``raw`` and its newline took in the old reader's text (its cursor's unit)."""
    text = raw.decode("utf-8", "replace") + "\n"
    return len(text.replace("\r\n", "\n").replace("\r", "\n").encode("utf-8"))


class _Tail:
    """One answer: the complete lines of the log's last ``asked`` lines."""

    def __init__(self, body: bytes, asked: int):
        parts = body.split(b"\n")
        self.lines = parts[:-1]
        # Fewer lines than asked: Ray found the file's start (an unterminated last line counts as one).
        self.whole = len(self.lines) + (1 if parts[-1] else 0) < asked
        self._joined: bytes | None = None

    def digest(self, end: int, count: int) -> str:
        """The context digest of lines ``[end - count, end)``."""
        if self._joined is None:
            self._joined = b"".join(line_hash(line) for line in self.lines)
        window = self._joined[(end - count) * _HASH_BYTES: end * _HASH_BYTES]
        return hashlib.blake2b(window, digest_size=16).hexdigest()

    def context_before(self, end: int) -> int:
        """How many lines before ``end`` the next context covers (see the module docstring)."""
        seen: set[bytes] = set()
        count = 0
        while count < min(end, MAX_CONTEXT_LINES):
            seen.add(self.lines[end - count - 1])
            count += 1
            if count >= CONTEXT_LINES and len(seen) >= CONTEXT_DISTINCT:
                break
        return count

    def locate(self, cursor: TailCursor) -> int | None:
        """The index in :attr:`lines` of the first line after what ``cursor`` read, or None when this
        tail does not show it."""
        if cursor.byte_offset is not None:
            if not self.whole:
                return None
            consumed = at = 0
            while at < len(self.lines):
                consumed += _old_reader_bytes(self.lines[at])
                if consumed > cursor.byte_offset:
                    break
                at += 1
            return at
        if cursor.lines == 0:
            return 0 if self.whole else None
        if self.whole and cursor.lines is not None:
            at = cursor.lines
            if at <= len(self.lines) and self.digest(at, cursor.context) == cursor.digest:
                return at
        # The last match; the tail cannot start before the log, so it is at most the count read
        # (unless the count is unknown, or wrong: a whole log that does not show it there).
        last = len(self.lines) if cursor.lines is None or self.whole else min(len(self.lines), cursor.lines)
        for at in range(last, cursor.context - 1, -1):
            if self.digest(at, cursor.context) == cursor.digest:
                return at
        return None


def read(fetch: Callable[[int], bytes | None], cursor: TailCursor, *, max_lines: int,
         max_bytes: int) -> tuple[list[str], TailCursor] | None:
    """The lines after ``cursor`` and the cursor after them; None when ``fetch`` finds no log.

    ``fetch(n)`` returns the log's last ``n`` lines as Ray serves them (bytes), or None; it is called
    with ``n`` ≤ :data:`MAX_TAIL_LINES` only, at most 5 times (doubling from :data:`FIRST_TAIL_LINES`,
    or from the backlog the cursor saw). At most ``max_lines`` lines of the log and about ``max_bytes``
    bytes are returned (at least one line when there is one); the rest is the next call's."""
    asked = FIRST_TAIL_LINES
    while asked < MAX_TAIL_LINES and asked < cursor.ahead + FIRST_TAIL_LINES:
        asked *= 2
    asked = min(asked, MAX_TAIL_LINES)
    while True:
        body = fetch(asked)
        if body is None:
            return None
        tail = _Tail(body, asked)
        at = tail.locate(cursor)
        if at is not None or tail.whole or asked >= MAX_TAIL_LINES:
            break
        asked = min(asked * 2, MAX_TAIL_LINES)

    notice: list[str] = []
    if at is None:
        if cursor.byte_offset is not None:
            # The old reader stored the lines before byte_offset; where that is in a log longer than one
            # tail cannot be found: go on from the end, repeating none.
            at = len(tail.lines)
            notice = [f"[trainboard] Trainboard's reader of Ray logs changed: this log was read to byte "
                      f"{cursor.byte_offset:,} before, and it is now longer than {MAX_TAIL_LINES:,} lines, so "
                      f"reading goes on from its end; lines written between that read and this one are not "
                      f"shown."]
        else:
            at = max(0, len(tail.lines) - max_lines)
            if tail.whole:
                notice = [f"[trainboard] the Ray job's log no longer holds the lines read before (it was "
                          f"replaced or cut); reading goes on with its last {len(tail.lines) - at:,} lines."]
            else:
                skipped = max(at - max(cursor.context - 1, 0), 1)
                since = "in all" if cursor.lines == 0 else "since the last read"
                notice = [f"[trainboard] at least {skipped:,} lines of the Ray job's log were skipped: it wrote "
                          f"more than {MAX_TAIL_LINES:,} lines {since}, more than one read takes; the log goes "
                          f"on with its latest lines."]

    end, size = at, 0
    while end < len(tail.lines) and end - at < max_lines and (end == at or size + len(tail.lines[end]) < max_bytes):
        size += len(tail.lines[end]) + 1
        end += 1
    lines = notice + [piece for raw in tail.lines[at:end] for piece in text_lines(raw)]

    if tail.whole:
        count: int | None = end
    elif notice or cursor.lines is None:
        count = None
    else:
        count = cursor.lines + (end - at)
    context = tail.context_before(end)
    return lines, dataclasses.replace(
        cursor, lines=count, context=context, digest=tail.digest(end, context) if context else "",
        ahead=len(tail.lines) - end, byte_offset=None)
