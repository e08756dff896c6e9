"""The backend form's settings per kind (each adapter's ``settings`` declaration) and the Test connection button
(UI, htmx fragment, API): real forms and views through Django's test client."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse
from django.utils.html import escape

from cloud_adapters import registry
from cloud_adapters.settings import BackendSettings, Setting
from jobs import services
from jobs.models import ComputeBackend
from webapp import forms as webapp_forms
from backend_fakes import OfflineBackend

pytestmark = pytest.mark.django_db

ROLE = "arn:aws:iam::123456789012:role/SageMakerTraining"


def field(kind: str, key: str) -> str:
    """The form field of ``kind``'s setting ``key``: the key itself, or ``<kind>_<key>`` where another
    registered kind has a setting of that name (which kinds are registered decides)."""
    name = webapp_forms.BackendForm().setting_field(kind, key)
    assert name, (kind, key)
    return name


def settings_post(kind: str, **settings) -> dict:
    """POST data of ``kind``'s settings under their form field names."""
    return {field(kind, key): value for key, value in settings.items()}


def sagemaker_post(**overrides) -> dict:
    settings = {"region": "eu-west-1", "role_arn": ROLE, "bucket": "tb-bucket", "prefix": "team-a/", "image_uri": "",
                "instance_type": "ml.g5.xlarge", "spot_allowed": "on", "profile": "training"}
    settings.update(overrides)
    return {"name": "sm", "kind": "sagemaker", "extra_config": "", "enabled": "on",
            **settings_post("sagemaker", **settings),
            # A value typed into the GPU box's fieldset before switching kind: ignored, even if invalid.
            "max_procs_per_node": "abc", "hourly_rate_usd": ""}


@pytest.fixture
def sagemaker_backend(user):
    return services.backend_create(owner=user, name="sm", kind="sagemaker", config={
        "region": "us-east-1", "role_arn": ROLE, "bucket": "tb-test-bucket", "spot_allowed": True})


def field_names(html: str) -> set[str]:
    return set(re.findall(r'name="([^"]+)"', html))


# --- the form --------------------------------------------------------------------------------


def test_new_backend_page_shows_each_kinds_settings_and_no_secret(owner_client):
    page = owner_client.get(reverse("backend-create")).content.decode()
    assert '<fieldset class="kind-settings" data-kind="gpubox">' in page
    assert '<fieldset class="kind-settings" data-kind="sagemaker">' in page
    assert "AWS SageMaker settings" in page and "Local GPU box (torchrun) settings" in page
    assert {"max_procs_per_node", "hourly_rate_usd"} | {field("sagemaker", key) for key in (
        "region", "role_arn", "bucket", "prefix", "image_uri", "instance_type", "spot_allowed", "profile")
    } <= field_names(page)
    # Credentials are write-only fields named secret_<kind>_<key> (password inputs, never a value).
    # Job secrets (environment variables for the jobs) are one write-only textarea.
    assert not {n for n in field_names(page) if re.search("secret|access_key|token|password", n)} - {
        "csrfmiddlewaretoken", "job_secrets"} - {n for n in field_names(page) if n.startswith("secret_")}
    assert re.search(r'<textarea name="job_secrets"[^>]*>\s*</textarea>', page)
    assert not re.search(r'type="password"[^>]*value=', page)
    assert "backend_form.js" in page
    assert "blank uses AWS&#x27;s PyTorch training container" in page


def test_required_cloud_settings_are_labelled_required(owner_client):
    page = owner_client.get(reverse("backend-create")).content.decode()

    def label(kind: str, key: str) -> str:
        name = field(kind, key)
        match = re.search(rf'<label for="id_{name}">(.*?)</label>', page)
        assert match, name
        return match.group(1)

    assert label("sagemaker", "role_arn") == 'Execution role ARN <span class="muted">(required)</span>'
    assert label("vertex", "staging_bucket") == 'Staging bucket <span class="muted">(required)</span>'
    assert label("azureml", "subscription_id") == 'Subscription ID <span class="muted">(required)</span>'
    assert label("sagemaker", "prefix") == 'S3 prefix <span class="muted">(optional)</span>'


