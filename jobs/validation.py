"""Checks every user-supplied value passes before it is stored (DESIGN.md §8: no 500 for any string,
number or nesting), and the field-error kit the services report them with. A leaf module: it imports
no service, so forms, the API's parser and serializers, and ``jobs.services`` share one definition of
what may be stored.

Two parts. The first says what PostgreSQL can store (:func:`loads`, :func:`json_problems`,
:func:`text_problem`; no Django). The second is how a service collects a user's input errors:
:class:`Errors` (field → messages, raised as one ``ValidationError`` keyed by the form/API field
names, ``__all__`` = :data:`ALL` for the rest), the bounds every job shares (:data:`MAX_NODES` ...),
and checks that add to it instead of raising (:func:`whole_number`, :func:`budget_usd`,
:func:`json_object`, :func:`owned`, :func:`member_team`, :func:`update_row` ...), and
:func:`trial_call`, which reports an input's own errors and the service's together.

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

import difflib
import json
import math
import re
import sys
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar

from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db import transaction
from django.db.models import Q

from jobs import cost as costs
from jobs.models import Team

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


# ---------------------------------------------------------------------------------------------
# Field errors: what a service reports, keyed by the form/API field names
# ---------------------------------------------------------------------------------------------

ALL = NON_FIELD_ERRORS  # "__all__"

WHOLE_INPUT = "whole_input"
"""The code of an error worked out from every field together (the memory plan's refusal). A trial
call on an input whose own checks failed (``trial_call``) drops it: the service saw
stand-ins for the fields that failed, so the figures would be of another job. One worked out from
some fields only carries them (:func:`worked_out_from`) and is dropped only when one of those failed."""


def worked_out_from(message: str, fields: Iterable[str]) -> ValidationError:
    """``message`` as an error worked out from ``fields`` together (the batch against the dataset's
    size: ``batch_size``, the shape, ``dataset``): coded :data:`WHOLE_INPUT` with the fields
    (``whole_input:batch_size,dataset``), so a check that ran while another field had failed (CPU
    offload) keeps it; it is dropped only when one of ``fields`` had failed (:func:`stood_in`)."""
    return ValidationError(message, code=f"{WHOLE_INPUT}:{','.join(sorted(fields))}")


def stood_in(code: Any, flagged: set[str]) -> bool:
    """Whether an error coded ``code`` was worked out from a stand-in for one of the ``flagged``
    fields: coded :data:`WHOLE_INPUT` (any flagged field), or :func:`worked_out_from` fields (one
    of them flagged)."""
    if not flagged or not isinstance(code, str):
        return False
    if code == WHOLE_INPUT:
        return True
    head, sep, fields = code.partition(":")
    return head == WHOLE_INPUT and bool(sep) and bool(flagged & set(fields.split(",")))


class Errors(dict):
    """field -> [messages]; ``raise_if_any`` raises one ValidationError with all of them.

    ``field`` is a form/API field name (``config.<key>`` for one backend setting), or :data:`ALL`."""

    def add(self, field: str, message: str | ValidationError) -> None:
        """``message``: text, or a ValidationError to carry a code (:data:`WHOLE_INPUT`)."""
        messages = self.setdefault(field, [])
        if message not in messages:  # two checks finding the same fault say it once
            messages.append(message)

    def raise_if_any(self) -> None:
        if self:
            raise ValidationError(dict(self))


MAX_UNKNOWN_FIELDS = 20
"""Unknown keys of one request reported at most (a body of 10,000 junk keys gives 20 errors)."""


def unknown_fields(errors: Errors, given: Iterable[Any], known: Iterable[str], *, what: str,
                   aliases: Mapping[str, str] | None = None, hints: Mapping[str, str] | None = None) -> list[str]:
    """Add an error on each key of ``given`` (a request body's keys) that is not in ``known``, keyed
    by that key (cut to 100 characters; at most :data:`MAX_UNKNOWN_FIELDS` of them), and return them,
    sorted: a misspelt key must not be dropped silently and the request run on the defaults.

    Each message names the key and what to send instead: ``hints[key]`` when given (a key that
    belongs elsewhere, e.g. ``max_steps`` inside ``hyperparameters``), else the closest known name
    (:func:`difflib.get_close_matches`; ``aliases`` maps other spellings to a known name, so
    ``lerning_rate`` finds ``learning_rate`` → ``lr``), else every known name, e.g. ``"Unknown
    field 'lerning_rate'. Did you mean 'lr'?"``. ``what``: who takes the fields, for the last form
    ("a job takes name, dataset, ...")."""
    known = list(known)
    aliases = dict(aliases or {})
    names = {name: name for name in known} | {alias: name for alias, name in aliases.items() if name in known}
    unknown = sorted((key for key in given if key not in known), key=str)
    for key in unknown[:MAX_UNKNOWN_FIELDS]:
        text = _printable(str(key)[:100])
        if hints and key in hints:
            message = f"Unknown field {text!r}: {hints[key]}"
        elif close := difflib.get_close_matches(str(key).lower(), list(names), n=1):
            message = f"Unknown field {text!r}. Did you mean {names[close[0]]!r}?"
        else:
            message = f"Unknown field {text!r}: {what} takes {', '.join(known)}."
        errors.add(text, message)
    return unknown


def merge_later(errors: Errors, later: Errors, flagged: set[str]) -> None:
    """Add to ``errors`` what ``later`` checks found: checks that ran after the ``flagged`` fields had
    failed, on stand-ins for them. Dropped: ``later``'s errors on a flagged field (``config.region``
    belongs to ``config``), and those worked out from a stand-in (:func:`stood_in`: coded
    :data:`WHOLE_INPUT` while any field was flagged, or worked out from a flagged one: of another job)."""
    for key, messages in later.items():
        if field_of(key) in flagged:
            continue
        for message in messages:
            if isinstance(message, ValidationError) and stood_in(message.code, flagged):
                continue
            errors.add(key, message)


T = TypeVar("T")


def coded_errors(exc: ValidationError) -> dict[str, list[tuple[str, str | None]]]:
    """``{field: [(message, code), ...]}`` for any ValidationError (code None where none was given)."""
    errors = exc.error_dict if hasattr(exc, "error_dict") else {NON_FIELD_ERRORS: exc.error_list}
    return {field: [(message, e.code) for e in errs for message in e.messages] for field, errs in errors.items()}


def field_of(key: str) -> str:
    """The field a service error key belongs to: ``config`` for ``config.region``, else the key."""
    return key.split(".", 1)[0]


class _TrialRun(Exception):
    """Rolls back a service call made only to collect its errors."""


def trial_call(call: Callable[[], T], *, valid: bool, flagged: set[str],
               check: Callable[[], object] | None = None) -> tuple[T | None, ValidationError | None]:
    """Call the service ``call`` for an input whose own checks ``valid`` passed or not: ``(result,
    None)`` when it is saved, else ``(None, the service's errors or None)``.

    The input's own checks (a required field, a number, valid JSON) and the service's rules (a
    backend's settings, the dataset's shape) are reported together: checked one after the other, an
    empty SageMaker form would flag Name, and only on the next submit its settings. So an input with
    errors still calls the service, on the values that did clean, inside a savepoint that is always rolled back
    (nothing is stored and nothing is sent: ``on_commit`` work of a rolled-back savepoint is
    discarded). The service's errors on ``flagged`` fields (the ones the input's own checks already
    reported; a key ``config.region`` belongs to ``config``) are dropped: the service saw no value
    for them; so are its errors coded :data:`WHOLE_INPUT` (worked out from every field together, on
    those stand-ins: the memory plan's refusal). Shared by the UI (``webapp.errors.submit_form``) and
    the API (``webapp.api.serializers``).

    ``check``: the service's pure check of the same input (it writes nothing, e.g.
    ``services.training_job_check``): called instead of ``call`` on an invalid input, so there is
    nothing to roll back.
    """
    if not valid and check is not None:
        try:
            check()
        except ValidationError as exc:
            return None, unflagged_errors(exc, flagged)
        return None, None
    try:
        with transaction.atomic():
            result = call()
            if not valid:
                raise _TrialRun
    except _TrialRun:
        return None, None
    except ValidationError as exc:
        if valid:
            return None, exc
        return None, unflagged_errors(exc, flagged)
    return result, None


def unflagged_errors(exc: ValidationError, flagged: set[str]) -> ValidationError | None:
    """The errors of ``exc`` (a service's, called on an input whose own checks flagged ``flagged``
    fields and passed stand-ins for them) that are not about those fields (a key ``config.region``
    belongs to ``config``) nor coded :data:`WHOLE_INPUT` (worked out from every field together, on the
    stand-ins); None when nothing is left."""
    remaining = {k: kept for k, v in coded_errors(exc).items() if field_of(k) not in flagged
                 if (kept := [m for m, code in v if not stood_in(code, flagged)])}
    return ValidationError(remaining) if remaining else None


MAX_RUNTIME_S = 28 * 24 * 3600
"""Longest max runtime a job may ask for: 28 days (2,419,200 s), SageMaker's maximum
``StoppingCondition.MaxRuntimeInSeconds`` (shared/reference/clouds.md); the same ceiling for every backend."""
MAX_NODES = 1000
"""Most nodes (instances) one job may ask for."""
MAX_PROCS_PER_NODE = 1024
"""Most trainer processes per node (one per GPU, or per CPU core on a CPU box)."""
MAX_EPOCHS = 100_000
MAX_BATCH_SIZE = 1_000_000
MAX_SEED = 2**32 - 1
PRIORITY_RANGE = (-100, 100)
"""A job's ``priority``: higher starts first where its backend queues jobs itself (a full GPU box)."""
"""Seeds are 0..2³²−1 (what NumPy's seeding takes; larger values overflow ``torch.manual_seed``
once the trainer adds its per-rank offsets)."""
MAX_COST_USD = Decimal("99999999.9999")
"""The largest cost the cost columns hold (12 digits, 4 after the point)."""


def whole_number(errors: Errors, field: str, value: Any, *, minimum: int, label: str,
                 maximum: int | None = None) -> int:
    """``value`` (an int, an integral float, or a string of digits) as an int in ``minimum`` ..
    ``maximum``. Otherwise an error on ``field`` naming ``label``, and a stand-in (``minimum``, or
    ``maximum`` when above it) so the caller's other checks still run."""
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            pass
    if number is None:
        errors.add(field, f"{label} must be a whole number, got {value!r}.")
        return minimum
    if number < minimum:
        errors.add(field, f"{label} must be at least {minimum}, got {number}.")
        return minimum
    if maximum is not None and number > maximum:
        errors.add(field, f"{label} must be at most {maximum:,}, got {number:,}.")
        return maximum
    return number


def shape_ints(errors: Errors, nodes: Any, procs_per_node: Any, max_runtime_s: Any) -> tuple[int, int, int]:
    """Nodes, processes per node and max runtime (s) as whole numbers within their ranges."""
    return (whole_number(errors, "nodes", nodes, minimum=1, maximum=MAX_NODES, label="Nodes"),
            whole_number(errors, "procs_per_node", procs_per_node, minimum=1, maximum=MAX_PROCS_PER_NODE,
                         label="Processes per node"),
            whole_number(errors, "max_runtime_s", max_runtime_s, minimum=1, maximum=MAX_RUNTIME_S,
                         label="Max runtime (s)"))


def check_estimate(errors: Errors, estimate: Decimal) -> None:
    """An estimate the cost columns cannot hold is refused (on ``max_runtime_s``, the usual cause)."""
    if estimate > MAX_COST_USD:
        places = costs.usd_places(estimate, MAX_COST_USD)
        errors.add("max_runtime_s", f"The estimate {costs.format_usd(estimate, places)} is more than Trainboard "
                                    f"records for one job ({costs.format_usd(MAX_COST_USD, places)}): lower the max "
                                    f"runtime, nodes or instance type.")


def positive_float(errors: Errors, field: str, value: Any, *, label: str) -> float:
    """``value`` as a finite float > 0 (e.g. the learning rate); else an error on ``field`` naming
    ``label`` (a bool is not a number), and 1.0 in its place so the caller's other checks still run."""
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
    except (TypeError, ValueError):
        errors.add(field, f"{label} must be a number, got {value!r}.")
        return 1.0
    if not number > 0 or number != number or number == float("inf"):
        errors.add(field, f"{label} must be greater than 0, got {value!r}.")
        return 1.0
    return number


def budget(errors: Errors, value: Any) -> Decimal | None:
    """A job's budget in USD, to the cent: None for None/"" (no budget); else more than $0 and at
    most :data:`MAX_COST_USD`, or an error on ``budget_usd`` and None."""
    if value in (None, ""):
        return None
    try:
        if isinstance(value, bool):
            raise InvalidOperation
        amount = Decimal(str(value))
    except (InvalidOperation, ValueError):
        errors.add("budget_usd", f"Budget must be an amount in USD, e.g. 5.00, got {value!r}.")
        return None
    if not amount.is_finite() or amount <= 0:
        errors.add("budget_usd", f"Budget must be more than $0 (or empty for none), got {value!r}.")
        return None
    if amount > MAX_COST_USD:  # checked before quantize, which fails on a huge exponent
        errors.add("budget_usd", f"Budget must be at most ${MAX_COST_USD:,f}, got {value!r}.")
        return None
    return amount.quantize(costs.CENT_FRACTION)


def json_object(errors: Errors, field: str, value: Any, *, what: str, example: str,
                plural: bool = True) -> dict | None:
    """``value`` as a dict: a dict, or a JSON object in a string ("" is {}). None, with errors on
    ``field``, when it is neither, or when it holds what cannot be stored (NaN or an infinite number,
    a NUL character, nesting past :data:`MAX_JSON_DEPTH`: each problem a message)."""
    if isinstance(value, str):
        try:
            value = loads(value) if value.strip() else {}
        except JSONInputError as exc:
            bad = exc.decode_error
            errors.add(field, f"{what} {'are' if plural else 'is'} not valid JSON: {bad.msg} at line "
                              f"{bad.lineno} column {bad.colno}." if bad else f"{what}: {exc}")
            return None
    if not isinstance(value, dict):
        errors.add(field, f"{what} must be a JSON object, e.g. {example}.")
        return None
    problems = json_problems(value)
    for problem in problems:
        errors.add(field, f"{what}: {problem}")
    return None if problems else value


def update_row(instance: Any, fields: Mapping[str, Any], *, allowed: set[str], validate: Any,
               empty: Mapping[str, Any] | None = None, errors: Errors | None = None) -> Any:
    """Set ``fields`` on ``instance``, validate with ``validate(errors, instance)`` and save; on any
    error restore every field and raise (the row is untouched). ``None`` becomes ``empty[field]``
    (or ""). An unknown field name is a programming error: TypeError."""
    unknown = set(fields) - allowed
    if unknown:
        raise TypeError(f"{type(instance).__name__}: unknown fields {sorted(unknown)}")
    original = {f: getattr(instance, f) for f in allowed}
    for field, value in fields.items():
        setattr(instance, field, (empty or {}).get(field, "") if value is None else value)
    errors = errors if errors is not None else Errors()
    validate(errors, instance)
    if errors:
        for field, value in original.items():
            setattr(instance, field, value)
        errors.raise_if_any()
    instance.save()
    return instance


def usable_rows(model: type, owner: Any):
    """The rows of ``model`` (an Owned model) that ``owner`` may use: theirs, or shared with a team
    they are a member of (a teammate may launch on a team's backend, dataset and model)."""
    owner_pk = getattr(owner, "pk", None)
    if owner_pk is None:
        return model.objects.none()
    return model.objects.filter(Q(owner_id=owner_pk) | Q(team_id__in=Team.objects.filter(
        members__pk=owner_pk).values("pk")))


MAX_SAME_NAME_SHOWN = 10
"""Rows of one name an ambiguity error lists at most."""


def owned(errors: Errors, field: str, model: type, value: Any, owner: Any, label: str) -> Any:
    """``value`` (an instance, a pk, or a name) when it exists and ``owner`` may use it
    (:func:`usable_rows`). Else an error on ``field`` (a pk that is not an integer is the same error,
    not a crash).

    A name (text that is not all digits) is looked up among the rows ``owner`` may use only, as the
    CLI names them: none is "No dataset named 'x' that you can use" (another user's row of that name
    is not told apart from none), and one name given to several (your own and a team's) is an error
    listing their ids, to give one of them instead. ``label``: what the error calls the row
    (``dataset``, ``model``, ``backend``; ``GET /api/<label>s/`` lists them)."""
    obj = value
    if isinstance(value, str) and value.strip() and not value.strip().isdigit():
        return _owned_by_name(errors, field, model, value.strip(), owner, label)
    if not isinstance(value, model):
        try:
            obj = model.objects.filter(pk=int(value)).first() if value not in (None, "") else None
        except (TypeError, ValueError, OverflowError):
            obj = None
    owner_pk = getattr(owner, "pk", None)
    usable = obj is not None and owner_pk is not None and (
        obj.owner_id == owner_pk
        or (obj.team_id is not None and Team.objects.filter(pk=obj.team_id, members__pk=owner_pk).exists()))
    if not usable:
        errors.add(field, f"Choose one of your {label}s; this one does not exist or is not yours.")
        return None
    return obj


def _owned_by_name(errors: Errors, field: str, model: type, name: str, owner: Any, label: str) -> Any:
    shown = _printable(name[:100])
    return named_row(errors, field, usable_rows(model, owner), name, owner, label, missing=(
        f"No {label} named {shown!r} that you can use: GET /api/{label}s/ lists yours (give its name or id)."))


def named_row(errors: Errors, field: str, rows: Any, name: str, owner: Any, label: str, *, missing: str) -> Any:
    """The one row of queryset ``rows`` (those ``owner`` may use) named ``name``; else None, with
    ``missing`` on ``field`` when none is, or, when several are (your own and a team's), an error
    listing their ids to give instead. Shared by the API's name-or-id (:func:`owned`) and
    ``manage.py submit_job``."""
    found = [] if text_problem(name) is not None else list(  # PostgreSQL refuses a NUL even in a query
        rows.filter(name=name).order_by("pk")[:MAX_SAME_NAME_SHOWN + 1])
    if not found:
        errors.add(field, missing)
        return None
    if len(found) > 1:
        owner_pk = getattr(owner, "pk", None)

        def whose(row: Any) -> str:
            team = getattr(row, "team", None)
            return "yours" if getattr(row, "owner_id", None) == owner_pk or team is None else f"team {team.name}"

        ids = ", ".join(f"{row.pk} ({whose(row)})" for row in found[:MAX_SAME_NAME_SHOWN])
        count = f"More than {MAX_SAME_NAME_SHOWN}" if len(found) > MAX_SAME_NAME_SHOWN else str(len(found))
        more = ", ..." if len(found) > MAX_SAME_NAME_SHOWN else ""
        errors.add(field, f"{count} {label}s named {_printable(name[:100])!r} that you can use: ids {ids}{more}; give "
                          f"the id of the one you mean.")
        return None
    return found[0]


def member_team(errors: Errors, value: Any, owner: Any):
    """The Team ``value`` (instance or pk) when ``owner`` is a member; None for None/"". Else an
    error on ``team`` (an unknown or non-integer pk is the same error)."""
    if value in (None, ""):
        return None
    pk = value.pk if isinstance(value, Team) else value
    try:
        team = Team.objects.filter(pk=int(pk), members__pk=getattr(owner, "pk", None)).first()
    except (TypeError, ValueError, OverflowError):
        team = None
    if team is None:
        errors.add("team", "Choose one of your teams; this one does not exist or you are not a member.")
    return team


def team_field(errors: Errors, fields: Mapping[str, Any], owner: Any) -> dict[str, Any]:
    """``fields`` with a ``team`` pk resolved to the Team (one of ``owner``'s teams; else an error on
    ``team`` and the field left out so the row keeps its team)."""
    if "team" not in fields:
        return dict(fields)
    fields = dict(fields)
    team = member_team(errors, fields["team"], owner)
    if team is None and fields["team"] not in (None, ""):
        fields.pop("team")
    else:
        fields["team"] = team
    return fields


def name_taken(model: type, owner: Any, name: str, exclude_pk: Any = None) -> bool:
    """Whether ``owner`` already has a ``model`` row named ``name`` (other than ``exclude_pk``)."""
    if text_problem(name) is not None:
        return False  # no row holds such a name (full_clean says why); PostgreSQL refuses it in a query too
    qs = model.objects.filter(owner=owner, name=name)
    if exclude_pk is not None:
        qs = qs.exclude(pk=exclude_pk)
    return qs.exists()


def full_clean(errors: Errors, obj: Any) -> None:
    """The model's own field checks, plus: no text column may hold a NUL or an unpaired surrogate
    (:func:`text_problem`; PostgreSQL refuses the row, a 500 otherwise)."""
    for model_field in obj._meta.concrete_fields:
        value = getattr(obj, model_field.attname, None)
        if isinstance(value, str) and (problem := text_problem(value)) is not None:
            errors.add(model_field.name, f"{model_field.verbose_name[:1].upper()}{model_field.verbose_name[1:]} {problem}")
    try:
        obj.full_clean(exclude=["owner"], validate_unique=False, validate_constraints=False)
    except ValidationError as exc:
        for field, messages in exc.message_dict.items():
            for message in messages:
                errors.add(field, message)



# =============================================================================================
# Environment variables of a job's processes, and container images
# =============================================================================================

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""A variable name every platform's process environment accepts (POSIX shells' rule)."""
MAX_ENV_NAME = 100
MAX_ENV_VALUE = 4096
"""Characters, per value: SageMaker's ``Environment`` takes at most 512 per value and Vertex's
``env`` more; 4,096 keeps a token or a URL whole."""
MAX_ENV_VARS = 64

RESERVED_ENV: dict[str, str] = {
    **dict.fromkeys(("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                     "NODE_RANK"), "torchrun sets it on every rank from the job's shape"),
    "PYTHONPATH": "the launcher puts the trainer and your code on it",
    "TF_CONFIG": "the launcher writes it for a tensorflow script's workers (or the platform does)",
    "RAY_ADDRESS": "the launcher points a ray script at its own job's Ray cluster (or the ray backend does)",
    **dict.fromkeys(("GROUP_RANK", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                     "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE"),
                    "the launcher sets it on every rank from the job's shape (an mpi script's as horovodrun would)"),
    **dict.fromkeys(("PATH", "HOME"), "the platform sets it for the job's user and image"),
    **dict.fromkeys(("LD_PRELOAD", "LD_LIBRARY_PATH"),
                    "it changes which libraries every process of the image loads; put them in a container image"),
}
"""Names a job may not set, each with the reason its message gives: torchrun's rank variables and
what the launcher or the platform owns (docs/user-code.md "Environment a user script sees")."""

RESERVED_ENV_PREFIXES: dict[str, str] = {
    "TRAINBOARD_": "Trainboard's own (the launcher sets TRAINBOARD_MODEL_DIR, TRAINBOARD_DATA_DIR, ...)",
    "SM_": "SageMaker's (its training toolkit sets them)",
    "AIP_": "Vertex AI's (it sets them in every replica)",
    "AZUREML_": "Azure ML's (it sets them in every node)",
    "CUDA_": "the platform's GPU settings (CUDA_VISIBLE_DEVICES is chosen per rank)",
    "OMPI_COMM_WORLD_": "Open MPI's rank variables (mpirun sets them on every rank; OMPI_MCA_ settings are yours)",
}


def env_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a job's environment variable (not a name, too long, or reserved by
    :data:`RESERVED_ENV` / :data:`RESERVED_ENV_PREFIXES`, saying whose it is), or None."""
    if not ENV_NAME.fullmatch(name):
        return (f"{name[:100]!r} is not a variable name: letters, digits and _, not starting with a digit "
                f"(e.g. WANDB_API_KEY).")
    if len(name) > MAX_ENV_NAME:
        return f"{name[:40]}...: a name is at most {MAX_ENV_NAME} characters, this one has {len(name)}."
    if name in RESERVED_ENV:
        return f"{name} cannot be set here: {RESERVED_ENV[name]}."
    for prefix, whose in RESERVED_ENV_PREFIXES.items():
        if name.startswith(prefix):
            return f"{name} cannot be set here: names starting {prefix} are {whose}."
    return None


