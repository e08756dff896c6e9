"""Checks every user-supplied JSON value and text passes before it is stored (DESIGN.md §8: no 500 for
any string, number or nesting). A leaf module: it imports no service, so forms, the API's parser and
serializers, and ``jobs.services`` share one definition of what may be stored.

What PostgreSQL refuses, and Python's ``json`` lets through:

- ``NaN``, ``Infinity`` and numbers past a float's range (``1e400`` parses as ``inf``): ``json.dumps``
  writes them as the bare words ``NaN`` / ``Infinity``, which are not JSON, and a ``jsonb`` column
  refuses the row ("invalid input syntax for type json").
- The NUL character U+0000, in a string or a key: ``jsonb`` refuses ``\\u0000`` ("unsupported Unicode
  escape sequence") and a ``text`` column cannot hold it at all. An unpaired surrogate (``\\ud800``)
  cannot be encoded as UTF-8, the database's encoding.
- Deep nesting: ``json.loads`` recurses once per level and fails with a RecursionError near
  Python's recursion limit (about 1,000 levels). :func:`loads` refuses more than
  :data:`MAX_JSON_DEPTH` levels before it parses; :func:`json_problems` refuses them in a value
  built in Python.

Usage::

    value = loads(text)              # JSONInputError (a ValueError) with a message for the user
    for problem in json_problems(value):
        errors.add("params", problem)
    if (problem := text_problem(name)) is not None:
        errors.add("name", problem)
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any, Iterator

MAX_JSON_DEPTH = 32
"""Most levels of nested objects and arrays a JSON value may have (a scalar is level 0,
``{"a": [1]}`` has 2). Trainer configs, model parameters and backend settings use 3 or fewer; a request
body adds one level around its fields."""

MAX_PROBLEMS = 10
"""Problems :func:`json_problems` reports at most (a list of 10,000 NaNs gives 10 messages, not 10,000)."""

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


class JSONInputError(ValueError):
    """Text that is not a JSON value this application stores; ``str()`` is the message for the user.

    ``decode_error``: the ``json.JSONDecodeError`` when the text is not JSON at all (its ``msg``,
    ``lineno``, ``colno`` say where), else None (JSON refused: too deep, a huge integer).
    """

    def __init__(self, message: str, decode_error: json.JSONDecodeError | None = None) -> None:
        super().__init__(message)
        self.decode_error = decode_error


def nesting_depth(text: str, limit: int = MAX_JSON_DEPTH) -> int:
    """Levels of ``[``/``{`` nesting in JSON ``text`` (brackets inside strings do not count), counting
    no further than ``limit`` + 1: a result above ``limit`` means "deeper than limit". Linear in the
    text's length, no recursion; the text need not be valid JSON."""
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub("", text)):
        if match.group() in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        else:
            depth -= 1
    return deepest


def loads(text: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``text`` (JSON, str or UTF-8 bytes) parsed, when it nests at most ``max_depth`` levels.

    Raises :class:`JSONInputError` with a message that says what to change: not JSON (with line and
    column), nested too deep, an integer of more than 4,300 digits (Python's limit on converting
    text to an int). ``NaN`` and ``Infinity`` parse, as Python's ``json`` parses them, to float NaN and
    infinity, like a number too large for a float (``1e400``): what is not storable in the value (those,
    a NUL, a surrogate) is :func:`json_problems`' to report, with where it is, as the field's error.
    """
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JSONInputError(f"Not UTF-8 text (byte {exc.start}).") from None
    if nesting_depth(text, max_depth) > max_depth:
        raise JSONInputError(f"Nested more than {max_depth} levels deep; at most {max_depth} levels of objects "
                             f"and arrays are accepted.")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise JSONInputError(f"Not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}.", exc) from None
    except ValueError:  # the only other ValueError: an int past sys.get_int_max_str_digits()
        raise JSONInputError(f"A number has more than {sys.get_int_max_str_digits():,} digits; give a shorter "
                             f"one.") from None


def unpaired_surrogate(value: Any, path: str = "") -> str | None:
    """Where the first string or key of ``value`` (as :func:`loads` returns it, so bounded in depth)
    with an unpaired surrogate is (``"a.b[2]"``, "" for the value itself), or None when it has none.

    JSON may escape one (``"\\ud800"``) though it is not text: such a string cannot be encoded as
    UTF-8, so it can be neither stored nor echoed back in an error message."""
    if isinstance(value, str):
        return None if _encodes(value) else path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str):
            where = f"{path}.{key}" if path else key
            if not _encodes(key):
                return _printable(where)
        else:
            where = f"{path}[{key}]"
        found = unpaired_surrogate(item, where)
        if found is not None:
            return found
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def text_problem(value: str) -> str | None:
    """Why string ``value`` cannot be stored in a text or JSON column, or None: it contains NUL
    (U+0000), or an unpaired surrogate (not encodable as UTF-8)."""
    if "\x00" in value:
        return "contains a NUL character (\\u0000), which cannot be stored; remove it."
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"contains an unpaired surrogate ({value[exc.start]!r} at position {exc.start}), which is not "
                f"text; remove it.")
    return None


def json_problems(value: Any, *, max_depth: int = MAX_JSON_DEPTH) -> list[str]:
    """What in ``value`` (a parsed JSON value: dict, list, str, int, float, bool, None) cannot be
    stored, one message per problem, each prefixed with where it is (``train.lr: ...``,
    ``layers[2]: ...``); [] when it is fine. At most :data:`MAX_PROBLEMS` messages.

    A problem is: a float that is NaN or infinite; a NUL or unpaired surrogate in a string or a key;
    nesting deeper than ``max_depth``; a key that is not a string; a value of another Python type
    (a Decimal, a date). Walks at most ``max_depth`` levels, so a deep value cannot exhaust the stack.
    """
    problems: list[str] = []
    for problem in _walk(value, "", 0, max_depth):
        problems.append(problem)
        if len(problems) >= MAX_PROBLEMS:
            break
    return problems


def _printable(key: str) -> str:
    # The key goes into the message, which must itself be storable and encodable.
    return key.replace("\x00", "\\u0000").encode("utf-8", "backslashreplace").decode("utf-8")


def _where(path: str, message: str) -> str:
    return f"{path}: {message}" if path else message[:1].upper() + message[1:]


def _walk(value: Any, path: str, depth: int, max_depth: int) -> Iterator[str]:
    if isinstance(value, str):
        problem = text_problem(value)
        if problem is not None:
            yield _where(path, problem)
    elif isinstance(value, bool) or value is None or isinstance(value, int):
        return
    elif isinstance(value, float):
        if not math.isfinite(value):  # worded as the trainer's config says it (trainer_pkg.config)
            why = "" if value != value else " (a number past about 1.8e308, such as 1e400, reads as infinite)"
            yield _where(path, f"expected a finite number, got {value!r}{why}.")
    elif isinstance(value, (dict, list, tuple)):
        if depth >= max_depth:
            yield _where(path, f"nested more than {max_depth} levels deep; at most {max_depth} levels of "
                               f"objects and arrays are accepted.")
            return
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    if not (key is None or isinstance(key, (int, float))):  # json.dumps writes these as text
                        yield _where(path, f"key {key!r} is not a string; JSON keys are strings.")
                    continue
                problem = text_problem(key)
                shown = _printable(key) if problem else key
                if problem is not None:
                    yield _where(path, f'key "{shown}" {problem}')
                yield from _walk(item, f"{path}.{shown}" if path else shown, depth + 1, max_depth)
        else:
            for index, item in enumerate(value):
                yield from _walk(item, f"{path}[{index}]", depth + 1, max_depth)
    else:
        yield _where(path, f"a {type(value).__name__} is not a JSON value; give a string, number, true/false, "
                           f"null, object or array.")
