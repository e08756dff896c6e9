"""The API's exception handler: DRF's, with a 404 that says what was not found in the API's words.

Django's ``get_object_or_404`` says "No TrainingJob matches the given query." (the model's class name)
and a malformed id only "Not found."; a 404 of a view that names one object (a ``pk`` in its URL) says
instead "Training job 999 not found (or not yours).": the queryset is the user's own (and their teams'),
so a row that exists but is someone else's gets the same answer as one that does not.
"""

from __future__ import annotations

import re
from typing import Any

from django.http import Http404
from rest_framework import exceptions
from rest_framework.views import exception_handler as drf_exception_handler


_DJANGOS = re.compile(r"^No (\w+) matches the given query\.$")


def _not_found_message(exc: Exception, context: dict[str, Any]) -> str | None:
    """The 404's message in the API's words, or None to keep the one it has: only Django's own message
    about the view's model, or a bare "Not found." (an id the URL's pattern did not take as one)."""
    view = context.get("view")
    pk = getattr(view, "kwargs", {}).get("pk") if view is not None else None
    if pk is None:
        return None
    queryset = getattr(view, "queryset", None)
    model = getattr(queryset, "model", None)
    if model is None:
        try:
            model = view.get_queryset().model
        except Exception:  # noqa: BLE001 (a view without a queryset: DRF's own message stays)
            return None
    detail = str(exc.detail if isinstance(exc, exceptions.APIException) else (exc.args[0] if exc.args else ""))
    djangos = _DJANGOS.match(detail)
    if not (djangos and djangos.group(1) == model._meta.object_name or detail in ("", "Not found.")):
        return None  # the view's own message, or another object's (an artifact of the job)
    name = str(model._meta.verbose_name)
    return f"{name[:1].upper()}{name[1:]} {str(pk)[:40]} not found (or not yours)."


def exception_handler(exc: Exception, context: dict[str, Any]):
    """REST_FRAMEWORK["EXCEPTION_HANDLER"]: DRF's handler, a 404 of one object reworded (module docstring)."""
    if isinstance(exc, (Http404, exceptions.NotFound)):
        message = _not_found_message(exc, context)
        if message is not None:
            exc = exceptions.NotFound(message)
    return drf_exception_handler(exc, context)
