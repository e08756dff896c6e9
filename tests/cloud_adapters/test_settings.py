"""The settings declarations (cloud_adapters.settings): what each provider declares, what is derived
from it, and the default clean_config a declaration alone drives."""

from __future__ import annotations

import pytest

from cloud_adapters import registry
from cloud_adapters.base import InvalidSpec, setting_value
from cloud_adapters.settings import BackendSettings, Secret, Setting
from backend_fakes import OfflineBackend


class TinyBackend(OfflineBackend):
    """A provider that is nothing but its declaration."""

    kind = "tiny"
    settings = BackendSettings(backend_label="Tiny cloud", provider="Tiny", settings=(
        Setting("project", "Project", "The project that pays.", required=True, max_length=20),
        Setting("tier", "Tier", choices=(("a", "A"), ("b", "B")), default="a"),
        Setting("nodes", "Max nodes", type=int, min_value=1, max_value=8, default=2),
        Setting("rate", "Rate", type=float, min_value=0, default=0.0),
        Setting("spot", "Spot", type=bool, default=False),
        Setting("endpoint", host=True, field=False),
    ), secrets=(Secret("token", "API token"), Secret("note", "Note", required=False)))


def test_what_the_declaration_gives():
    schema = TinyBackend.settings
    assert schema.keys == {"project", "tier", "nodes", "rate", "spot", "endpoint"}
    assert schema.required == ("project",)
    assert schema.host == {"endpoint"}
    assert schema.labels == {"project": "Project", "tier": "Tier", "nodes": "Max nodes", "rate": "Rate",
                             "spot": "Spot"}
    assert schema.defaults == {"tier": "a", "nodes": 2, "rate": 0.0, "spot": False}
    assert [s.key for s in schema.fields] == ["project", "tier", "nodes", "rate", "spot"]
    assert schema.secret_keys == {"token": True, "note": False}
    assert schema["nodes"].max_value == 8 and schema.secret("token").label == "API token"


def test_the_default_clean_config_checks_the_declaration_and_fills_its_defaults():
    assert TinyBackend.clean_config({"project": " vision ", "nodes": 4, "rate": 2, "endpoint": ""}) == {
        "project": "vision", "tier": "a", "nodes": 4, "rate": 2.0, "spot": False}
    with pytest.raises(InvalidSpec) as err:
        TinyBackend.clean_config({"region": "x", "tier": "c", "nodes": 9, "rate": "1", "spot": "yes"})
    assert err.value.errors == {
        "region": ["region: unknown Tiny setting (known: endpoint, nodes, project, rate, spot, tier)."],
        "project": ["Project is required for a Tiny cloud backend."],
        "tier": ["Tier: expected one of 'a', 'b', got 'c'."],
        "nodes": ["Max nodes: expected a number from 1 to 8, got 9."],
        "rate": ["Rate: expected a number, got '1'."],
        "spot": ["Spot: expected true or false, got 'yes'."],
    }
    assert str(err.value).startswith("region: unknown Tiny setting")


@pytest.mark.parametrize("setting, value, message", [
    (Setting("n", type=int, field=False), True, "n: expected a whole number, got True."),
    (Setting("n", type=int, field=False), 1.5, "n: expected a whole number, got 1.5."),
    (Setting("x", type=float, field=False), float("inf"), "x: expected a finite number, got inf."),
    (Setting("x", type=float, max_value=1, field=False), 2, "x: expected a number at most 1, got 2.0."),
    (Setting("x", type=float, min_value=0.5, field=False), 0.25, "x: expected a number at least 0.5, got 0.25."),
    (Setting("s", max_length=3, field=False), "abcd", "s: at most 3 characters, got 4."),
    (Setting("s", field=False), {"a": 1}, "s: expected text, got {'a': 1}."),
])
def test_a_value_against_its_setting(setting, value, message):
    with pytest.raises(InvalidSpec) as err:
        setting_value(setting, value)
    assert str(err.value) == message


@pytest.mark.parametrize("make, message", [
    (lambda: Setting("not a key", "Label"), "not an identifier"),
    (lambda: Setting("n", "N", type=list), "not one of str, int, float, bool"),
    (lambda: Setting("n", "N", type=int, choices=(("1", "one"),)), "choices are text values"),
    (lambda: Setting("n"), "a form input needs a label"),
    (lambda: BackendSettings("X", "X", settings=(Setting("a", field=False), Setting("a", field=False))),
     "setting a declared twice"),
])
def test_a_wrong_declaration_fails_at_import(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_credentials_go_to_the_constructor_and_stay_read_only():
    backend = TinyBackend({"project": "p"}, secrets={"token": "t"})
    assert dict(backend.secrets) == {"token": "t"}
    with pytest.raises(TypeError):
        backend.secrets["token"] = "other"  # type: ignore[index]
    assert dict(TinyBackend({"project": "p"}).secrets) == {}
    assert "secrets" not in vars(TinyBackend) and "secrets" not in vars(OfflineBackend)


EXPECTED = {
    "gpubox": ((), {"run_root", "python", "max_procs_per_node", "pip_args", "run_as", "job_uids",
                          "job_memory_limit", "env_passthrough", "allowed_images", "gpu_ids", "slots", "max_concurrent_jobs"}, {}),
    "sagemaker": (("region", "role_arn", "bucket"), {"profile", "endpoint_url"},
                  {"aws_access_key_id": True, "aws_secret_access_key": True, "aws_session_token": False}),
    "vertex": (("project", "staging_bucket"), {"api_endpoint", "storage_endpoint"}, {"service_account_json": True}),
    "azureml": (("subscription_id", "resource_group", "workspace", "compute"), {"base_url"},
                {"tenant_id": True, "client_id": True, "client_secret": True}),
    "ray": ((), {"address", "python"}, {"token": False}),
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_each_provider_declares_its_required_host_and_secret_keys(kind):
    schema = registry.backend_settings(kind)
    assert (schema.required, schema.host, schema.secret_keys) == EXPECTED[kind]
    # Messages name the backend as the registry labels it.
    assert schema.backend_label == registry.KINDS[kind].label
    # Every setting with an input on the form has help under it.
    assert all(s.help for s in schema.fields)
    # The declared defaults are what clean_config fills in (a required setting has none).
    assert not set(schema.defaults) & set(schema.required)
