"""Production settings (DJANGO_ENV=production): `check --deploy` is clean, the security headers are on
the responses, and login attempts are rate limited (django-axes)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from django.urls import reverse

REPO_ROOT = Path(__file__).resolve().parents[2]


def _production_env(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "PYTEST"))}
    env.update({
        "DJANGO_ENV": "production",
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
        "DJANGO_ALLOWED_HOSTS": "trainboard.example.com,127.0.0.1",
        "DJANGO_SETTINGS_MODULE": "webapp.settings",
        "TRAINBOARD_VAR_DIR": str(tmp_path / "var"),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'prod.sqlite3'}",
    })
    env.pop("REDIS_URL", None)
    return env


def test_check_deploy_is_clean_under_production_settings(tmp_path):
    result = subprocess.run([sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
                            cwd=REPO_ROOT, env=_production_env(tmp_path), capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


def test_production_refuses_to_start_without_a_secret_key(tmp_path):
    env = _production_env(tmp_path)
    del env["DJANGO_SECRET_KEY"]
    result = subprocess.run([sys.executable, "manage.py", "check"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode != 0
    assert "DJANGO_SECRET_KEY must be set when DJANGO_ENV=production" in result.stderr


_HEADERS_SCRIPT = r"""
import json, django
django.setup()
from django.test import Client
c = Client(HTTP_HOST="trainboard.example.com")
secure = c.get("/login/", secure=True)
plain = c.get("/login/")
health = Client(HTTP_HOST="127.0.0.1:8000").get("/healthz")
print(json.dumps({
    "secure_status": secure.status_code, "secure_headers": dict(secure.headers),
    "secure_cookies": {k: {"secure": v["secure"], "httponly": v["httponly"]} for k, v in secure.cookies.items()},
    "plain_status": plain.status_code, "plain_location": plain.headers.get("Location", ""),
    "health_status": health.status_code,
}))
"""


def test_production_responses_carry_hsts_csp_and_redirect_to_https(tmp_path):
    result = subprocess.run([sys.executable, "-c", _HEADERS_SCRIPT], cwd=REPO_ROOT, env=_production_env(tmp_path),
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    headers = out["secure_headers"]
    assert out["secure_status"] == 200
    assert headers["Strict-Transport-Security"] == "max-age=31536000; includeSubDomains; preload"
    csp = headers["Content-Security-Policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp.split("script-src", 1)[1].split(";", 1)[0]
    assert headers["Referrer-Policy"] == "same-origin"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["X-Frame-Options"] == "DENY"
    assert out["secure_cookies"]["csrftoken"]["secure"] is True
    assert out["plain_status"] == 301 and out["plain_location"] == "https://trainboard.example.com/login/"
    assert out["health_status"] == 200  # a container's health check over plain HTTP is not redirected


@pytest.mark.django_db
def test_pages_send_the_csp_and_use_no_inline_script(client, django_user_model):
    """The policy allows scripts from this origin only; every page's scripts are files (json_script
    data blocks are not executed), and Swagger UI loads its start-up script as a file too."""
    import re

    user = django_user_model.objects.create_user(username="csp", password="pw-csp-Secret-1")
    client.force_login(user)
    for url in [reverse("job-list"), reverse("job-create"), reverse("model-create"), reverse("backend-create"),
                reverse("dataset-create"), reverse("api-docs")]:
        r = client.get(url)
        assert r.status_code == 200, url
        assert "script-src 'self'" in r.headers["Content-Security-Policy"], url
        body = r.content.decode()
        inline = [m for m in re.findall(r"<script([^>]*)>(.*?)</script>", body, re.S)
                  if "src=" not in m[0] and 'type="application/json"' not in m[0] and m[1].strip()]
        assert not inline, (url, inline[:1])
    docs = client.get(reverse("api-docs")).content.decode()
    script = re.search(r'<script src="([^"]*\?script=[^"]*)"', docs)
    assert script, "Swagger UI should load its start-up script as a file"
    js = client.get(script.group(1).replace("&amp;", "&"))
    assert js.status_code == 200 and js["Content-Type"].startswith("application/javascript")


@pytest.mark.django_db
def test_login_is_rate_limited_with_a_clear_message(client, django_user_model, settings):
    settings.AXES_FAILURE_LIMIT = 3
    django_user_model.objects.create_user(username="frank", password="pw-frank-Secret-1")
    login = reverse("login")

    def attempt(password):
        return client.post(login, {"username": "frank", "password": password})

    # Below the limit: wrong passwords are the usual form error, and the right one still logs in.
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        r = attempt("wrong")
        assert r.status_code == 200 and "Please enter a correct username and password" in r.content.decode()
    r = attempt("pw-frank-Secret-1")
    assert r.status_code == 302 and r["Location"] == reverse("job-list")
    client.post(reverse("logout"))

    # A good login reset the count: the limit is counted again from zero; the Nth failure locks.
    for i in range(settings.AXES_FAILURE_LIMIT):
        r = attempt("wrong")
    assert r.status_code == 429
    # The N+1-th attempt is refused even with the right password, with the message.
    r = attempt("pw-frank-Secret-1")
    body = r.content.decode()
    assert r.status_code == 429
    assert "Too many failed login attempts" in body and "15 minutes" in body
    assert "_auth_user_id" not in client.session
    # The API's token endpoint is locked for the same username and address.
    from rest_framework.test import APIClient

    api = APIClient()
    r = api.post(reverse("api-token"), {"username": "frank", "password": "pw-frank-Secret-1"})
    assert r.status_code == 429 and "Too many failed login attempts" in r.json()["detail"]
    # Another user from the same address is not locked out by frank's failures.
    django_user_model.objects.create_user(username="gina", password="pw-gina-Secret-1")
    r = client.post(login, {"username": "gina", "password": "pw-gina-Secret-1"})
    assert r.status_code == 302
