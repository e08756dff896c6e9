"""Pieces of rendered pages the web UI tests look into."""

from __future__ import annotations

import re


def field_block(html: str, name: str) -> str:
    """The rendered ``webapp/_field.html`` block of field ``name`` (label, input, help, errors)."""
    match = re.search(rf'<div class="field[^"]*" id="field-{name}">(.*?)</div>', html, re.S)
    assert match, f"no field {name} on the page"
    return match.group(1)