def test_create_a_sagemaker_backend_from_its_fields(owner_client, user):
    response = owner_client.post(reverse("backend-create"), sagemaker_post())
    assert response.status_code == 302, response.context["form"].errors
    backend = ComputeBackend.objects.get(owner=user, name="sm")
    assert backend.kind == "sagemaker"
    assert backend.config == {"region": "eu-west-1", "role_arn": ROLE, "bucket": "tb-bucket", "prefix": "team-a",
                              "instance_type": "ml.g5.xlarge", "spot_allowed": True, "profile": "training"}

    # The edit page puts each setting back in its field; settings without a field stay in the JSON.
    services.backend_update(backend=backend, config={**backend.config, "max_nodes": 4})
    form = owner_client.get(reverse("backend-edit", args=[backend.pk])).context["form"]
    assert {k: form.initial[field("sagemaker", k)]
            for k in ("region", "role_arn", "bucket", "prefix", "spot_allowed", "profile")} == {
        "region": "eu-west-1", "role_arn": ROLE, "bucket": "tb-bucket", "prefix": "team-a", "spot_allowed": True,
        "profile": "training"}
    assert form.initial["extra_config"] == '{\n  "max_nodes": 4\n}'

    # Unticking spot stores False; a blank profile is left out (boto3's default chain).
    edit = owner_client.post(reverse("backend-edit", args=[backend.pk]), {
        **sagemaker_post(spot_allowed="", profile=""), "extra_config": '{"max_nodes": 4}'})
    assert edit.status_code == 302
    backend.refresh_from_db()
    assert backend.config == {"region": "eu-west-1", "role_arn": ROLE, "bucket": "tb-bucket", "prefix": "team-a",
                              "instance_type": "ml.g5.xlarge", "spot_allowed": False, "max_nodes": 4}


@pytest.mark.parametrize("setting, value, message", [
    ("role_arn", "admin", "Execution role ARN: expected an IAM role ARN 'arn:aws:iam::<12-digit account id>:role/<name>' "
                          "(the SageMaker execution role), got 'admin'."),
    ("region", "Ireland", "AWS region: expected an AWS region code such as 'us-east-1', got 'Ireland'."),
    ("bucket", "s3://tb-bucket", "S3 bucket: expected an S3 bucket name (3–63 lowercase letters, digits, '.' or '-'; "
                                 "no s3:// prefix), got 's3://tb-bucket'."),
    ("instance_type", "p3.2xlarge",
     "Default instance type: expected a SageMaker 'ml.*' instance type, got 'p3.2xlarge'."),
])
def test_the_adapters_message_lands_on_the_setting_it_names(owner_client, setting, value, message):
    response = owner_client.post(reverse("backend-create"), sagemaker_post(**{setting: value}))
    assert response.status_code == 200
    form = response.context["form"]
    assert form.errors == {field("sagemaker", setting): [message]}
    assert ComputeBackend.objects.count() == 0
    assert escape(message) in response.content.decode()


def test_a_missing_required_setting_is_named(owner_client):
    response = owner_client.post(reverse("backend-create"), sagemaker_post(role_arn=""))
    assert response.context["form"].errors["role_arn"] == [
        "Execution role ARN is required for an AWS SageMaker backend."]


