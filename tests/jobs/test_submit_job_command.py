"""manage.py submit_job: input errors exit 2 with the messages, --json, --wait progress and exit codes."""

import io
import datetime as dt
import json
from decimal import Decimal
from unittest import mock

import pytest
from django.core.management import CommandError, call_command

from jobs import dispatch, services
from jobs.models import MetricPoint, JobStateChoices as S, TrainingJob
from jobs.states import transition
from taskkit import sent_tasks

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("allow_job_images")]

BASE = ["--dataset", "digits", "--model", "digits-cnn", "--backend", "local", "--nodes", "1",
        "--procs-per-node", "2", "--epochs", "3", "--user", "alice"]


@pytest.fixture
def ready(digits_dataset, cnn_model, local_backend):
    with sent_tasks(dispatch.SUBMIT_JOB) as send:
        yield send


def run(*args):
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        call_command("submit_job", *args, stdout=out, stderr=err)
    except CommandError as exc:
        code, err = exc.returncode, io.StringIO(err.getvalue() + str(exc))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("args,needle", [
    (["--epochs", "0"], "--epochs: Epochs must be at least 1"),
    (["--procs-per-node", "4"], "--procs-per-node:"),
    (["--hyperparameters", "{oops"], "--hyperparameters: Hyperparameters are not valid JSON"),
    (["--dataset", "mnist"], "--dataset: you have no dataset named 'mnist' (yours: digits)"),
    (["--user", "nobody"], "--user: no user named 'nobody'"),
    (["--priority", "101"], "--priority: "),
])
def test_bad_input_exits_2_with_message(ready, args, needle):
    code, out, err = run(*BASE, *args)
    assert code == 2
    assert needle in err
    assert out == ""
    assert TrainingJob.objects.count() == 0


def test_every_bad_flag_is_reported_at_once_and_nothing_is_created(ready):
    code, out, err = run("--dataset", "mnist", "--model", "resnet-9000", "--backend", "nowhere",
                         "--epochs", "-2", "--lr", "0", "--env", "NOEQUALS", "--env", "RANK=3", "--user", "alice")
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        "the job was not created:",
        "  --dataset: you have no dataset named 'mnist' (yours: digits).",
        "  --model: you have no model named 'resnet-9000' (yours: digits-cnn).",
        "  --backend: you have no backend named 'nowhere' (yours: local).",
        "  --env: 'NOEQUALS' is not KEY=VALUE (e.g. --env WANDB_PROJECT=vision).",
        "  --env: Environment variable RANK cannot be set here: torchrun sets it on every rank from the job's shape.",
        "  --epochs: Epochs must be at least 1, got -2.",
        "  --lr: Learning rate must be greater than 0, got 0.0.",
    ]
    assert TrainingJob.objects.count() == 0
    ready.assert_not_called()


def test_bad_numbers_do_not_hide_the_backends_limit(ready):
    code, out, err = run(*BASE, "--epochs", "0", "--batch-size", "0", "--procs-per-node", "64")
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        "the job was not created:",
        "  --epochs: Epochs must be at least 1, got 0.",
        "  --batch-size: Batch size must be at least 1, got 0.",
        "  --procs-per-node: 1 node × 64 processes = 64 ranks, but this GPU box runs at most 2 processes per node "
        "(max_procs_per_node); ask for 2 or fewer.",
    ]
    assert TrainingJob.objects.count() == 0
    ready.assert_not_called()


def test_an_unknown_user_still_reports_the_other_bad_flags(ready):
    code, _, err = run(*BASE[:-2], "--user", "nobody", "--epochs", "0", "--env", "A")
    assert code == 2
    assert err.splitlines()[1:] == ["  --user: no user named 'nobody'.",
                                    "  --env: 'A' is not KEY=VALUE (e.g. --env WANDB_PROJECT=vision).",
                                    "  --epochs: Epochs must be at least 1, got 0."]
    assert TrainingJob.objects.count() == 0


