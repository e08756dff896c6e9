"""Carry a service's ``django.core.exceptions.ValidationError`` to where the user sees it.

Services (``jobs.services``) raise one ValidationError whose ``message_dict`` is keyed by the form/API
field names, ``__all__`` for errors that belong to no field (docs/internal-api.md). The UI puts each
message on its form field; the API answers 400 with the same keys (``__all__`` becomes DRF's
``non_field_errors``).
"""

from __future__ import annotations

from django import forms
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError as DjangoValidationError
from rest_framework import serializers
from rest_framework.settings import api_settings


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
        for message in messages:
            if name in form.fields:
                form.add_error(name, message)
            elif field == NON_FIELD_ERRORS:
                form.add_error(None, message)
            else:
                form.add_error(None, f"{name}: {message}")


def to_drf_validation_error(exc: DjangoValidationError,
                            field_map: dict[str, str] | None = None) -> serializers.ValidationError:
    """The DRF ``ValidationError`` (HTTP 400) carrying ``exc``'s messages under the API's field names."""
    field_map = field_map or {}
    detail: dict[str, list[str]] = {}
    for field, messages in service_error_dict(exc).items():
        key = api_settings.NON_FIELD_ERRORS_KEY if field == NON_FIELD_ERRORS else field_map.get(field, field)
        detail.setdefault(key, []).extend(messages)
    return serializers.ValidationError(detail)
