"""Playwright on Debian's Chromium (never a downloaded browser)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from django.db import connections

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "browser"


@pytest.fixture
def browser_page(monkeypatch):
    """A fresh Chromium page (1280 px wide), closed after the test."""
    from playwright.sync_api import sync_playwright

    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium package (apt-get install chromium)")
    # The live server runs in this process; Playwright's sync API needs Django's async-safety check off.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run"],
        )
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        try:
            yield page
        finally:
            context.close()
            browser.close()
            # Django keeps one connection per async context, and Playwright's sync API runs the
            # test in a context of its own: close the connections the test opened in it, or the
            # test database cannot be dropped at the end of the run.
            connections.close_all()



@pytest.fixture
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
