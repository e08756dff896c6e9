"""Login rate limiting (django-axes) as Trainboard uses it; settings in ``webapp/settings.py``."""

from __future__ import annotations

from axes.backends import AxesStandaloneBackend
from django.conf import settings
from rest_framework.authtoken.views import ObtainAuthToken
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.settings import api_settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.contrib import messages
from django.shortcuts import render


class RateLimitedLoginBackend(AxesStandaloneBackend):
    """Refuses a login for a locked-out username + IP pair; without a request (``Client.login`` in
    tests, a management command) there is no client to rate-limit and the check is skipped."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if request is None:
            return None
        return super().authenticate(request, username=username, password=password, **kwargs)


def lockout_message() -> str:
    minutes = float(settings.AXES_COOLOFF_TIME) * 60
    return (f"Too many failed login attempts: this account is locked from this address for "
            f"{minutes:g} minutes. Try again later, or ask an administrator to unlock it "
            f"(manage.py axes_reset_username <username>).")


def locked_out(request: HttpRequest, original_response=None, credentials=None) -> HttpResponse:
    """The answer to a locked-out login (``AXES_LOCKOUT_CALLABLE``): 429 Too Many Requests with
    :func:`lockout_message`, as JSON ``{"detail": ...}`` for the API, else the login page with it."""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": lockout_message()}, status=429)
    from django.contrib.auth.forms import AuthenticationForm

    messages.error(request, lockout_message())
    return render(request, "registration/login.html", {"form": AuthenticationForm(request)}, status=429)


class RateLimitedObtainAuthToken(ObtainAuthToken):
    """``POST /api/auth/token/``: DRF's token view, answering a locked-out username + address with
    429 and :func:`lockout_message` (axes marks the DRF request, which its middleware does not see)."""

    # DRF's view names its own parsers; the API's JSON one bounds the nesting (a deep body is a 400).
    parser_classes = api_settings.DEFAULT_PARSER_CLASSES

    def post(self, request, *args, **kwargs):
        try:
            return super().post(request, *args, **kwargs)
        except ValidationError:
            if getattr(request, "axes_locked_out", False):
                return Response({"detail": lockout_message()}, status=429)
            raise
