"""A backend kind's settings, declared once as data.

Each adapter declares ``settings = BackendSettings(...)``: every setting its ``clean_config`` accepts
(:class:`Setting`: key, label, help, type, required, host setting, choices, input bounds, default) and
the credentials a backend of its kind may store (:class:`Secret`). Everything else is built from that
one declaration:

* ``Backend.settings_problems`` starts ``clean_config`` with the checks the declaration alone decides
  (an unknown key, a required setting left blank), worded with the labels below;
* the labels a settings message uses (:class:`cloud_adapters.base.SettingsProblems`), the host
  settings only the operator may set (``jobs.adapters.backend_host_settings``), the secret keys
  (``jobs.adapters.backend_secret_keys``);
* the backend form's inputs per kind (``webapp.forms.BackendForm``), the admin's and the API's list of
  each kind's settings.

A kind whose declaration says all there is to check needs no ``clean_config`` of its own: the default
(``Backend.clean_config``) checks each value's type, choices and bounds and fills the defaults. The
four providers' checks (a region's pattern, a bucket name) stay in their ``clean_config``, which
words each one for its provider. This module imports nothing (``cloud_adapters.base`` imports it).

Usage, in an adapter's module::

    SETTINGS = BackendSettings(
        backend_label="AWS SageMaker", provider="SageMaker",
        settings=(
            Setting("region", "AWS region", "Where jobs run, e.g. us-east-1.", required=True, max_length=30),
            Setting("max_nodes", type=int, default=8, field=False),
        ),
        secrets=(Secret("aws_access_key_id", "AWS access key ID"),),
    )

    class SageMakerBackend(Backend):
        settings = SETTINGS
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

SETTING_TYPES = (str, int, float, bool)
"""The JSON types a setting's value may have (what the form's input for it reads: text, a whole
number, a number, a checkbox)."""


_TYPE_NAMES = {str: "text", int: "whole number", float: "number", bool: "true or false"}


class _NoDefault:
    """The default of a setting without one (required, or computed by ``clean_config``)."""

    def __repr__(self) -> str:
        return "NO_DEFAULT"


NO_DEFAULT: Any = _NoDefault()


@dataclasses.dataclass(frozen=True)
class Setting:
    """One backend setting (a key of ``ComputeBackend.config``)."""

    key: str
    """The config key, e.g. ``"region"``; a Python identifier."""
    label: str = ""
    """How the backend form labels the setting and how its messages name it ("AWS region: expected …");
    "" = named by its key (a setting only the JSON field sets, e.g. ``endpoint_url``)."""
    help: str = ""
    """The backend form's help text under the input: what the setting does, an example, what blank means."""
    type: type = str
    """One of :data:`SETTING_TYPES`: the value's JSON type and the form's input (``float`` reads as a
    decimal of at most 6 places, stored as a float)."""
    required: bool = False
    """A backend of this kind cannot do without it: blank is "<label> is required for a <backend>
    backend." and the form labels it "(required)"."""
    host: bool = False
    """A host setting: it decides what runs on a machine the installation operates, where and how many
    processes at once, or where the worker sends its calls and with whose credentials. Only a staff
    user's backend sets it; anyone else's takes the installation's value (``jobs.adapters.backend_adapter``)."""
    field: bool = True
    """The backend form has an input of its own for it; False = set in the form's JSON field ("Other
    settings") or the API's ``config``."""
    choices: tuple[tuple[str, str], ...] = ()
    """``((value, label), ...)`` when the value is one of a few; the form shows a select."""
    min_value: int | float | None = None
    """The least value the form's number input takes (Django's message below it); None = no bound."""
    max_value: int | float | None = None
    """The greatest value the form's number input takes; None = no bound. ``clean_config`` checks the
    setting's full range and words its own message."""
    max_length: int | None = None
    """The longest text the form's input takes; None = no bound."""
    default: Any = NO_DEFAULT
    """The value ``clean_config`` uses when the setting is left out; :data:`NO_DEFAULT` when it is
    required or computed (a region's default image)."""

    def __post_init__(self) -> None:
        # A declaration error is the adapter author's, found at import rather than on a form.
        if not self.key.isidentifier():
            raise ValueError(f"setting key {self.key!r} is not an identifier")
        if self.type not in SETTING_TYPES:
            raise ValueError(f"setting {self.key}: type {self.type!r} is not one of str, int, float, bool")
        if self.choices and self.type is not str:
            raise ValueError(f"setting {self.key}: choices are text values")
        if self.field and not self.label:
            raise ValueError(f"setting {self.key}: a form input needs a label")

    @property
    def has_default(self) -> bool:
        return self.default is not NO_DEFAULT

    def describe(self) -> str:
        """One line of a settings list (the API's and the admin's help): ``region (AWS region; required)``,
        ``tier (Tier; dedicated | low_priority)``, ``max_nodes (whole number)``, ``profile (AWS profile
        name; staff only)``."""
        facts = [self.label] if self.label else []
        if self.choices:
            facts.append(" | ".join(value for value, _ in self.choices))
        elif self.type is not str:
            facts.append(_TYPE_NAMES[self.type])
        if self.required:
            facts.append("required")
        if self.host:
            facts.append("staff only")
        return f"{self.key} ({'; '.join(facts)})" if facts else self.key