def test_names_found_with_a_bad_env_option_still_create_nothing(ready, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        code, _, err = run(*BASE, "--env", "A=1", "--env", "A=2", "--max-runtime", "0")
    assert code == 2
    assert "  --env: A is given twice; keep one." in err.splitlines()
    assert "  --max-runtime: Max runtime (s) must be at least 1, got 0." in err.splitlines()
    assert TrainingJob.objects.count() == 0 and callbacks == []
    ready.assert_not_called()


def test_priority_reaches_the_job(ready):
    code, out, _ = run(*BASE, "--json", "--priority", "-7")
    assert code == 0
    assert TrainingJob.objects.get(pk=json.loads(out)["id"]).priority == -7


def test_other_users_objects_are_not_found(ready, other_user):
    code, _, err = run(*BASE[:-2], "--user", "bob")
    assert code == 2 and "you have no dataset named 'digits' (yours: none yet)" in err


def test_a_name_both_yours_and_a_teams_is_refused_with_the_ids(ready, user, other_user, digits_dataset):
    """Issue 27: the CLI resolves a name as the API does (jobs.validation.named_row), not the first match."""
    from jobs.models import Team

    team = Team.objects.create(name="vision")
    team.members.add(user, other_user)
    theirs = services.dataset_create(owner=other_user, name="digits", format="builtin", builtin_name="digits",
                                     team=team)
    code, _, err = run(*BASE)
    assert code == 2
    assert (f"--dataset: 2 datasets named 'digits' that you can use: ids {digits_dataset.pk} (yours), {theirs.pk} "
            f"(team vision); give the id of the one you mean.") in err
    assert TrainingJob.objects.count() == 0
    code, out, _ = run(*BASE, "--dataset", str(theirs.pk), "--json")  # later flags win
    assert code == 0 and TrainingJob.objects.get(pk=json.loads(out)["id"]).dataset == theirs


def test_default_user_is_the_superuser(ready, django_user_model, user):
    code, _, err = run(*BASE[:-2])
    assert code == 2 and "there is no superuser" in err
    user.is_superuser = True
    user.save()
    code, out, _ = run(*BASE[:-2], "--json")
    assert code == 0 and json.loads(out)["state"] == "QUEUED"


def test_json_without_wait(ready, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        code, out, err = run(*BASE, "--json", "--lr", "0.1", "--budget", "5")
    assert code == 0
    data = json.loads(out)
    job = TrainingJob.objects.get()
    assert data == {
        "id": job.pk, "state": "QUEUED", "url": f"http://127.0.0.1:8000/jobs/{job.pk}/", "cost_usd": 0.0, "duration_s": None,
        "failure_reason": "", "code_sha256": None, "image": "",
        "metrics": {"val_accuracy": None, "val_loss": None, "train_loss": None},
        "events": [{"from": None, "to": "QUEUED", "at": data["events"][0]["at"]}],
    }
    assert job.config["train"]["lr"] == 0.1 and str(job.budget_usd) == "5.0000"
    ready.assert_called_once_with(args=[job.pk], queue="gpubox.local")
    assert f"job {job.pk} queued on local" in err


def test_a_cli_job_shows_its_money_at_one_precision_as_form_jobs_do(ready):
    from webapp.api.serializers import TrainingJobSerializer

    code, _, err = run(*BASE, "--max-runtime", "3600", "--budget", "0.001")
    assert code == 0
    job = TrainingJob.objects.get()
    assert f"job {job.pk} queued on local (1 node × 2 processes = 2 ranks, estimate ≤ $0.0010)" in err
    assert TrainingJobSerializer(job).data["estimate_arithmetic"] == (
        "3600 s × 1 node × $3.60/h = $3.6000, capped at the $0.0010 budget")
    # Whole-cent budget and sum beside a cost kept to 4 decimals: the job's one precision is 4.
    TrainingJob.objects.filter(pk=job.pk).update(budget_usd=Decimal("3"), estimated_cost_usd=Decimal("3"),
                                                 cost_usd=Decimal("0.0037"))
    job.refresh_from_db()
    assert TrainingJobSerializer(job).data["estimate_arithmetic"] == (
        "3600 s × 1 node × $3.60/h = $3.6000, capped at the $3.0000 budget")


def _script(final_state, reason=""):
    """Stands in for the worker: each poll's sleep moves the job one step further."""
    steps = iter([S.SUBMITTING, S.PENDING, S.RUNNING, "epoch0", "epoch1", final_state])

    def fake_sleep(_):
        job = TrainingJob.objects.get()
        step = next(steps)
        if step.startswith("epoch"):
            epoch = int(step[-1])
            for name, value in (("val_accuracy", 0.8 + epoch / 10), ("val_loss", 0.5 - epoch / 10),
                                ("train_loss", 0.6 - epoch / 10)):
                MetricPoint.objects.create(job=job, name=name, step=10 * (epoch + 1), epoch=epoch, value=value,
                                           recorded_at=job.created_at)
        else:
            fields = {"started_at": job.created_at} if step == S.PENDING else {}
            if step == S.FAILED:
                fields["failure_reason"] = reason
            transition(job, step, **fields)
    return fake_sleep


def test_json_metrics_carry_the_last_value_of_a_scripts_own_names(ready):
    """A script's report.log(my_metric=...) is charted on the page; the CLI's summary names it too."""
    steps = _script(S.SUCCEEDED)

    def fake_sleep(seconds):
        steps(seconds)
        job = TrainingJob.objects.get()
        if job.state == S.RUNNING and not MetricPoint.objects.filter(name="my_metric").exists():
            for step, value in ((1, 3.0), (2, 2.5)):
                MetricPoint.objects.create(job=job, name="my_metric", step=step, value=value,
                                           recorded_at=job.created_at)
            MetricPoint.objects.create(job=job, name="tokens/s", step=2, value=812.0, recorded_at=job.created_at)

    with mock.patch("jobs.management.commands.submit_job.time.sleep", side_effect=fake_sleep):
        code, out, err = run(*BASE, "--wait", "--json", "--poll-interval", "0.01")
    assert code == 0, err
    assert json.loads(out)["metrics"] == {"val_accuracy": 0.9, "val_loss": 0.4, "train_loss": 0.5,
                                          "my_metric": 2.5, "tokens/s": 812.0}


def test_wait_succeeded_exits_0_with_progress_and_json(ready):
    with mock.patch("jobs.management.commands.submit_job.time.sleep", side_effect=_script(S.SUCCEEDED)):
        code, out, err = run(*BASE, "--wait", "--json", "--poll-interval", "0.01")
    assert code == 0, err
    data = json.loads(out)
    assert data["state"] == "SUCCEEDED"
    assert data["metrics"] == {"val_accuracy": 0.9, "val_loss": 0.4, "train_loss": 0.5}
    assert [(e["from"], e["to"]) for e in data["events"]] == [
        (None, "QUEUED"), ("QUEUED", "SUBMITTING"), ("SUBMITTING", "PENDING"), ("PENDING", "RUNNING"),
        ("RUNNING", "SUCCEEDED")]
    assert isinstance(data["duration_s"], float) and data["duration_s"] >= 0
    assert "QUEUED → SUBMITTING" in err and "RUNNING → SUCCEEDED" in err
    assert "epoch 0 val_accuracy 0.8000, val_loss 0.5000" in err
    assert "epoch 1 val_accuracy 0.9000" in err


def test_wait_prints_every_transition_and_the_epochs_before_the_final_state(ready):
    """One sync pass can store a fast job's last metrics, RUNNING and SUCCEEDED between two polls:
    printing the state seen at each poll would show PENDING → SUCCEEDED and then the epochs."""
    steps = iter(["submit", "all at once"])

    def fake_sleep(_):
        job = TrainingJob.objects.get()
        if next(steps) == "submit":
            transition(job, S.SUBMITTING)
            transition(job, S.PENDING, started_at=job.created_at)
            return
        transition(job, S.RUNNING, message="first step logged")
        running_at = job.events.order_by("-id").first().created_at
        for epoch in (0, 1):
            for name, value in (("val_accuracy", 0.8 + epoch / 10), ("val_loss", 0.5 - epoch / 10)):
                MetricPoint.objects.create(job=job, name=name, step=10 * (epoch + 1), epoch=epoch, value=value,
                                           recorded_at=running_at + dt.timedelta(seconds=epoch + 1))
        transition(job, S.SUCCEEDED)

    with mock.patch("jobs.management.commands.submit_job.time.sleep", side_effect=fake_sleep):
        code, out, err = run(*BASE, "--wait", "--poll-interval", "0.01")
    assert code == 0, err
    job = TrainingJob.objects.get()
    progress = [line.split(f"job {job.pk}: ", 1)[1] for line in err.splitlines() if f" job {job.pk}: " in line]
    assert progress == [
        "QUEUED → SUBMITTING", "SUBMITTING → PENDING", "PENDING → RUNNING",
        "epoch 0 val_accuracy 0.8000, val_loss 0.5000", "epoch 1 val_accuracy 0.9000, val_loss 0.4000",
        "RUNNING → SUCCEEDED",
    ]


def test_wait_prints_the_epochs_before_a_stop_the_sync_saw_after_them(ready):
    """A budget stop seen by the sync at T, with epochs the trainer logged at T - 2 s and T - 1 s, all
    stored in one pass: --wait printed RUNNING → STOPPING first, then the epochs before it."""
    from django.utils import timezone

    steps = iter(["submit", "stop"])

    def fake_sleep(_):
        job = TrainingJob.objects.get()
        if next(steps) == "submit":
            for state in (S.SUBMITTING, S.PENDING, S.RUNNING):
                transition(job, state)
            return
        now = timezone.now()
        for epoch in (0, 1):
            MetricPoint.objects.create(job=job, name="val_accuracy", step=10 * (epoch + 1), epoch=epoch,
                                       value=0.5 + epoch / 10, recorded_at=now - dt.timedelta(seconds=2 - epoch))
        transition(job, S.STOPPING, message="budget reached")
        transition(job, S.CANCELLED)

    with mock.patch("jobs.management.commands.submit_job.time.sleep", side_effect=fake_sleep):
        code, out, err = run(*BASE, "--wait", "--poll-interval", "0.01")
    assert code == 1, err
    job = TrainingJob.objects.get()
    progress = [line.split(f"job {job.pk}: ", 1)[1] for line in err.splitlines() if f" job {job.pk}: " in line]
    assert progress[-4:] == ["epoch 0 val_accuracy 0.5000", "epoch 1 val_accuracy 0.6000",
                             "RUNNING → STOPPING", "STOPPING → CANCELLED"]


def test_wait_failed_exits_1(ready):
    with mock.patch("jobs.management.commands.submit_job.time.sleep",
                    side_effect=_script(S.FAILED, "trainer error: boom")):
        code, out, err = run(*BASE, "--wait", "--json", "--poll-interval", "0.01")
    assert code == 1
    assert json.loads(out)["failure_reason"] == "trainer error: boom"
    assert "ended FAILED: trainer error: boom" in err


def test_wait_timeout_exits_1(ready):
    code, out, err = run(*BASE, "--wait", "--timeout", "0.2", "--poll-interval", "0.05")
    assert code == 1 and "still QUEUED after the timeout" in err


def test_team_runs_the_job_for_one_of_your_teams(ready, user, django_user_model):
    from jobs.models import Team

    vision = Team.objects.create(name="vision")
    vision.members.add(user)
    carol = django_user_model.objects.create_user(username="carol", password="pw-carol-123")
    audio = Team.objects.create(name="audio")
    audio.members.add(carol)

    code, _, err = run(*BASE, "--team", "audio")  # carol's team, not alice's
    assert code == 2 and "--team: you have no team named 'audio' (yours: vision)" in err
    assert TrainingJob.objects.count() == 0

    code, out, _ = run(*BASE, "--team", "vision", "--json")
    assert code == 0
    assert TrainingJob.objects.get(pk=json.loads(out)["id"]).team == vision


# --- the job's environment, image and code ---------------------------------------------------


def test_env_and_image_options_and_the_code_hash_in_the_json(ready, user, settings, tmp_path):
    from codekit import MODEL_FILES, upload, zip_bytes

    settings.TRAINBOARD_CODE_STORE = tmp_path / "store"
    model = services.model_spec_create(owner=user, name="my-script", kind="script", entry_point="train.py",
                                       code=upload(zip_bytes(MODEL_FILES)), script_args=["--epochs", "1"])
    args = [a if a != "digits-cnn" else "my-script" for a in BASE]
    code, out, err = run(*args, "--json", "--env", "WANDB_PROJECT=vision", "--env", "EMPTY_OK=a=b",
                         "--image", "myregistry.azurecr.io/train:1.0")
    assert code == 0, err
    job = TrainingJob.objects.get()
    assert (job.env, job.image) == ({"WANDB_PROJECT": "vision", "EMPTY_OK": "a=b"}, "myregistry.azurecr.io/train:1.0")
    data = json.loads(out)
    assert data["code_sha256"] == model.code.sha256 == job.code.sha256
    assert data["image"] == "myregistry.azurecr.io/train:1.0"


@pytest.mark.parametrize("args,needle", [
    (["--env", "NOEQUALS"], "--env: 'NOEQUALS' is not KEY=VALUE (e.g. --env WANDB_PROJECT=vision)."),
    (["--env", "A=1", "--env", "A=2"], "--env: A is given twice; keep one."),
    (["--env", "MASTER_PORT=1"], "--env: Environment variable MASTER_PORT cannot be set here: torchrun sets it"),
    (["--image", "no spaces allowed"], "--image: Image: 'no spaces allowed' is not a container image reference"),
])
def test_bad_env_or_image_exits_2(ready, args, needle):
    code, out, err = run(*BASE, *args)
    assert code == 2
    assert needle in err
    assert not TrainingJob.objects.exists()


# --- a script model without a dataset ----------------------------------------------------------


def test_dataset_is_optional_for_a_script_model_and_required_by_the_service_for_the_others(ready, user, settings,
                                                                                          tmp_path):
    from codekit import MODEL_FILES, upload, zip_bytes

    settings.TRAINBOARD_CODE_STORE = tmp_path / "store"
    services.model_spec_create(owner=user, name="my-script", kind="script", entry_point="train.py",
                               code=upload(zip_bytes(MODEL_FILES)), script_args=["--epochs", "1"])
    no_dataset = ["--model", "my-script", "--backend", "local", "--nodes", "1", "--procs-per-node", "2",
                  "--user", "alice", "--json"]
    code, out, err = run(*no_dataset)
    assert code == 0, err
    job = TrainingJob.objects.get()
    assert (job.dataset, job.model_spec.name, json.loads(out)["id"]) == (None, "my-script", job.pk)
    assert job.config["data"]["uri"] == ""  # no data of ours: the script reads its own

    code, out, err = run("--model", "digits-cnn", "--backend", "local", "--user", "alice")
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        "the job was not created:",
        "  --dataset: Choose a dataset: model digits-cnn trains on one (only a script model may run without, reading "
        "its own data).",
    ]
    assert TrainingJob.objects.count() == 1


def test_help_says_when_dataset_may_be_left_out():
    from jobs.management.commands.submit_job import Command

    text = " ".join(Command().create_parser("manage.py", "submit_job").format_help().split())
    assert ("--dataset DATASET Dataset name (or id), e.g. digits. Required, except for a script model (kind script) "
            "that reads its own data: leave it out there.") in text
