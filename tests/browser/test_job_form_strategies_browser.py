"""The job form in real Chromium offers only the strategies the chosen backend's image runs: a Vertex AI
backend on its default executor image (torch 2.4) disables fsdp and pipeline and moves a chosen fsdp
back to ddp; the local GPU box offers all three."""

from __future__ import annotations

import re

import pytest

from jobs import services

pytestmark = pytest.mark.browser

ENABLED_JS = """() => Array.from(document.getElementById('id_strategy').options)
  .filter(o => !o.disabled).map(o => o.value)"""


def test_strategies_follow_the_backends_image(live_server, browser_page, user, local_backend):
    services.backend_create(owner=user, name="vertex-default", kind="vertex",
                            config={"project": "my-proj", "staging_bucket": "gs://stage/tb"})
    page = browser_page
    page.set_default_timeout(30_000)
    page.goto(f"{live_server.url}/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "pw-alice-123")
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r"/jobs/$"))

    page.goto(f"{live_server.url}/jobs/new/")
    page.select_option("#id_backend", label="local")
    page.select_option("#id_strategy", "fsdp")
    assert page.evaluate(ENABLED_JS) == ["ddp", "fsdp", "pipeline"]
    page.select_option("#id_backend", label="vertex-default")
    page.wait_for_function("() => document.getElementById('id_strategy').value === 'ddp'")
    assert page.evaluate(ENABLED_JS) == ["ddp"]
    page.select_option("#id_backend", label="local")
    assert page.evaluate(ENABLED_JS) == ["ddp", "fsdp", "pipeline"]