@dataclasses.dataclass(frozen=True)
class Secret:
    """One credential a backend may store, encrypted, write-only (``ComputeBackend.secrets``)."""

    key: str
    """The key in the stored secrets, e.g. ``"aws_access_key_id"``."""
    label: str
    """How the backend form labels its input, e.g. "AWS access key ID"."""
    required: bool = True
    """Required once any secret of the kind is given (an access key id without its secret is refused);
    an optional one (a session token) may be left out."""
    multiline: bool = False
    """A key file pasted whole (a textarea), not one line (a password input)."""

    def describe(self) -> str:
        """One line of a credentials list: ``aws_access_key_id (AWS access key ID)``, ``aws_session_token
        (AWS session token; optional)``."""
        return f"{self.key} ({self.label}{'' if self.required else '; optional'})"


@dataclasses.dataclass(frozen=True)
class BackendSettings:
    """The settings and credentials of one backend kind, in the order the backend form shows them."""

    backend_label: str
    """The backend as messages name it: "AWS SageMaker" in "S3 bucket is required for an AWS SageMaker
    backend." (the registry's label of the kind)."""
    provider: str
    """The provider as "unknown <provider> setting" names it, e.g. "SageMaker"."""
    settings: tuple[Setting, ...] = ()
    secrets: tuple[Secret, ...] = ()

    def __post_init__(self) -> None:
        keys = [s.key for s in self.settings]
        secret_keys = [s.key for s in self.secrets]
        for name, listed in (("setting", keys), ("secret", secret_keys)):
            repeated = sorted({k for k in listed if listed.count(k) > 1})
            if repeated:
                raise ValueError(f"{self.provider}: {name} {', '.join(repeated)} declared twice")

    def __iter__(self) -> Iterator[Setting]:
        return iter(self.settings)

    def __getitem__(self, key: str) -> Setting:
        for setting in self.settings:
            if setting.key == key:
                return setting
        raise KeyError(key)

    @property
    def keys(self) -> frozenset[str]:
        """Every setting ``clean_config`` accepts."""
        return frozenset(s.key for s in self.settings)

    @property
    def required(self) -> tuple[str, ...]:
        """The required settings, in declaration order (the order their messages come in)."""
        return tuple(s.key for s in self.settings if s.required)

    @property
    def host(self) -> frozenset[str]:
        """The host settings (:attr:`Setting.host`)."""
        return frozenset(s.key for s in self.settings if s.host)

    @property
    def labels(self) -> dict[str, str]:
        """``{key: label}`` of the settings that have a label."""
        return {s.key: s.label for s in self.settings if s.label}

    @property
    def defaults(self) -> dict[str, Any]:
        """``{key: default}`` of the settings that have a default."""
        return {s.key: s.default for s in self.settings if s.has_default}

    @property
    def fields(self) -> tuple[Setting, ...]:
        """The settings with an input of their own on the backend form, in order."""
        return tuple(s for s in self.settings if s.field)

    @property
    def secret_keys(self) -> dict[str, bool]:
        """``{secret key: required once any is given}``; {} for a kind that stores none."""
        return {s.key: s.required for s in self.secrets}

    def secret(self, key: str) -> Secret:
        for secret in self.secrets:
            if secret.key == key:
                return secret
        raise KeyError(key)
