"""The job side of the user's code in the dashboard: the job form's environment and image fields
(through the test client, every error at once), the job page's Code panel (kind, hash, entry point
or script, requirements, image, env, dataset fingerprint) and the API's job detail and create, all
from what the job recorded, never the backend's job-secret values."""

from __future__ import annotations

import html as html_lib

import pytest
from django.urls import reverse

from codekit import MODEL_FILES, upload, zip_bytes
from jobs import services
from jobs.models import CodeArchive, TrainingJob
from page_html import field_block

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("allow_job_images")]

SECRET = "tok-very-secret-123"


@pytest.fixture(autouse=True)
def code_store(settings, tmp_path):
    settings.TRAINBOARD_CODE_STORE = tmp_path / "store"


@pytest.fixture
def code_model(user):
    return services.model_spec_create(
        owner=user, name="my-net", kind="code", code=upload(zip_bytes(MODEL_FILES)),
        entry_point="mymodel.net:build", params={"width": 8})


@pytest.fixture
def script_model(user):
    return services.model_spec_create(
        owner=user, name="my-script", kind="script", code=upload(zip_bytes(MODEL_FILES)),
        entry_point="train.py", script_args=["--epochs", "2", "--name=a b"])


def job_form_data(dataset, model, backend, /, **overrides):
    data = {"name": "", "dataset": dataset.pk, "model_spec": model.pk, "backend": backend.pk, "strategy": "ddp",
            "nodes": 1, "procs_per_node": 2, "epochs": 3, "batch_size": 32, "lr": 0.05, "seed": 0,
            "max_runtime_s": 3600, "budget_usd": "", "instance_type": "", "hyperparameters": "", "env": "",
            "image": ""}
    data.update(overrides)
    return data


def text(page: str) -> str:
    return html_lib.unescape(page)


# --- the job form ---------------------------------------------------------------------------


def test_the_job_form_takes_env_and_image(owner_client, digits_dataset, code_model, local_backend):
    page = owner_client.get(reverse("job-create")).content.decode()
    assert "Environment variables" in field_block(page, "env")
    assert "Container image" in field_block(page, "image")
    response = owner_client.post(reverse("job-create"), job_form_data(
        digits_dataset, code_model, local_backend, env="WANDB_PROJECT=vision\nHF_HOME=/data/hf",
        image="us-docker.pkg.dev/p/r/train:1.0"))
    job = TrainingJob.objects.get()
    assert response.status_code == 302 and response["Location"] == reverse("job-detail", args=[job.pk])
    assert job.env == {"WANDB_PROJECT": "vision", "HF_HOME": "/data/hf"}
    assert job.image == "us-docker.pkg.dev/p/r/train:1.0"
    assert job.code == CodeArchive.objects.get()


def test_the_job_form_shows_every_env_and_image_error_on_its_field(owner_client, digits_dataset, cnn_model,
                                                                   local_backend):
    response = owner_client.post(reverse("job-create"), job_form_data(
        digits_dataset, cnn_model, local_backend, env="RANK=0\nAIP_X=1\nfine=1", image="Bad Image", epochs=0))
    assert response.status_code == 200
    assert not TrainingJob.objects.exists()
    page = text(response.content.decode())
    env = field_block(page, "env")
    assert "Environment variable RANK cannot be set here: torchrun sets it on every rank" in env
    assert "Environment variable AIP_X cannot be set here: names starting AIP_ are Vertex AI's" in env
    assert "'Bad Image' is not a container image reference" in field_block(page, "image")
    assert "Ensure this value is greater than or equal to 1." in field_block(page, "epochs")


# --- the job page ---------------------------------------------------------------------------


def test_the_code_panel_of_a_code_model_job(owner_client, user, digits_dataset, code_model, local_backend):
    services.backend_update(backend=local_backend, job_secrets={"WANDB_API_KEY": SECRET})
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=code_model,
                                       backend=local_backend, procs_per_node=1, env={"WANDB_PROJECT": "vision"},
                                       image="myregistry.azurecr.io/train:1.0")
    sha = CodeArchive.objects.get().sha256
    page = text(owner_client.get(reverse("job-detail", args=[job.pk])).content.decode())
    assert "My model, Trainboard's trainer" in page
    assert f'<code id="code-sha256" title="{sha}">{sha[:12]}</code>' in page
    assert '<code id="code-entry-point">mymodel.net:build</code>' in page
    assert '<pre class="log" id="code-requirements">tinypkg==1.0\n</pre>' in page
    assert "<code>myregistry.azurecr.io/train:1.0</code>" in page
    assert "<td><code>WANDB_PROJECT</code></td><td><code>vision</code></td>" in page
    assert "<td>kind</td><td><code>builtin</code></td>" in page  # the fingerprint of digits
    assert "job secrets WANDB_API_KEY (values never shown)" in page
    assert SECRET not in page


