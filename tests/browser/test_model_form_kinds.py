"""The model form's kinds in Chromium: each kind shows its own fields only, and a model of your code
is created by uploading an archive through the file input (a real multipart POST from the browser)."""

from __future__ import annotations

import re

import pytest

from codekit import MODEL_FILES, zip_bytes
from jobs.models import ModelSpec

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def page(live_server, browser_page, user, settings, tmp_path):
    settings.TRAINBOARD_CODE_STORE = tmp_path / "store"
    problems: list[str] = []
    browser_page.on("pageerror", lambda exc: problems.append(str(exc)))
    browser_page.set_default_timeout(20_000)
    browser_page.goto(f"{live_server.url}/login/")
    browser_page.fill("#id_username", "alice")
    browser_page.fill("#id_password", "pw-alice-123")
    browser_page.click("button[type=submit]")
    browser_page.wait_for_url(re.compile(r"/jobs/$"))
    yield browser_page
    assert problems == []


def test_each_kind_shows_its_fields_and_an_upload_creates_the_model(live_server, page, user, tmp_path):
    page.goto(f"{live_server.url}/models/new/")
    visible = lambda selector: page.is_visible(selector)  # noqa: E731
    assert visible("#id_architecture") and not visible("#id_entry_point") and not visible("#id_code")
    page.check("input[name=kind][value=script]")
    assert not visible("#id_architecture") and visible("#id_entry_point") and visible("#id_script_args")
    assert not visible("#id_shard_classes") and not visible(".arch-docs")
    page.check("input[name=kind][value=code]")
    assert visible("#id_shard_classes") and visible("#id_function_params") and not visible("#id_script_args")
    archive = tmp_path / "tiny.zip"
    archive.write_bytes(zip_bytes(MODEL_FILES))
    page.fill("#id_name", "tiny")
    page.set_input_files("#id_code", str(archive))
    page.fill("#id_entry_point", "mymodel.net:build")
    page.fill("#id_function_params", '{"width": 8}')
    page.fill("#id_shard_classes", "Block")
    page.click("form.form button[type=submit]")
    page.wait_for_url(re.compile(r"/models/$"))
    spec = ModelSpec.objects.get(owner=user, name="tiny")
    assert (spec.kind, spec.params, spec.shard_classes, spec.code.file_count) == ("code", {"width": 8}, ["Block"], 4)
    assert spec.code.sha256[:12] in page.inner_text("table")
    # After an error the page comes back on the kind chosen, its message on the field.
    page.goto(f"{live_server.url}/models/new/")
    page.check("input[name=kind][value=code]")
    page.fill("#id_name", "tiny2")
    page.set_input_files("#id_code", str(archive))
    page.fill("#id_entry_point", "mymodel.net:Block")
    page.click("form.form button[type=submit]")
    page.wait_for_selector("#field-entry_point .error")
    assert "'Block' in mymodel/net.py is a class, not a function" in page.inner_text("#field-entry_point .error")
    assert visible("#id_entry_point") and not visible("#id_architecture")
