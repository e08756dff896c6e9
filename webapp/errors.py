"""Carry a service's ``django.core.exceptions.ValidationError`` to where the user sees it.

Services (``jobs.services``) raise one ValidationError whose ``message_dict`` is keyed by the form/API
field names, ``__all__`` for errors that belong to no field (docs/internal-api.md); a key with a dot
names a part of a field (``config.region``: the backend setting ``region`` inside ``config``). The UI
puts each message on its form field (a part's on the field itself when the form has no field for the
part); the API answers 400 with the fields' keys (``__all__`` becomes DRF's ``non_field_errors``, a
part's message is listed under its field).

:func:`submit_form` shows the form's own errors and the service's together, after one submit.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from django import forms
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError as DjangoValidationError
from rest_framework import serializers
from rest_framework.exceptions import ErrorDetail
from rest_framework.settings import api_settings

from jobs.validation import coded_errors, field_of, trial_call  # noqa: F401 (webapp.errors.trial_call, ...)

T = TypeVar("T")


def service_error_dict(exc: DjangoValidationError) -> dict[str, list[str]]:
    """``{field: [message, ...]}`` for any ValidationError, dict-shaped or not."""
    if hasattr(exc, "error_dict"):
        return {field: list(messages) for field, messages in exc.message_dict.items()}
    return {NON_FIELD_ERRORS: list(exc.messages)}


def add_service_errors(form: forms.BaseForm, exc: DjangoValidationError,
                       field_map: dict[str, str] | None = None) -> None:
    """Put each message of ``exc`` on the form field it names (via ``field_map`` when the service's
    name differs from the form's); a message for a field the form lacks goes to the form's top."""
    field_map = field_map or {}
    for field, messages in service_error_dict(exc).items():
        name = field_map.get(field, field)
        if name not in form.fields and field_of(name) in form.fields:
            name = field_of(name)
        for message in messages:
            if name in form.fields:
                form.add_error(name, message)
            elif field == NON_FIELD_ERRORS:
                form.add_error(None, message)
            else:
                form.add_error(None, f"{name}: {message}")


def submit_form(form: forms.BaseForm, call: Callable[[], T],
                add_errors: Callable[[forms.BaseForm, DjangoValidationError], None] | None = None,
                check: Callable[[], object] | None = None) -> T | None:
    """Validate ``form`` and call the service ``call`` (which reads ``form.cleaned_data``); the
    service's result when both accept, else None with every error on the form (the form's own and
    the service's, in one submit: :func:`trial_call`; ``check``, the service's pure check, is called
    instead on a form with errors). ``add_errors`` puts the service's errors on the form (default
    :func:`add_service_errors`).
    """
    valid = form.is_valid()
    result, exc = trial_call(call, valid=valid, flagged=set(form.errors) if not valid else set(), check=check)
    if exc is not None:
        (add_errors or add_service_errors)(form, exc)
    return result


def to_drf_validation_error(exc: DjangoValidationError,
                            field_map: dict[str, str] | None = None) -> serializers.ValidationError:
    """The DRF ``ValidationError`` (HTTP 400) carrying ``exc``'s messages under the API's field names."""
    field_map = field_map or {}
    detail: dict[str, list[str]] = {}
    for field, messages in coded_errors(exc).items():
        key = (api_settings.NON_FIELD_ERRORS_KEY if field == NON_FIELD_ERRORS
               else field_map.get(field, field_of(field)))
        detail.setdefault(key, []).extend(ErrorDetail(m, code=code or "invalid") for m, code in messages)
    return serializers.ValidationError(detail)
