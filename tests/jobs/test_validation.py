"""jobs/validation.py, and the services that use it: what PostgreSQL cannot store (NaN, infinity, NUL,
unpaired surrogates, deep nesting) is a ValidationError on its field from every caller, the CLI and
other Python callers included, never a DataError from the database."""

from __future__ import annotations

import re

import pytest
from django.core.exceptions import ValidationError

from jobs import services, validation
from jobs.models import ComputeBackend, Dataset, ModelSpec, TrainingJob


def test_nesting_depth_ignores_brackets_in_strings_and_stops_past_the_limit():
    assert validation.nesting_depth('{"a": [1, {"b": "[[[[{{{"}]}') == 3
    assert validation.nesting_depth('"[[[["') == 0
    assert validation.nesting_depth('{"a\\"[[": 1}') == 1  # an escaped quote does not end the string
    assert validation.nesting_depth("[" * 100_000, limit=32) == 33


@pytest.mark.parametrize("text, message", [
    ("[" * 33 + "]" * 33, "Nested more than 32 levels deep; at most 32 levels of objects and arrays are accepted."),
    ("[" * 100_000, "Nested more than 32 levels deep"),
    ('{"a": 1', "Not valid JSON: Expecting ',' delimiter at line 1, column 8."),
    ("1" * 4301, "A number has more than 4,300 digits; give a shorter one."),
    (b"\xff{}", "Not UTF-8 text (byte 0)."),
])
def test_loads_refuses_with_a_message(text, message):
    with pytest.raises(validation.JSONInputError) as excinfo:
        validation.loads(text)
    assert message in str(excinfo.value)


def test_loads_reads_what_json_reads_and_leaves_non_finite_numbers_to_json_problems():
    nested: list = []
    for _ in range(31):
        nested = [nested]
    assert validation.loads("[" * 32 + "]" * 32) == nested  # 32 levels: the most accepted
    value = validation.loads('{"a": NaN, "b": [Infinity, 1e400], "c": "x"}')
    assert validation.json_problems(value) == [
        "a: expected a finite number, got nan.",
        "b[0]: expected a finite number, got inf (a number past about 1.8e308, such as 1e400, reads as infinite).",
        "b[1]: expected a finite number, got inf (a number past about 1.8e308, such as 1e400, reads as infinite).",
    ]


def test_json_problems_says_where_each_problem_is():
    deep: list = []
    for _ in range(40):
        deep = [deep]
    value = {"k\x00": 1, "s": ["ok", "x\x00"], "u": "\ud800", "deep": deep, "when": object(), 1: "int keys dump"}
    problems = validation.json_problems(value)
    assert problems[0] == 'Key "k\\u0000" contains a NUL character (\\u0000), which cannot be stored; remove it.'
    assert problems[1] == "s[1]: contains a NUL character (\\u0000), which cannot be stored; remove it."
    assert problems[2] == "u: contains an unpaired surrogate ('\\ud800' at position 0), which is not text; remove it."
    assert problems[3].startswith("deep" + "[0]" * 31 + ": nested more than 32 levels deep")
    assert problems[4].startswith("when: a object is not a JSON value")
    assert len(problems) == 5
    assert validation.json_problems({"a": [1, 2.5, None, True, {"b": "c"}]}) == []
    assert len(validation.json_problems([float("nan")] * 1000)) == validation.MAX_PROBLEMS


