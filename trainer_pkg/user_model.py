"""A user's own model (``model.arch = "custom"``): imported from their code, called, checked.

The user's code archive lies unpacked at ``code.dir``; ``model.entry_point`` names a function in it,
``package.module:function``. :func:`build_user_model` puts ``code.dir`` first on ``sys.path``, imports
the module, and calls ::

    function(num_classes=10, input_shape=(1, 8, 8), **model.params)

which must return a ``torch.nn.Module`` mapping a batch (B, *input_shape) to logits
(B, num_classes). :func:`check_first_batch` runs one forward on a real batch before the strategy
wraps the model, so a model that returns the wrong shape fails in its first second, not in the loss.

Every failure is a :class:`UserCodeError` whose message is one line naming the entry point and what
to do. When the user's own code raised (a SyntaxError, an ImportError of a package that is not
installed, an exception in the function or the forward), the error also carries the user's
traceback: only the frames in the user's files (under ``code.dir``), so the lines shown are theirs,
not the trainer's or torch's. The trainer prints that traceback and the message on every rank
(:func:`trainer_pkg.train.agreed_setup`), so no rank waits for another.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import traceback
from typing import Any, Mapping

import torch
from torch import nn

from trainer_pkg.registry import parse_entry_point

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
_MESSAGE_CHARS = 600  # one line of the job's failure reason, not a page


class UserCodeError(Exception):
    """The user's model could not be loaded, built or run on a first batch; ``str()`` is one line
    naming the entry point and the fault.

    ``user_traceback`` is the traceback of the exception the user's code raised, with only the
    frames in the user's files, ending in the exception line (``""`` when the fault is not an
    exception of theirs, e.g. a module that is not there).
    """

    def __init__(self, message: str, user_traceback: str = "") -> None:
        super().__init__(message)
        self.user_traceback = user_traceback

    def write_traceback(self, rank: int) -> None:
        """Print :attr:`user_traceback` on stderr under a line naming ``rank``, as one write (the
        ranks share the launcher's stderr), or nothing when there is none."""
        if not self.user_traceback:
            return
        text = f"[rank {rank}] the user's code raised (frames in the user's files only):\n{self.user_traceback}"
        sys.stderr.flush()
        os.write(2, text.encode("utf-8", "replace"))


def resolve_code_dir(code_dir: str) -> str:
    """``code.dir`` as an absolute path: a relative one is relative to the directory holding the
    ``trainer_pkg`` package (docs/user-code.md: SageMaker and Azure ML set ``"."``, the files lying
    beside ``trainer_pkg/``); ``""`` stays ``""`` (no user code directory)."""
    if not code_dir:
        return ""
    return os.path.normpath(os.path.join(_PACKAGE_PARENT, code_dir))


def put_code_on_path(code_dir: str) -> None:
    """Make ``code_dir`` (``code.dir``, :func:`resolve_code_dir`) the first entry of ``sys.path``, so
    the user's packages are found before any installed package of the same name; nothing for ``""``.

    Raises :class:`UserCodeError` when ``code_dir`` is not a directory.
    """
    if not code_dir:
        return
    path = resolve_code_dir(code_dir)
    if not os.path.isdir(path):
        raise UserCodeError(f"code.dir {code_dir} is not a directory on this machine: the code archive was not "
                            "unpacked there (a backend fault: see the job's log)")
    if sys.path[:1] != [path]:
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)
        importlib.invalidate_caches()


