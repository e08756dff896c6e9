"""The browser tests drive Debian's Chromium through Playwright (``browser_page``, tests/conftest.py);
what they capture (screenshots) goes under test-artifacts/browser."""

from __future__ import annotations

from pathlib import Path

import pytest

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "browser"


@pytest.fixture
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