def _env_pairs(errors: Errors, field: str, value: Any, what: str) -> list[tuple[str, Any, str | None]] | None:
    """``value`` (a mapping, or ``KEY=VALUE`` lines; blank lines and ``#`` comments skipped) as
    (name, value, problem) in input order, ``problem`` being a line that is not ``KEY=VALUE``; None
    with an error when ``value`` is neither."""
    if isinstance(value, Mapping):
        return [(str(k), v, None) for k, v in value.items()]
    if not isinstance(value, str):
        errors.add(field, f"{what}s must be an object of NAME: value strings, or NAME=VALUE lines.")
        return None
    pairs: list[tuple[str, Any, str | None]] = []
    for number, line in enumerate(value.splitlines(), start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        name, sep, rest = text.partition("=")
        problem = None if sep else (f"Line {number}: {text[:60]!r} is not NAME=VALUE; write one variable per "
                                    f"line, e.g. WANDB_PROJECT=vision.")
        pairs.append((name.strip(), rest.strip(), problem))
    return pairs


def env_vars(errors: Errors, field: str, value: Any, *, what: str = "Environment variable",
             allow_empty: bool = False) -> dict[str, str]:
    """``value`` (a dict of name → string, or ``KEY=VALUE`` lines; None = {}) checked as environment
    variables of a job's processes, every problem added to ``errors`` under ``field`` at once: names
    ``[A-Za-z_][A-Za-z0-9_]*`` of at most :data:`MAX_ENV_NAME` characters and not reserved
    (:func:`env_name_problem`), each once; values strings of at most :data:`MAX_ENV_VALUE`
    characters that can be stored; at most :data:`MAX_ENV_VARS` variables. No message quotes a
    value, so the same check serves secrets. ``allow_empty``: an empty value is kept (an update's "remove this one"), else refused.
    Returns the valid ones (name → value, in input order)."""
    if value in (None, ""):
        return {}
    pairs = _env_pairs(errors, field, value, what)
    if pairs is None:
        return {}
    out: dict[str, str] = {}
    seen: set[str] = set()
    for name, val, line_problem in pairs:
        if line_problem is not None:
            errors.add(field, line_problem)
            continue
        if (problem := text_problem(name)) is not None:
            errors.add(field, f"{what} name {problem}")
            continue
        if (problem := env_name_problem(name)) is not None:
            errors.add(field, f"{what} {problem}")
            continue
        if name in seen:
            errors.add(field, f"{what} {name} is given twice; keep one.")
            continue
        seen.add(name)
        if val is None and allow_empty:
            val = ""
        if not isinstance(val, str):
            errors.add(field, f"{what} {name}: the value must be a string, got {type(val).__name__}.")
            continue
        if not val and not allow_empty:
            errors.add(field, f"{what} {name} has an empty value; give one, or remove the line.")
            continue
        if len(val) > MAX_ENV_VALUE:
            errors.add(field, f"{what} {name}: a value is at most {MAX_ENV_VALUE:,} characters, this one has "
                              f"{len(val):,}.")
            continue
        if (problem := text_problem(val)) is not None:
            errors.add(field, f"{what} {name}: the value {problem}")
            continue
        out[name] = val
    if len(seen) > MAX_ENV_VARS:
        errors.add(field, f"At most {MAX_ENV_VARS} {what.lower()}s, got {len(seen)}.")
    return out


IMAGE_REFERENCE = re.compile(
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?(?::[0-9]+)?/)?"  # registry host[:port]/
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"  # repository path
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[a-f0-9]{64})?")  # :tag, @digest
"""A container image reference as Docker reads one (``registry/path:tag@sha256:…``): ECR, Artifact
Registry and ACR URIs all take this form."""
MAX_IMAGE = 500


def image_problem(image: str) -> str | None:
    """Why ``image`` (stripped, non-empty) is not a container image reference, as the message for an
    ``image`` field; None when it is one."""
    if len(image) <= MAX_IMAGE and IMAGE_REFERENCE.fullmatch(image):
        return None
    return (f"Image: {image[:100]!r} is not a container image reference; give one like "
            f"123456789012.dkr.ecr.us-east-1.amazonaws.com/train:1.0, "
            f"us-docker.pkg.dev/project/repo/train:1.0 or myregistry.azurecr.io/train:1.0, "
            f"or leave it blank for the backend's image.")