def build_user_model(entry_point: str, code_dir: str, params: Mapping[str, Any], *,
                     input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The ``nn.Module`` that ``entry_point`` (``package.module:function`` in ``code_dir``) returns
    for ``num_classes`` classes and samples of ``input_shape`` (without the batch dimension), called
    with ``params`` as keyword arguments.

    Raises :class:`UserCodeError`: the entry point is malformed, its module is not found, importing
    it raised (with the user's traceback), the name is missing or not callable, the call raised
    (with the user's traceback) or returned something else than an ``nn.Module``.
    """
    try:
        module_name, function_name = parse_entry_point(entry_point)
    except ValueError as exc:
        raise UserCodeError(str(exc)) from None
    put_code_on_path(code_dir)
    where = f"model.entry_point {entry_point}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise UserCodeError(f"{where}: no module {exc.name} {_search_place(code_dir)}") from None
        raise _raised(exc, f"{where}: importing {module_name} raised", code_dir,
                      hint="a package the code imports is not installed: list it in the archive's "
                           "requirements.txt") from None
    except (Exception, SystemExit) as exc:  # SystemExit: a sys.exit() at import must not skip the agreement
        raise _raised(exc, f"{where}: importing {module_name} raised", code_dir) from None

    function = getattr(module, function_name, _MISSING)
    if function is _MISSING:
        defined = sorted(n for n, v in vars(module).items()
                         if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module_name)
        listing = f"; it defines: {', '.join(defined[:10])}" if defined else ""
        raise UserCodeError(f"{where}: module {module_name} ({_short_path(getattr(module, '__file__', None), code_dir)}) "
                            f"has no {function_name!r}{listing}")
    if not callable(function):
        raise UserCodeError(f"{where}: {module_name}.{function_name} is {_describe(function)}, not a function: name a "
                            "function that returns the torch.nn.Module")

    call = f"{function_name}(num_classes={num_classes}, input_shape={tuple(input_shape)}, **model.params)"
    try:
        model = function(num_classes=num_classes, input_shape=tuple(input_shape), **params)
    except (Exception, SystemExit) as exc:
        raise _raised(exc, f"{where}: {call} raised", code_dir) from None
    if not isinstance(model, nn.Module):
        raise UserCodeError(f"{where}: {call} returned {_describe(model)}, not a torch.nn.Module")
    return model


def check_first_batch(model: nn.Module, x: torch.Tensor, *, num_classes: int, entry_point: str, code_dir: str,
                      autocast: contextlib.AbstractContextManager | None = None) -> None:
    """One forward of ``model`` on the batch ``x`` (B, *input_shape), in training mode (as the loop
    will call it) without gradients; the model's buffers (BatchNorm statistics) are restored after,
    so the check changes nothing. The output must be a tensor of shape (B, num_classes).

    Raises :class:`UserCodeError` saying what came back (a tuple; a tensor of shape (32, 5)), or with
    the user's traceback when the forward raised.
    """
    where = f"model.entry_point {entry_point}"
    batch = f"a first batch of shape {_shape(x.shape)}"
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.no_grad(), (autocast or contextlib.nullcontext()):
            out = model(x)
    except (Exception, SystemExit) as exc:
        raise _raised(exc, f"{where}: the model's forward on {batch} raised", code_dir) from None
    finally:
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)
    expected = (x.shape[0], num_classes)
    if not isinstance(out, torch.Tensor):
        raise UserCodeError(f"{where}: on {batch} the model returned {_describe(out)}; expected a tensor of "
                            f"shape {_shape(expected)}: (batch, num_classes) logits")
    if tuple(out.shape) != expected:
        raise UserCodeError(f"{where}: on {batch} the model returned shape {_shape(out.shape)}; expected "
                            f"{_shape(expected)}: (batch, num_classes) logits")


def user_traceback(exc: BaseException, code_dir: str) -> str:
    """``exc``'s traceback with only the frames in the user's files (under ``code_dir``, and never
    the trainer's or torch's), then the exception line(s): a SyntaxError's show the file, the line
    and a caret."""
    root = os.path.realpath(resolve_code_dir(code_dir)) + os.sep if code_dir else None
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_users(f.filename, root)]
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames)] if frames else []
    return "".join(lines + traceback.format_exception_only(type(exc), exc))


_MISSING = object()


def _raised(exc: BaseException, context: str, code_dir: str, hint: str = "") -> UserCodeError:
    """The :class:`UserCodeError` for ``exc`` raised by the user's code while doing ``context``."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    message = f"{context} {type(exc).__name__}{_raised_at(exc, code_dir)}" + (f": {text}" if text else "")
    if len(message) > _MESSAGE_CHARS:
        message = message[:_MESSAGE_CHARS - 1] + "…"
    return UserCodeError(message + (f" ({hint})" if hint else ""), user_traceback(exc, code_dir))


def _raised_at(exc: BaseException, code_dir: str) -> str:
    """`` at pkg/mod.py:12 (helper)``: the innermost frame of the user's files in ``exc``'s traceback,
    its path relative to ``code_dir``, so a failure reason says where without the log; "" when no
    frame is the user's (a SyntaxError's own text already names its file and line)."""
    root = os.path.realpath(resolve_code_dir(code_dir)) + os.sep if code_dir else None
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_users(f.filename, root)]
    if not frames:
        return ""
    frame = frames[-1]
    func = f" ({frame.name})" if frame.name and frame.name != "<module>" else ""
    return f" at {_short_path(frame.filename, code_dir)}:{frame.lineno}{func}"


def _is_users(filename: str, root: str | None) -> bool:
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return False
    path = os.path.realpath(filename)
    if path.startswith(_OURS):  # also under a code.dir of "." (the archive's files beside trainer_pkg/)
        return False
    return root is None or path.startswith(root)


def _search_place(code_dir: str) -> str:
    if not code_dir:
        return "on sys.path (code.dir is not set)"
    path = resolve_code_dir(code_dir)
    try:
        names = sorted(n + ("/" if os.path.isdir(os.path.join(path, n)) else "")
                       for n in os.listdir(path) if not n.startswith(".") and n != "__pycache__")
    except OSError:
        names = []
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    return f"in code.dir {code_dir} (its top level: {shown or 'nothing'})"


def _short_path(path: str | None, code_dir: str) -> str:
    if not path:
        return "no file"
    root = os.path.realpath(resolve_code_dir(code_dir)) if code_dir else ""
    if root and os.path.realpath(path).startswith(root + os.sep):
        return os.path.relpath(os.path.realpath(path), root)
    return path


def _shape(shape: Any) -> str:
    dims = tuple(int(s) for s in shape)
    return "(" + ", ".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")"


def _describe(value: Any) -> str:
    """``a torch.Tensor of shape (3, 4)``, ``a tuple``, ``the int 3``: what a user's value is."""
    if isinstance(value, torch.Tensor):
        return f"a torch.Tensor of shape {_shape(value.shape)}"
    if value is None:
        return "None"
    kind = type(value)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    if isinstance(value, (int, float, str, bool)):
        return f"the {name} {value!r:.60}"
    return f"a {name}"