def test_the_code_panel_of_a_script_job_and_of_a_builtin_one(owner_client, user, digits_dataset, script_model,
                                                             cnn_model, local_backend):
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=script_model,
                                       backend=local_backend, procs_per_node=1)
    page = text(owner_client.get(reverse("job-detail", args=[job.pk])).content.decode())
    assert "My training script" in page
    # Each argument as the script gets it: quoted where it holds a space, and counted.
    assert '<code id="code-script">train.py --epochs 2 \'--name=a b\'</code>' in page
    assert '<dd id="code-framework">torch</dd>' in page
    assert '<span class="muted small" id="code-script-args">3 arguments</span>' in page
    assert "the backend's default" in page and "no variables of the job's own" in page
    # a script has no architecture, and the built-in dataset no path to hand it: the page's subtitle
    # names the model and its script, not "my-script ()" nor "on digits" nor the trainer's strategy
    subtitle = page[page.index('id="job-subtitle"'):page.index("</p>", page.index('id="job-subtitle"'))]
    assert f"{script_model.name} (script <code>train.py</code>) ·" in subtitle and "()" not in page
    assert digits_dataset.name not in subtitle and "ddp" not in subtitle and "1 node × 1 process" in subtitle
    builtin = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                           backend=local_backend, procs_per_node=1)
    page = text(owner_client.get(reverse("job-detail", args=[builtin.pk])).content.decode())
    assert '<dd id="code-kind">Built-in architecture (cnn)</dd>' in page
    assert 'id="code-framework"' not in page
    assert f"{cnn_model.name} (cnn) on {digits_dataset.name} ·" in page
    assert 'id="code-sha256"' not in page


# --- the API --------------------------------------------------------------------------------


def test_the_api_creates_with_env_and_image_and_details_the_code(api_client, user, digits_dataset, script_model,
                                                                 local_backend):
    services.backend_update(backend=local_backend, job_secrets={"WANDB_API_KEY": SECRET})
    response = api_client.post("/api/jobs/", {
        "dataset": digits_dataset.pk, "model_spec": script_model.pk, "backend": local_backend.pk,
        "procs_per_node": 1, "env": {"WANDB_PROJECT": "vision"}, "image": "myregistry.azurecr.io/t:1"},
        format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    archive = CodeArchive.objects.get()
    assert body["code"] == {"kind": "script", "sha256": archive.sha256, "entry_point": "", "script": "train.py",
                            "args": ["--epochs", "2", "--name=a b"], "framework": "torch",
                            "requirements": "tinypkg==1.0\n"}
    assert (body["image"], body["env"]) == ("myregistry.azurecr.io/t:1", {"WANDB_PROJECT": "vision"})
    assert body["dataset_fingerprint"] == {"kind": "builtin", "name": "digits"}
    detail = api_client.get(f"/api/jobs/{body['id']}/")
    assert detail.json()["code"] == body["code"]
    assert SECRET not in detail.content.decode() and SECRET not in response.content.decode()


def test_the_api_refuses_a_bad_env_with_every_message(api_client, digits_dataset, cnn_model, local_backend):
    response = api_client.post("/api/jobs/", {
        "dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk, "procs_per_node": 1,
        "env": "WORLD_SIZE=4\nSM_HOSTS=x", "image": "no spaces"}, format="json")
    assert response.status_code == 400
    body = response.json()
    assert body["env"] == [
        "Environment variable WORLD_SIZE cannot be set here: torchrun sets it on every rank from the job's shape.",
        "Environment variable SM_HOSTS cannot be set here: names starting SM_ are SageMaker's (its training "
        "toolkit sets them)."]
    assert "is not a container image reference" in body["image"][0]
    assert not TrainingJob.objects.exists()


def test_an_image_the_box_operator_does_not_allow_is_refused_at_create(api_client, settings, digits_dataset,
                                                                       script_model, local_backend):
    """Which images a GPU box runs is its operator's list: an image outside it is refused when the job
    is created (400 naming the setting), and no job row is left."""
    settings.TRAINBOARD_GPUBOX_ALLOWED_IMAGES = "myregistry.azurecr.io/approved/*"
    body = {"dataset": digits_dataset.pk, "model_spec": script_model.pk, "backend": local_backend.pk,
            "procs_per_node": 1, "image": "docker.io/someone/miner:latest"}
    response = api_client.post("/api/jobs/", body, format="json")
    assert response.status_code == 400
    assert response.json()["non_field_errors"] == [
        "image: this GPU box runs only the images its operator allows, and 'docker.io/someone/miner:latest' is not "
        "one of them (myregistry.azurecr.io/approved/*); use an allowed image or leave the image empty to run on "
        "the host (the operator sets TRAINBOARD_GPUBOX_ALLOWED_IMAGES)."]
    assert not TrainingJob.objects.exists()
    response = api_client.post("/api/jobs/", {**body, "image": "myregistry.azurecr.io/approved/train:3"}, format="json")
    assert response.status_code == 201, response.json()


def test_the_code_panel_shows_where_each_argument_ends_and_the_values_placeholders_became(
        owner_client, user, digits_dataset, local_backend):
    one = services.model_spec_create(owner=user, name="one-arg", kind="script", code=upload(zip_bytes(MODEL_FILES)),
                                     entry_point="train.py", script_args=["--epochs 3 --lr 0.1"])
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=one, backend=local_backend)
    page = text(owner_client.get(reverse("job-detail", args=[job.pk])).content.decode())
    assert '<code id="code-script">train.py \'--epochs 3 --lr 0.1\'</code>' in page  # one argument, and it shows
    assert '<span class="muted small" id="code-script-args">1 argument</span>' in page

    placeholders = services.model_spec_create(
        owner=user, name="hp", kind="script", code=upload(zip_bytes(MODEL_FILES)), entry_point="train.py",
        script_args="--epochs {train.epochs} --lr={train.lr}")  # one text, split as a shell would
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=placeholders,
                                       backend=local_backend, epochs=4, lr=0.02)
    page = text(owner_client.get(reverse("job-detail", args=[job.pk])).content.decode())
    assert '<code id="code-script">train.py --epochs 4 --lr=0.02</code>' in page
    assert ('<span class="muted small" id="code-script-args">3 arguments, given as <code>--epochs \'{train.epochs}\' '
            '\'--lr={train.lr}\'</code></span>') in page  # quoted as a shell needs braces quoted


