"""Upper bounds on a job's numbers: a value a column, the trainer or a provider cannot take is a field
error with the bound in it, and nothing is written (a huge max runtime once stored an estimate the
cost column could not hold, and every page listing that job answered 500)."""

from decimal import Decimal
from unittest import mock

import pytest
from django.core.exceptions import ValidationError

from jobs import dispatch, services, validation
from jobs.models import TrainingJob
from jobs.services import training_jobs
from taskkit import sent_tasks

pytestmark = pytest.mark.django_db


def _create(user, dataset, model, backend, **kw):
    args = dict(owner=user, dataset=dataset, model_spec=model, backend=backend, nodes=1, procs_per_node=2, epochs=3)
    args.update(kw)
    return services.training_job_create(**args)


@pytest.mark.parametrize("field,value,message", [
    ("max_runtime_s", 999_999_999_999, "Max runtime (s) must be at most 2,419,200, got 999,999,999,999."),
    ("max_runtime_s", 2_419_201, "Max runtime (s) must be at most 2,419,200, got 2,419,201."),
    ("seed", 99999999999999999999999, "Seed must be at most 4,294,967,295, got 99,999,999,999,999,999,999,999."),
    ("epochs", 99999999999999999999, "Epochs must be at most 100,000, got 99,999,999,999,999,999,999."),
    ("batch_size", 10**12, "Batch size must be at most 1,000,000, got 1,000,000,000,000."),
    ("nodes", 10**12, "Nodes must be at most 1,000, got 1,000,000,000,000."),
    ("procs_per_node", 5000, "Processes per node must be at most 1,024, got 5,000."),
])
def test_values_past_their_bound_are_field_errors_and_nothing_is_written(
        user, digits_dataset, cnn_model, local_backend, field, value, message):
    with sent_tasks(dispatch.SUBMIT_JOB) as send:
        with pytest.raises(ValidationError) as excinfo:
            _create(user, digits_dataset, cnn_model, local_backend, **{field: value})
    assert message in excinfo.value.message_dict[field]
    assert TrainingJob.objects.count() == 0
    send.assert_not_called()


def test_the_bounds_themselves_are_accepted(user, digits_dataset, cnn_model, local_backend):
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = _create(user, digits_dataset, cnn_model, local_backend, max_runtime_s=2_419_200, seed=2**32 - 1,
                      epochs=100_000)
    assert job.max_runtime_s == 2_419_200
    assert job.config["train"]["seed"] == 4_294_967_295 and job.config["train"]["epochs"] == 100_000


def test_overrides_cannot_get_past_the_bounds(user, digits_dataset, cnn_model, local_backend):
    with pytest.raises(ValidationError) as excinfo:
        _create(user, digits_dataset, cnn_model, local_backend,
                hyperparameters={"train": {"seed": 2**40}, "parallel": {"nodes": 10**12}})
    errors = excinfo.value.message_dict
    assert set(errors) == {"hyperparameters"}, errors  # the overrides are at fault, not the Nodes field
    assert "train.seed: must be between 0 and 4,294,967,295, got 1,099,511,627,776" in errors["hyperparameters"]
    assert "parallel.nodes: must be at most 1,000, got 1,000,000,000,000" in errors["hyperparameters"]
    assert TrainingJob.objects.count() == 0


@pytest.mark.parametrize("overrides,message", [
    ('{"train": {"lr": 1e400}}', "train.lr: expected a finite number, got inf"),
    ('{"train": {"stop_check_s": Infinity}}', "train.stop_check_s: expected a finite number, got inf"),
    ({"train": {"stop_check_s": 1e308}}, "train.stop_check_s: must be at most 3,600, got 1e+308"),
    ({"parallel": {"timeout_s": 10**20}}, "parallel.timeout_s: must be at most 86,400, got 100,000,000,000,000,000,000"),
    ({"train": {"warmup_steps": 10**20}}, "train.warmup_steps: must be at most 10,000,000, got 100,000,000,000,000,000,000"),
    ({"data": {"image_size": 10**20}}, "data.image_size: must be at most 4,096, got 100,000,000,000,000,000,000"),
])
def test_overrides_that_would_crash_the_trainer_are_refused(user, digits_dataset, cnn_model, local_backend,
                                                             overrides, message):
    with pytest.raises(ValidationError) as excinfo:
        _create(user, digits_dataset, cnn_model, local_backend, hyperparameters=overrides)
    assert any(message in m for m in excinfo.value.message_dict["hyperparameters"]), excinfo.value.message_dict
    assert TrainingJob.objects.count() == 0


@pytest.mark.parametrize("budget", ["99999999999999", "1e30", "100000000"])
def test_a_budget_the_cost_columns_cannot_hold_is_refused(user, digits_dataset, cnn_model, local_backend, budget):
    with pytest.raises(ValidationError) as excinfo:
        _create(user, digits_dataset, cnn_model, local_backend, budget_usd=budget)
    assert excinfo.value.message_dict["budget_usd"] == [f"Budget must be at most $99,999,999.9999, got {budget!r}."]
    assert TrainingJob.objects.count() == 0


def test_the_largest_budget_is_accepted(user, digits_dataset, cnn_model, local_backend):
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = _create(user, digits_dataset, cnn_model, local_backend, budget_usd="99999999.9999")
    job.refresh_from_db()
    assert job.budget_usd == Decimal("99999999.9999")


def test_an_estimate_the_cost_column_cannot_hold_is_refused(user, digits_dataset, cnn_model, local_backend):
    # 28 days x 1 instance x $200,000/h = $134,400,000.00 > $99,999,999.99
    with mock.patch.object(training_jobs, "_hourly_price", return_value=Decimal("200000")):
        with pytest.raises(ValidationError) as excinfo:
            _create(user, digits_dataset, cnn_model, local_backend, max_runtime_s=2_419_200)
        assert excinfo.value.message_dict["max_runtime_s"] == [
            "The estimate $134,400,000.0000 is more than Trainboard records for one job ($99,999,999.9999): lower "
            "the max runtime, nodes or instance type."]
        with pytest.raises(ValidationError) as excinfo:
            services.training_job_estimate(backend=local_backend, nodes=1, procs_per_node=1, max_runtime_s=2_419_200)
        assert "$134,400,000.00" in excinfo.value.message_dict["max_runtime_s"][0]
    assert TrainingJob.objects.count() == 0


def test_the_api_answers_400_with_the_bound(user, digits_dataset, cnn_model, local_backend):
    from rest_framework.test import APIClient

    api_client = APIClient()
    api_client.force_authenticate(user)
    payload = {"dataset": digits_dataset.pk, "model_spec": cnn_model.pk, "backend": local_backend.pk,
               "max_runtime_s": 999999999999}
    response = api_client.post("/api/jobs/", payload, format="json")
    assert response.status_code == 400
    assert "2,419,200" in str(response.json()), response.json()
    assert TrainingJob.objects.count() == 0


def test_one_fault_found_by_two_checks_is_said_once(user, digits_dataset, cnn_model, local_backend):
    errors = validation.Errors()
    errors.add("instance_type", "Unknown instance type 'x'.")
    errors.add("instance_type", "Unknown instance type 'x'.")
    errors.add("instance_type", "Another fault.")
    assert errors == {"instance_type": ["Unknown instance type 'x'.", "Another fault."]}
