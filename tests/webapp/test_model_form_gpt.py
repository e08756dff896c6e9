"""The registry-driven model form and API take the ``gpt`` language model: its parameters (two of
them true/false), their docs beside the form, and the cross-parameter check with its message."""

from __future__ import annotations

import json

import pytest
from django.urls import reverse

from jobs.models import ModelSpec

pytestmark = pytest.mark.django_db

GPT_DEFAULTS = {"layers": 4, "heads": 4, "embed_dim": 128, "context_length": 128, "dropout": 0.0,
                "tied_embeddings": True, "bias": True}


def test_the_form_creates_a_gpt_model_with_true_false_parameters(owner_client):
    page = owner_client.get(reverse("model-create")).content.decode()
    assert '<option value="gpt">gpt — Decoder-only transformer language model' in page
    assert '<section class="arch" data-arch="gpt">' in page
    assert "tied_embeddings" in page and "true or false" in page
    response = owner_client.post(reverse("model-create"), {
        "name": "tiny-gpt", "kind": "builtin", "architecture": "gpt",
        "params": json.dumps({"layers": 2, "embed_dim": 64, "tied_embeddings": False})})
    assert response.status_code == 302, response.context["form"].errors
    spec = ModelSpec.objects.get()
    assert (spec.architecture, spec.params) == (
        "gpt", {**GPT_DEFAULTS, "layers": 2, "embed_dim": 64, "tied_embeddings": False})


def test_the_form_and_the_api_name_a_bad_gpt_parameter(owner_client, api_client):
    response = owner_client.post(reverse("model-create"), {
        "name": "bad-gpt", "kind": "builtin", "architecture": "gpt",
        "params": json.dumps({"embed_dim": 100, "heads": 3})})
    assert response.status_code == 200
    errors = response.context["form"].errors["params"]
    assert any("100 is not divisible by heads 3" in e and "e.g. 99" in e for e in errors), errors
    bad = api_client.post("/api/models/", {"name": "g2", "architecture": "gpt", "params": {"bias": "yes"}},
                          format="json")
    assert bad.status_code == 400 and "expected true or false, got 'yes'" in bad.json()["params"][0]
    good = api_client.post("/api/models/", {"name": "g", "architecture": "gpt", "params": {"heads": 8}},
                           format="json")
    assert good.status_code == 201, good.json()
    assert good.json()["params"] == {**GPT_DEFAULTS, "heads": 8}
    assert ModelSpec.objects.count() == 1