def test_a_script_job_without_a_dataset_from_the_form_and_the_api(owner_client, api_client, user, digits_dataset,
                                                                  script_model, cnn_model, local_backend):
    page = owner_client.get(reverse("job-create")).content.decode()
    assert '<option value="">— none: my script reads its own data —</option>' in page
    assert f'<option value="{digits_dataset.pk}" selected>' in page  # a dataset stays the default
    response = owner_client.post(reverse("job-create"), job_form_data(digits_dataset, script_model, local_backend,
                                                                      dataset="", procs_per_node=1))
    assert response.status_code == 302, response.context["form"].errors
    job = TrainingJob.objects.get()
    assert job.dataset is None
    for url in (reverse("job-detail", args=[job.pk]), reverse("job-list"), f"/api/jobs/{job.pk}/", "/api/jobs/",
                f"{reverse('job-create')}?from={job.pk}", f"{reverse('job-compare')}?ids={job.pk}"):
        assert owner_client.get(url).status_code == 200, url
    refused = owner_client.post(reverse("job-create"), job_form_data(digits_dataset, cnn_model, local_backend,
                                                                     dataset=""))
    assert refused.context["form"].errors == {"dataset": [
        f"Choose a dataset: model {cnn_model.name} trains on one (only a script model may run without, reading its "
        f"own data)."]}

    created = api_client.post("/api/jobs/", {"model_spec": script_model.pk, "backend": local_backend.pk,
                                             "procs_per_node": 1}, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["dataset"] is None and created.json()["dataset_fingerprint"] is None
    missing = api_client.post("/api/jobs/", {"dataset": None, "model_spec": cnn_model.pk,
                                             "backend": local_backend.pk}, format="json")
    assert missing.status_code == 400
    assert missing.json() == {"dataset": [
        f"Choose a dataset: model {cnn_model.name} trains on one (only a script model may run without, reading its "
        f"own data)."]}


def test_an_unknown_dataset_id_is_one_error_not_two(api_client, cnn_model, local_backend):
    response = api_client.post("/api/jobs/", {"dataset": 999999, "model_spec": cnn_model.pk,
                                              "backend": local_backend.pk}, format="json")
    assert response.status_code == 400
    assert response.json() == {"dataset": ["Choose one of your datasets; this one does not exist or is not yours."]}


def test_a_script_jobs_framework_is_on_its_page_and_in_the_api(owner_client, api_client, user, digits_dataset,
                                                               local_backend):
    model = services.model_spec_create(owner=user, name="tf-script", kind="script", framework="tensorflow",
                                       code=upload(zip_bytes(MODEL_FILES)), entry_point="train.py")
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=model, backend=local_backend,
                                       procs_per_node=1)
    page = text(owner_client.get(reverse("job-detail", args=[job.pk])).content.decode())
    assert '<dd id="code-framework">tensorflow</dd>' in page
    assert api_client.get(f"/api/jobs/{job.pk}/").json()["code"]["framework"] == "tensorflow"
