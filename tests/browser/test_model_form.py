"""The model form in Chromium: the parameters follow the architecture unless the user edited them,
so a switch from cnn to mlp does not keep cnn's parameters and fail on save with "channels: unknown
parameter for mlp"."""

from __future__ import annotations

import json
import re

import pytest

from jobs.models import ModelSpec
from trainer_pkg.registry import ARCHITECTURES

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _log_in(page, base_url: str) -> None:
    page.goto(f"{base_url}/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "pw-alice-123")
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r"/jobs/$"))


def _params(page) -> dict:
    return json.loads(page.input_value("#id_params"))


@pytest.fixture
def page(live_server, browser_page, user):
    problems: list[str] = []
    browser_page.on("pageerror", lambda exc: problems.append(str(exc)))
    browser_page.set_default_timeout(20_000)
    _log_in(browser_page, live_server.url)
    yield browser_page
    assert problems == []


def test_switching_cnn_to_mlp_saves_with_mlps_defaults(live_server, page, user):
    page.goto(f"{live_server.url}/models/new/")
    assert _params(page) == ARCHITECTURES["cnn"].defaults()
    page.fill("#id_name", "tab-mlp")
    page.select_option("#id_architecture", "mlp")
    assert _params(page) == ARCHITECTURES["mlp"].defaults()
    page.click("form.form button[type=submit]")
    page.wait_for_url(re.compile(r"/models/$"))
    saved = ModelSpec.objects.get(owner=user, name="tab-mlp")
    assert (saved.architecture, saved.params) == ("mlp", ARCHITECTURES["mlp"].defaults())


def test_edited_parameters_are_kept_and_saved_ones_come_back(live_server, page, user, cnn_model):
    # Typed by the user: a switch does not replace them.
    page.goto(f"{live_server.url}/models/new/")
    page.fill("#id_name", "wide")
    page.fill("#id_params", '{"hidden_size": 512}')
    page.select_option("#id_architecture", "mlp")
    assert page.input_value("#id_params") == '{"hidden_size": 512}'
    page.click("form.form button[type=submit]")
    page.wait_for_url(re.compile(r"/models/$"))
    assert ModelSpec.objects.get(owner=user, name="wide").params == {
        **ARCHITECTURES["mlp"].defaults(), "hidden_size": 512}

    # An edit page: the saved cnn parameters give way to resnet's defaults, and come back with cnn.
    page.goto(f"{live_server.url}/models/{cnn_model.pk}/edit/")
    assert _params(page) == cnn_model.params
    page.select_option("#id_architecture", "resnet")
    assert _params(page) == ARCHITECTURES["resnet"].defaults()
    page.select_option("#id_architecture", "cnn")
    assert _params(page) == cnn_model.params


def test_text_shown_back_after_an_error_is_the_users_and_is_kept(live_server, page, user):
    page.goto(f"{live_server.url}/models/new/")
    page.fill("#id_name", "not a slug")  # refused: the page comes back with what was typed
    page.fill("#id_params", '{"channels": 8}')
    page.click("form.form button[type=submit]")
    page.wait_for_selector("#field-name.has-error")
    assert _params(page) == {"channels": 8}
    page.select_option("#id_architecture", "resnet")
    assert _params(page) == {"channels": 8}
    # "Fill in the defaults" writes them; from then on they follow the architecture again.
    page.click("#fill-defaults")
    assert _params(page) == ARCHITECTURES["resnet"].defaults()
    page.select_option("#id_architecture", "mlp")
    assert _params(page) == ARCHITECTURES["mlp"].defaults()