@pytest.mark.django_db
def test_services_refuse_what_the_database_cannot_store(user, digits_dataset, cnn_model, local_backend):
    """Python callers (manage.py submit_job, the admin, tasks) meet the same checks as the forms and API:
    before, each of these reached PostgreSQL and failed there (DataError, or psycopg's ValueError for NUL)."""
    cases = [
        (lambda: services.dataset_create(owner=user, name="d", format="builtin", builtin_name="digits",
                                         description="a\x00b"),
         "description", "Description contains a NUL character (\\u0000), which cannot be stored; remove it."),
        (lambda: services.model_spec_create(owner=user, name="m", architecture="mlp", params={"dropout": float("nan")}),
         "params", "Parameters: dropout: expected a finite number, got nan."),
        (lambda: services.model_spec_update(model_spec=cnn_model, params={"channels": 8, "k\x00": 1}),
         "params", 'Parameters: Key "k\\u0000" contains a NUL character (\\u0000), which cannot be stored; '
                   "remove it."),
        (lambda: services.backend_create(owner=user, name="b", kind="gpubox",
                                         config={"hourly_rate_usd": float("inf")}),
         "config", "Config: hourly_rate_usd: expected a finite number, got inf"),
        (lambda: services.backend_update(backend=local_backend, config={"hourly_rate_usd": 10 ** 400}),
         "config.hourly_rate_usd", "Hourly rate (USD): expected a finite number, got 10000000… (401 characters)."),
        (lambda: services.backend_update(backend=local_backend, name="lo\x00cal"),
         "name", "Name contains a NUL character (\\u0000), which cannot be stored; remove it."),
        (lambda: services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                              backend=local_backend, name="job\x00"),
         "name", "Name contains a NUL character (\\u0000), which cannot be stored; remove it."),
        (lambda: services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                              backend=local_backend, hyperparameters={"train": {"x\x00": 1}}),
         "hyperparameters", 'Hyperparameters: train: key "x\\u0000" contains a NUL character'),
        (lambda: services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                              backend=local_backend, hyperparameters='{"a": ' + "[" * 5000 + "}"),
         "hyperparameters", "Hyperparameters: Nested more than 32 levels deep"),
    ]
    for call, field, message in cases:
        with pytest.raises(ValidationError) as excinfo:
            call()
        errors = excinfo.value.message_dict
        assert any(message in m for m in errors.get(field, [])), (field, message, errors)
    assert (Dataset.objects.count(), ModelSpec.objects.count(), ComputeBackend.objects.count(),
            TrainingJob.objects.count()) == (1, 1, 1, 0)
    local_backend.refresh_from_db()
    assert (local_backend.name, local_backend.config["hourly_rate_usd"]) == ("local", 3.6)


@pytest.mark.django_db
def test_a_price_past_the_price_column_is_the_backends_error(user, digits_dataset, cnn_model):
    """Vertex prices a replica as machine + accelerator × accelerator_count: 10^30 T4s per machine made
    a price that rounding to the column raised InvalidOperation on, a 500 for every job and estimate."""
    config = {"project": "vision-ml-prod", "region": "us-central1", "staging_bucket": "gs://tb-staging/vertex",
              "accelerator_type": "NVIDIA_TESLA_T4"}
    huge = services.backend_create(owner=user, name="vx-huge", kind="vertex",
                                   config={**config, "accelerator_count": 10 ** 30})
    for call in (lambda: services.training_job_estimate(backend=huge),
                 lambda: services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                                      backend=huge)):
        with pytest.raises(ValidationError) as excinfo:
            call()
        [message] = excinfo.value.message_dict["backend"]
        assert re.fullmatch(r"This backend prices an instance-hour at \d\.\d+e\+29 USD, outside what Trainboard "
                            r"records \(\$0 to \$999,999\.999999\); check its settings, e\.g\. the accelerators "
                            r"per machine\.", message), message
    assert TrainingJob.objects.count() == 0
    fine = services.backend_create(owner=user, name="vx-4", kind="vertex", config={**config, "accelerator_count": 4})
    job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=fine)
    assert 0 < job.hourly_price_usd < 10


def test_tf_config_is_the_launchers():
    """A job's TF_CONFIG would pass for the platform's own and make every launcher run one worker of a
    cluster the job made up (trainer_pkg/frameworks/tensorflow.py): refused, saying whose it is."""
    assert validation.env_name_problem("TF_CONFIG") == (
        "TF_CONFIG cannot be set here: the launcher writes it for a tensorflow script's workers (or the "
        "platform does).")
    assert validation.env_name_problem("TF_CPP_MIN_LOG_LEVEL") is None  # TensorFlow's other settings are the job's


def test_the_mpi_and_ray_launchers_variables_are_theirs_and_their_settings_the_jobs():
    """OMPI_COMM_WORLD_* (a job that set one failed at start: new-user trial), the Horovod rank variables
    and RAY_ADDRESS (silently replaced) are refused saying whose they are; Open MPI's OMPI_MCA_ settings,
    Horovod's tuning and Ray's other settings stay the job's."""
    assert validation.env_name_problem("OMPI_COMM_WORLD_RANK") == (
        "OMPI_COMM_WORLD_RANK cannot be set here: names starting OMPI_COMM_WORLD_ are Open MPI's rank variables "
        "(mpirun sets them on every rank; OMPI_MCA_ settings are yours).")
    assert validation.env_name_problem("HOROVOD_RANK") == (
        "HOROVOD_RANK cannot be set here: the launcher sets it on every rank from the job's shape (an mpi "
        "script's as horovodrun would).")
    assert validation.env_name_problem("RAY_ADDRESS") == (
        "RAY_ADDRESS cannot be set here: the launcher points a ray script at its own job's Ray cluster (or the "
        "ray backend does).")
    for name in ("OMPI_MCA_btl", "HOROVOD_FUSION_THRESHOLD", "RAY_DEDUP_LOGS"):
        assert validation.env_name_problem(name) is None