def test_an_empty_sagemaker_form_shows_every_error_at_once(owner_client, api_client):
    """One submit shows every problem (not one per submit: Name, then the region, then its format, then
    the ARN), in the fields' labels, and the API the same words."""
    response = owner_client.post(reverse("backend-create"), {"name": "", "kind": "sagemaker", "enabled": "on"})
    assert response.status_code == 200
    assert response.context["form"].errors == {
        "name": ["This field is required."],
        field("sagemaker", "region"): ["AWS region is required for an AWS SageMaker backend."],
        field("sagemaker", "role_arn"): ["Execution role ARN is required for an AWS SageMaker backend."],
        field("sagemaker", "bucket"): ["S3 bucket is required for an AWS SageMaker backend."],
    }
    # A bad name and badly formed settings: all of them after one submit too.
    response = owner_client.post(reverse("backend-create"), {
        **sagemaker_post(region="Ireland", role_arn="admin"), "name": "not a slug"})
    assert set(response.context["form"].errors) == {"name", field("sagemaker", "region"), field("sagemaker", "role_arn")}
    assert ComputeBackend.objects.count() == 0
    api = api_client.post("/api/backends/", {"name": "sm", "kind": "sagemaker", "config": {}}, format="json")
    assert api.status_code == 400
    assert api.json() == {"config": ["AWS region is required for an AWS SageMaker backend.",
                                     "Execution role ARN is required for an AWS SageMaker backend.",
                                     "S3 bucket is required for an AWS SageMaker backend."]}


def test_the_gpubox_ignores_the_sagemaker_fieldset(owner_client, user):
    response = owner_client.post(reverse("backend-create"), {
        "name": "box", "kind": "gpubox", "max_procs_per_node": 4, "hourly_rate_usd": "1.25", "enabled": "on",
        **settings_post("sagemaker", region="not a region", role_arn="nonsense", spot_allowed="on")})
    assert response.status_code == 302
    assert ComputeBackend.objects.get(name="box").config == {"max_procs_per_node": 4, "hourly_rate_usd": 1.25}


class FakeCloudBackend(OfflineBackend):
    """A kind registered only for these tests, with a setting named like one of SageMaker's."""

    kind = "fakecloud"
    settings = BackendSettings(backend_label="Fake cloud", provider="fake cloud", settings=(
        Setting("region", "Region", "Where the jobs run."),
        Setting("project", "Project", "The project that owns the jobs.", required=True),
    ))


def test_any_registered_kind_gets_its_fields_from_its_declaration(owner_client, user, monkeypatch):
    monkeypatch.setitem(registry.KINDS, "fakecloud",
                        registry.KindInfo(FakeCloudBackend.__module__, "FakeCloudBackend", "Fake cloud"))
    page = owner_client.get(reverse("backend-create")).content.decode()
    # "region" is a setting of several kinds now: each keeps its own field.
    assert (field("sagemaker", "region"), field("fakecloud", "region")) == ("sagemaker_region", "fakecloud_region")
    assert {"sagemaker_region", "fakecloud_region", field("fakecloud", "project")} <= field_names(page)
    assert "region" not in field_names(page)
    assert '<fieldset class="kind-settings" data-kind="fakecloud">' in page
    assert f'<label for="id_{field("fakecloud", "project")}">Project <span class="muted">(required)</span></label>' in page
    assert "The project that owns the jobs." in page

    bad = owner_client.post(reverse("backend-create"), {"name": "fc", "kind": "fakecloud",
                                                        "fakecloud_region": "north-1"})
    assert bad.context["form"].errors == {field("fakecloud", "project"): [
        "Project is required for a Fake cloud backend."]}
    good = owner_client.post(reverse("backend-create"), {"name": "fc", "kind": "fakecloud", "fakecloud_region": "north-1",
                                                         field("fakecloud", "project"): "vision",
                                                         "sagemaker_region": "x"})
    assert good.status_code == 302
    backend = ComputeBackend.objects.get(name="fc")
    assert backend.config == {"region": "north-1", "project": "vision"}
    form = owner_client.get(reverse("backend-edit", args=[backend.pk])).context["form"]
    assert (form.initial["fakecloud_region"], form.initial[field("fakecloud", "project")]) == ("north-1", "vision")


# --- Test connection -------------------------------------------------------------------------


def test_edit_page_has_the_button(owner_client, local_backend):
    page = owner_client.get(reverse("backend-edit", args=[local_backend.pk])).content.decode()
    url = reverse("backend-test-connection", args=[local_backend.pk])
    assert f'action="{url}"' in page and f'hx-post="{url}"' in page and 'id="test-connection"' in page
    assert "connection-checks" not in page  # no results before a test
    listing = owner_client.get(reverse("backend-list")).content.decode()
    assert f'action="{url}"' in listing


