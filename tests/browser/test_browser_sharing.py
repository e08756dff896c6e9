"""``browser_page`` (tests/conftest.py, ``BrowserRun``): consecutive browser tests share one Chromium,
each in a browser context of its own, and a test that is not a browser test runs with Playwright
closed (no asyncio loop running in this thread, Django's async-safety check on).

The three tests run in this order (one file is one unit of an xdist run); each records what the next
one compares against.
"""

from __future__ import annotations

import asyncio
import os

import pytest

import fixture_report

pytestmark = pytest.mark.browser

COOKIE = {"name": "left-by-the-first-test", "value": "1", "url": "http://127.0.0.1:9/"}
seen: dict[str, object] = {}


def test_a_first_page_leaves_a_cookie_in_its_context(browser_page):
    browser_page.context.add_cookies([COOKIE])
    assert [c["name"] for c in browser_page.context.cookies(COOKIE["url"])] == [COOKIE["name"]]
    seen["browser"] = browser_page.context.browser
    seen["launches"] = fixture_report.started("chromium")


def test_the_next_page_is_a_fresh_context_of_the_same_chromium(browser_page):
    if "browser" not in seen:
        pytest.fail("run this file whole: this test compares against the one before it")
    assert browser_page.context.cookies(COOKIE["url"]) == []
    assert browser_page.context.browser is seen["browser"] and seen["browser"].is_connected()
    assert fixture_report.started("chromium") == seen["launches"], "no second Chromium"
    assert len(seen["browser"].contexts) == 1, "the first test's context was closed"


def test_a_test_without_a_page_runs_with_playwright_closed():
    if "browser" not in seen:
        pytest.fail("run this file whole: this test follows two browser tests")
    assert not seen["browser"].is_connected()
    assert "DJANGO_ALLOW_ASYNC_UNSAFE" not in os.environ
    assert asyncio.run(asyncio.sleep(0, result="no loop was running")) == "no loop was running"