def test_button_posts_with_csrf_and_shows_each_check(user, local_backend):
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    url = reverse("backend-test-connection", args=[local_backend.pk])
    assert client.post(url).status_code == 403  # no CSRF token
    page = client.get(reverse("backend-edit", args=[local_backend.pk])).content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    # Redirect after POST: the browser ends on the edit page (GET), so a reload does not test again.
    edit_url = reverse("backend-edit", args=[local_backend.pk])
    response = client.post(url, {"csrfmiddlewaretoken": token}, follow=True)
    assert response.redirect_chain == [(edit_url, 302)]
    assert response.status_code == 200 and response.request["REQUEST_METHOD"] == "GET"
    html = response.content.decode()
    assert response.context["checks"][0].ok
    assert re.search(r'<li class="check check-ok" data-ok="true">\s*<span class="badge state-succeeded">ok</span>\s*'
                     r'<strong>settings</strong> <span>settings are valid; this backend has nothing remote to '
                     r'check</span>', html)
    assert 'id="backend-form"' in html  # the edit page around the results
    assert "connection-checks" not in client.get(edit_url).content.decode()  # shown once
    assert client.get(url).status_code == 405


def test_htmx_gets_the_results_fragment_for_sagemaker(owner_client, sagemaker_backend, aws_env):
    url = reverse("backend-test-connection", args=[sagemaker_backend.pk])
    response = owner_client.post(url, HTTP_HX_REQUEST="true")
    html = response.content.decode()
    assert response.status_code == 200 and "<html" not in html
    checks = re.findall(r'<li class="check check-(ok|failed)".*?<strong>(.*?)</strong> <span>(.*?)</span>', html, re.S)
    assert checks == [
        ("ok", "identity", "signed in as arn:aws:sts::123456789012:user/moto (account 123456789012)"),
        ("failed", "bucket", "bucket tb-test-bucket does not exist; create it in us-east-1 or correct the bucket "
                             "setting."),
        ("ok", "SageMaker access", "SageMaker API reachable in us-east-1 (ListTrainingJobs allowed)"),
    ]


def test_broken_settings_show_a_failed_check_not_a_500(owner_client, sagemaker_backend):
    ComputeBackend.objects.filter(pk=sagemaker_backend.pk).update(config={"region": "us-east-1"})
    response = owner_client.post(reverse("backend-test-connection", args=[sagemaker_backend.pk]), follow=True)
    assert response.status_code == 200
    (check,) = response.context["checks"]
    assert (check.name, check.ok) == ("settings", False)
    assert check.message == ("Backend sm cannot be used: Execution role ARN is required for an AWS SageMaker backend. "
                             "S3 bucket is required for an AWS SageMaker backend. Fix its settings and test again.")
    assert 'class="badge state-failed">failed</span>' in response.content.decode()


def test_another_users_backend_is_a_404(other_client, local_backend):
    assert other_client.post(reverse("backend-test-connection", args=[local_backend.pk])).status_code == 404


def test_api_test_connection(api_client, other_api_client, local_backend):
    url = f"/api/backends/{local_backend.pk}/test-connection/"
    response = api_client.post(url)
    assert response.status_code == 200
    assert response.json() == [{"name": "settings", "ok": True,
                                "message": "settings are valid; this backend has nothing remote to check"}]
    assert other_api_client.post(url).status_code == 404


def test_each_settings_field_is_labelled_as_its_adapters_messages_name_it():
    """The form's label and the adapter's message agree ("AWS region" in both), so a message names
    the field a user sees."""
    from cloud_adapters.registry import backend_class

    form = webapp_forms.BackendForm()
    checked = 0
    for kind, names in form.kind_settings.items():
        labels = backend_class(kind).settings.labels
        for name, key in names.items():
            assert form.fields[name].label == labels[key], (kind, key)
            checked += 1
    assert checked == sum(len(names) for names in form.kind_settings.values()) > 20
