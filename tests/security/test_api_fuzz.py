"""Schemathesis against /api/schema/: every operation fuzzed through the real WSGI stack with a fixed
seed and a bounded number of cases, then the values a generator from the schema does not make.

Asserted by :func:`test_api_fuzz_no_server_error_and_no_half_made_job`: no response is a server
error (5xx), every 2xx response matches its declared schema (schemathesis' response_schema_conformance),
and afterwards no half-made job exists (each TrainingJob has its provider job name and its QUEUED
event). 49 operations: ``EXAMPLES`` cases for each of the 23 with a body or four or more query
parameters, fewer for the paginated lists and the path-only ones (about 1,500 cases in all).

:func:`test_api_fuzz_unstorable_values_in_every_body_field` puts each of ``UNSTORABLE`` (NaN,
Infinity, 1e400, 1e300, NUL in a string and in a key, an unpaired surrogate, nesting 3,000 deep, an
integer of 5,000 digits) into every property of every request body in the schema, at the top and inside
the JSON-object ones (under an unknown key and in place of each known one: ``config.hourly_rate_usd``),
over a body that is otherwise valid (asserted: it is accepted), so the value reaches the service; and
``UNSTORABLE_QUERY`` into every list's ``limit`` and ``offset``. None may be a 5xx. Each, unchecked,
breaks a different layer: NUL in backend config (DataError), 1e400 stored as infinity, a 5,000-deep
body (RecursionError, the token endpoint too), 1e400 as a team or dataset id (OverflowError), an
unpaired surrogate echoed in a field's error (UnicodeEncodeError in the renderer), LIMIT 10^20 on
the dataset, model and backend lists (bigint out of range).

:func:`test_api_fuzz_stateful` runs ``STATEFUL_SCENARIOS`` sequences along the links schemathesis
infers (create, then read or update what it made) with the same two checks.

The file takes about two minutes, most of it the generated run (``EXAMPLES``).

Left out of the generated run: ``POST /api/backends/{id}/test-connection/``, which calls the cloud's
API with whatever a fuzzed backend names (traffic off this machine); tests/security/test_permission_walk.py
and the backend connection tests cover it, and :func:`test_test_connection_response_matches_its_schema`
checks its response against the schema on a GPU box backend (no traffic).
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.django_db

EXAMPLES = 40
"""Generated cases for an operation with a request body or four or more query parameters. The seed is
fixed (``derandomize``), so every run sends the same cases: half of the generation and half of the
requests went on the second 40 (cProfile of the test), and the values a generator is unlikely to make
are put into every field by :func:`test_api_fuzz_unstorable_values_in_every_body_field`."""
EXAMPLES_PAGE = 30
"""For a list whose only query parameters are the pagination's (``after``, ``limit``, ``offset``: one
paginator class for all, its extremes in ``UNSTORABLE_QUERY`` below)."""
EXAMPLES_PATH_ONLY = 15
"""For an operation whose only input is its path (an object's id, an artifact's name)."""
STATEFUL_SCENARIOS = 25
SKIP = {("POST", "/api/backends/{id}/test-connection/")}

UNSTORABLE = {
    "NaN": "NaN",
    "-Infinity": "-Infinity",
    "1e400": "1e400",  # parses as infinity
    "1e300": "1e300",  # finite, past every money and seconds column
    "NUL": '"a\\u0000b"',
    "NUL key": '{"k\\u0000": "v\\u0000"}',
    "surrogate": '"\\ud800"',
    "deep": "[" * 3000 + "]" * 3000,
    "5,000 digits": "9" * 5000,
}
"""Raw JSON text for a property's value (json.dumps cannot write most of these)."""
UNSTORABLE_QUERY = ["99999999999999999999", str(2**63), "-1", "NaN", "1e400", "\x00"]


def _loopback_only_resolver(host, port, *args, **kwargs):
    """``socket.getaddrinfo`` for the webhook checks under fuzzing: an IP literal resolves to itself,
    every name fails as an unknown host, so no fuzzed URL makes a DNS query or reaches past 127.0.0.1."""
    import ipaddress
    import socket

    try:
        address = str(ipaddress.ip_address(str(host)))
    except ValueError:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known (fuzz resolver)") from None
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    return [(family, socket.SOCK_STREAM, 6, "", (address, int(port or 0)))]


@pytest.fixture
def fuzz_user(django_user_model, settings, tmp_path, monkeypatch):
    from rest_framework.authtoken.models import Token

    from jobs import services, webhooks

    # A webhook URL is checked by resolving its host: only loopback literals resolve here, and
    # loopback is the one network the operator allows (TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS).
    monkeypatch.setattr(webhooks.socket, "getaddrinfo", _loopback_only_resolver)
    settings.TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    settings.TRAINBOARD_RUN_ROOT = tmp_path / "runs"
    settings.TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE = 2  # the box's host limit (no staff user sets it here)
    settings.TRAINBOARD_DATASET_ROOTS = [str(tmp_path)]
    user = django_user_model.objects.create_user(username="fuzz", password="pw-fuzz-Secret-1")
    # Something to find by id: the generated ids 1, 2 ... hit real rows as well as missing ones.
    digits = services.dataset_create(owner=user, name="digits", format="builtin", builtin_name="digits")
    cnn = services.model_spec_create(owner=user, name="cnn", architecture="cnn", params={})
    box = services.backend_create(owner=user, name="box", kind="gpubox", config={})
    services.training_job_create(owner=user, dataset=digits, model_spec=cnn, backend=box, nodes=1,
                                 procs_per_node=1, epochs=1)
    services.webhook_create(owner=user, url="http://127.0.0.1:9/hook", events=["job.succeeded"])
    return user, Token.objects.create(user=user).key


@pytest.mark.slow
def test_api_fuzz_no_server_error_and_no_half_made_job(fuzz_user, monkeypatch):
    import schemathesis
    from django.core.wsgi import get_wsgi_application
    from hypothesis import HealthCheck, Phase, given
    from hypothesis import settings as hsettings

    from jobs.models import JobEvent, TrainingJob

    # Nothing may leave the machine even if a fuzzed backend were used: no cloud credentials.
    for name in ("AWS_PROFILE", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("NO_GCE_CHECK", "True")

    # The WSGI handler closes the database connection after each request, which would close the
    # test's transaction; Django's own test client disconnects the same hook.
    from django.core import signals
    from django.db import close_old_connections

    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        _fuzz(fuzz_user, schemathesis, get_wsgi_application, HealthCheck, Phase, given, hsettings,
              JobEvent, TrainingJob)
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


def _fuzz(fuzz_user, schemathesis, get_wsgi_application, HealthCheck, Phase, given, hsettings,
          JobEvent, TrainingJob) -> None:
    from schemathesis.specs.openapi.checks import response_schema_conformance

    _, token = fuzz_user
    auth = {"Authorization": f"Token {token}"}
    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application(), headers=auth)
    failures: list[str] = []
    seen: dict[str, int] = {}

    for result in schema.get_all_operations():
        operation = result.ok()
        key = (operation.method.upper(), operation.path)
        if key in SKIP:
            continue

        @hsettings(max_examples=_examples(operation), derandomize=True, deadline=None, database=None,
                   suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @given(case=operation.as_strategy())
        def run(case) -> None:
            response = case.call(headers=auth)
            seen[f"{key[0]} {key[1]}"] = seen.get(f"{key[0]} {key[1]}", 0) + 1
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.formatted_path} body={case.body!r} "
                                f"query={case.query!r} -> {response.status_code}")
            elif 200 <= response.status_code < 300:
                try:
                    case.validate_response(response, checks=[response_schema_conformance], headers=auth)
                except Exception as exc:  # schemathesis' FailureGroup: the response is not what the schema says
                    failures.append(f"{case.method} {case.formatted_path} -> {response.status_code}, not as "
                                    f"declared: {str(exc)[:300]}")

        run()

    assert len(seen) >= 15, seen  # every operation of the four viewsets, the token endpoint ...
    assert sum(seen.values()) >= 15 * 10
    assert not failures, "server errors:\n" + "\n".join(failures[:20])
    half_made = TrainingJob.objects.filter(provider_job_name="") | TrainingJob.objects.exclude(
        pk__in=JobEvent.objects.filter(to_state="QUEUED").values("job_id"))
    assert not half_made.exists(), list(half_made.values("id", "provider_job_name", "state"))


def _examples(operation) -> int:
    """How many cases to generate for a schemathesis operation (see ``EXAMPLES``)."""
    definition = operation.definition.raw
    query = [p for p in definition.get("parameters", []) if p.get("in") == "query"]
    if "requestBody" in definition or len(query) >= 4:
        return EXAMPLES
    return EXAMPLES_PAGE if query else EXAMPLES_PATH_ONLY


def _isolated(call):
    """``call()``'s response, in a savepoint rolled back when it is a 5xx: a database error inside the
    request aborts the test's transaction, and every later request would fail with it."""
    from django.db import transaction

    savepoint = transaction.savepoint()
    response = call()
    if response.status_code >= 500:
        transaction.savepoint_rollback(savepoint)
    else:
        transaction.savepoint_commit(savepoint)
    return response


def _valid_bodies(user) -> dict[str, dict]:
    """A body each write operation accepts (a 201 / 200), by path, for the objects of ``fuzz_user``."""
    from jobs.models import ComputeBackend, Dataset, ModelSpec, TrainingJob, Webhook

    dataset, model, backend = (Dataset.objects.get(owner=user), ModelSpec.objects.get(owner=user),
                               ComputeBackend.objects.get(owner=user))
    job = TrainingJob.objects.filter(owner=user).first()
    return {
        "/api/datasets/": {"name": "fz-dataset", "format": "builtin", "builtin_name": "digits"},
        "/api/models/": {"name": "fz-model", "architecture": "mlp", "params": {"hidden_size": 8, "dropout": 0.1}},
        "/api/backends/": {"name": "fz-box", "kind": "gpubox", "config": {"hourly_rate_usd": 1.5, "grace_period_s": 5},
                           "state_deadlines": {"PENDING": 600}},
        "/api/jobs/": {"dataset": dataset.pk, "model_spec": model.pk, "backend": backend.pk, "epochs": 1,
                       "hyperparameters": {"train": {"optimizer": "adamw"}, "parallel": {"timeout_s": 600}}},
        "/api/jobs/estimate/": {"dataset": dataset.pk, "model_spec": model.pk, "backend": backend.pk, "epochs": 1},
        "/api/datasets/{id}/": {"name": "digits", "format": "builtin", "builtin_name": "digits"},
        "/api/models/{id}/": {"name": "cnn", "architecture": "cnn", "params": {}},
        "/api/backends/{id}/": {"name": "box", "kind": "gpubox", "config": {"hourly_rate_usd": 2.0}},
        "/api/auth/token/": {"username": "fuzz", "password": "pw-fuzz-Secret-1"},
        "/api/jobs/{id}/": {"tags": ["fz"], "notes": "fuzzed"},
        "/api/notifications/": {"email_events": [], "team_email_events": []},
        "/api/jobs/{id}/clone/": {"epochs": 2, "lr": 0.05, "hyperparameters": {"train": {"seed": 4}}},
        "/api/sweeps/": {"name": "fz-sweep", "base": {"dataset": dataset.pk, "model_spec": model.pk,
                                                      "backend": backend.pk, "epochs": 1},
                         "search_space": {"train.lr": {"type": "float", "low": 0.001, "high": 0.1}},
                         "sampler": "random", "max_trials": 2, "max_concurrent_trials": 1},
        "/api/webhooks/": {"url": "http://127.0.0.1:9/hook", "events": ["job.succeeded"], "name": "fz"},
        "/api/webhooks/{id}/": {"url": "http://127.0.0.1:9/other", "events": ["job.failed"], "enabled": False},
        "/api/saved-filters/": {"name": "fz-filter", "query": {"state": "SUCCEEDED", "sort": "-val_accuracy"}},
    }, {"/api/datasets/{id}/": dataset.pk, "/api/models/{id}/": model.pk, "/api/backends/{id}/": backend.pk,
        "/api/jobs/{id}/": job.pk, "/api/jobs/{id}/clone/": job.pk,
        "/api/webhooks/{id}/": Webhook.objects.filter(owner=user).first().pk}


def _body_properties(schema: dict, operation: dict) -> dict[str, dict]:
    """The writable properties of ``operation``'s JSON request body, each with its (resolved) schema."""
    def resolve(node: dict) -> dict:
        while "$ref" in node:
            node = schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]]
        return node

    content = operation.get("requestBody", {}).get("content", {}).get("application/json")
    if not content:
        return {}
    return {name: resolve(prop) for name, prop in resolve(content["schema"]).get("properties", {}).items()
            if not resolve(prop).get("readOnly")}


@pytest.mark.slow
def test_api_fuzz_unstorable_values_in_every_body_field(fuzz_user, client):
    from django.db import transaction

    user, token = fuzz_user
    auth = {"HTTP_AUTHORIZATION": f"Token {token}"}
    client.raise_request_exception = False  # a 500 is counted, and the walk goes on
    schema = client.get("/api/schema/?format=json", **auth).json()
    bodies, ids = _valid_bodies(user)
    failures, sent, reached = [], 0, set()
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            if method not in ("post", "put", "patch") or (method.upper(), path) in SKIP:
                continue
            properties = _body_properties(schema, operation)
            if not properties:
                continue
            assert path in bodies, f"no valid body for {method.upper()} {path}: add one to _valid_bodies"
            url = path.replace("{id}", str(ids.get(path, 0)))
            savepoint = transaction.savepoint()  # the valid body is accepted, and leaves nothing behind
            accepted = getattr(client, method)(url, data=json.dumps(bodies[path]), content_type="application/json",
                                               **auth)
            transaction.savepoint_rollback(savepoint)
            assert accepted.status_code < 300, (method, path, accepted.content.decode()[:2000])
            for name, prop in properties.items():
                base = {k: v for k, v in bodies[path].items() if k != name}
                valid = bodies[path].get(name)
                # Where the value goes: the property itself; in an object, an unknown key and, in place
                # of its value, each key the valid body sets (so a known setting meets it too).
                places: list[str | None] = [None]
                if prop.get("type") == "object" or "additionalProperties" in prop:
                    places += ["x", *(valid if isinstance(valid, dict) else {})]
                for key in places:
                    for label, raw in UNSTORABLE.items():
                        if key is None:
                            value = raw
                        else:
                            others = {k: v for k, v in (valid if isinstance(valid, dict) else {}).items() if k != key}
                            value = json.dumps(others)[:-1] + (", " if others else "") + f'"{key}": {raw}}}'
                        text = json.dumps(base)[:-1] + (", " if base else "") + f'"{name}": {value}}}'
                        response = _isolated(lambda: getattr(client, method)(
                            url, data=text, content_type="application/json", **auth))
                        sent += 1
                        reached.add(f"{method.upper()} {path} {name}" + (f".{key}" if key else ""))
                        if response.status_code >= 500:
                            failures.append(f"{method.upper()} {url} {name}{'.' + key if key else ''}={label} "
                                            f"-> {response.status_code}")
    assert len(reached) >= 60, sorted(reached)  # every body property of the four resources and the token
    assert sent >= 40 * len(UNSTORABLE)
    assert not failures, "server errors:\n" + "\n".join(failures[:30])


def test_api_fuzz_list_paging_params(fuzz_user, client):
    _, token = fuzz_user
    auth = {"HTTP_AUTHORIZATION": f"Token {token}"}
    client.raise_request_exception = False
    schema = client.get("/api/schema/?format=json", **auth).json()
    lists = [path for path, methods in schema["paths"].items()
             if any(p["name"] == "limit" for p in methods.get("get", {}).get("parameters", []))]
    assert sorted(lists) == ["/api/backends/", "/api/backends/{id}/running-jobs/", "/api/backends/{id}/waiting-jobs/",
                             "/api/datasets/", "/api/jobs/", "/api/jobs/{id}/logs/", "/api/models/",
                             "/api/saved-filters/", "/api/saved-filters/{id}/jobs/", "/api/sweeps/",
                             "/api/webhooks/", "/api/webhooks/{id}/deliveries/"]
    from jobs import services
    from jobs.models import ComputeBackend, TrainingJob, Webhook

    box = ComputeBackend.objects.get(name="box")  # the fuzz user's, with a QUEUED job
    job = TrainingJob.objects.filter(backend=box).first()
    hook = Webhook.objects.create(owner=box.owner, url="https://hooks.example.com/tb", secret={"key": "k"},
                                  events=["job.succeeded"])
    saved = services.saved_filter_create(owner=box.owner, name="queued", query={"state": "QUEUED"})
    ids = {"/api/backends/": box.pk, "/api/jobs/": job.pk, "/api/webhooks/": hook.pk, "/api/saved-filters/": saved.pk}
    failures = []
    for path in (p if "{id}" not in p else p.replace("{id}", str(next(v for k, v in ids.items() if p.startswith(k))))
                 for p in lists):
        for param in ("limit", "offset"):
            for value in UNSTORABLE_QUERY:
                other = "limit" if param == "offset" else "offset"
                response = _isolated(lambda: client.get(path, {param: value, other: UNSTORABLE_QUERY[0]}, **auth))
                # The log's cursor endpoint refuses a bad limit with a 400 naming it (its limit is a
                # page size, not the lists' clamped paging). Every list clamps a whole number past the
                # bigint (200) and refuses anything else with a 400 naming the parameter.
                if path.endswith("/logs/"):
                    allowed = (200, 400)
                else:
                    allowed = (200,) if value.isdigit() else (400,)
                    if response.status_code == 400 and param not in response.json():
                        failures.append(f"GET {path}?{param}={value!r}: the 400 does not name {param}")
                if response.status_code not in allowed:
                    failures.append(f"GET {path}?{param}={value!r} -> {response.status_code}")
    assert not failures, "\n".join(failures)


def test_test_connection_response_matches_its_schema(fuzz_user):
    """The schema declared a paginated object; the view returns a list of checks (found by the fuzzer's
    response conformance check, which the generated run cannot apply to this operation)."""
    import schemathesis
    from django.core import signals
    from django.core.wsgi import get_wsgi_application
    from django.db import close_old_connections
    from schemathesis.specs.openapi.checks import response_schema_conformance

    from jobs.models import ComputeBackend

    user, token = fuzz_user
    auth = {"Authorization": f"Token {token}"}
    box = ComputeBackend.objects.get(owner=user)
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application(), headers=auth)
        operation = schema["/api/backends/{id}/test-connection/"]["POST"]
        case = operation.Case(path_parameters={"id": box.pk})
        response = case.call(headers=auth)
        assert response.status_code == 200
        assert [check["ok"] for check in response.json()] == [True]
        case.validate_response(response, checks=[response_schema_conformance], headers=auth)
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


def test_api_fuzz_stateful(fuzz_user):
    """Sequences of calls along the links schemathesis infers (create → retrieve / update, a list's ids →
    an object): a server error, or a 2xx that is not what the schema declares, after any sequence."""
    import schemathesis
    from django.core import signals
    from django.core.wsgi import get_wsgi_application
    from django.db import close_old_connections, transaction
    from hypothesis import HealthCheck, Phase
    from hypothesis import settings as hsettings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import response_schema_conformance

    _, token = fuzz_user
    auth = {"Authorization": f"Token {token}"}
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application(), headers=auth)
        schema = schema.exclude(path="/api/backends/{id}/test-connection/")  # see the module docstring
        base = schema.as_state_machine()
        steps: list[str] = []

        class Machine(base):
            # Every scenario starts from the same rows: hypothesis replays scenarios, and one whose
            # responses changed (an object made by the previous one) is "inconsistent data generation".
            def setup(self):
                self.savepoint = transaction.savepoint()

            def teardown(self):
                transaction.savepoint_rollback(self.savepoint)

            def get_call_kwargs(self, case):
                return {"headers": auth}

            def validate_response(self, response, case, additional_checks=None, **kwargs):
                steps.append(f"{case.method} {case.path}")
                case.validate_response(response, checks=[not_a_server_error, response_schema_conformance],
                                       headers=auth)

        Machine.run(settings=hsettings(max_examples=STATEFUL_SCENARIOS, stateful_step_count=6, derandomize=True,
                                       deadline=None, database=None, suppress_health_check=list(HealthCheck),
                                       phases=[Phase.explicit, Phase.generate]))
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)
    assert len(steps) >= STATEFUL_SCENARIOS
    assert len({step.split()[0] for step in steps}) >= 3, steps  # creates, reads and updates, not one kind


ISSUE_16_BODIES = ("/api/jobs/{id}/clone/", "/api/sweeps/", "/api/webhooks/", "/api/webhooks/{id}/",
                   "/api/saved-filters/")
"""The issue-16 writes whose bodies :func:`test_api_fuzz_malformed_bodies_of_the_new_writes_are_400_with_a_message`
breaks field by field (with their valid bodies in :func:`_valid_bodies`); the sweep cancel takes no body."""
NOT_JSON = ["not json", "{", '{"epochs": 2,}', "", "[1, 2]", '"text"', "null", "7", "true", "1e400"]
"""Request bodies that are no JSON object (or no JSON at all)."""
EMPTY_BODY_OK = {("post", "/api/jobs/{id}/clone/"), ("patch", "/api/webhooks/{id}/")}
"""No body at all: a clone with no edits, a PATCH that changes nothing (each of their fields is optional)."""
JUNK = {"whole number": 7, "negative": -1, "1e300": 1e300, "30 digits": 10**30, "null": None, "text": "x",
        "nested list": [1, [2, [3, {"k": None}]]], "nested object": {"a": {"b": [None, {"c": "d"}]}},
        "true": True, "empty object": {}, "empty list": []}
"""Values put in place of each field of a valid body, each of another type than the field's."""


def _kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "text", list: "list", dict: "object", type(None): "null"}[type(value)]


def _messages(body) -> list[str]:
    """Every text of an error body ({"field": ["message"]}, nested)."""
    if isinstance(body, str):
        return [body] if body.strip() else []
    if isinstance(body, dict):
        return [m for v in body.values() for m in _messages(v)]
    if isinstance(body, list):
        return [m for v in body for m in _messages(v)]
    return []


def test_api_fuzz_malformed_bodies_of_the_new_writes_are_400_with_a_message(fuzz_user, client):
    """The clone, sweep create, webhook create and update (PUT, PATCH): every body that is not JSON or not
    an object (no body at all is a clone without edits, a PATCH of nothing: :data:`EMPTY_BODY_OK`), each field of a valid body given a value of another type (numbers past any column
    included), and an unknown key: a 400 whose body says what is wrong, never a 5xx or an accepted
    body. The sweep cancel ignores its body: any is answered 200 (a running sweep) or 400 naming why."""
    from jobs import sweeps
    from jobs.models import SavedFilter, Sweep, TrainingJob, Webhook

    user, token = fuzz_user
    auth = {"HTTP_AUTHORIZATION": f"Token {token}"}
    client.raise_request_exception = False
    bodies, ids = _valid_bodies(user)
    failures: list[str] = []
    sent = 0

    def check(method: str, path: str, text: str, what: str) -> None:
        nonlocal sent
        url = path.replace("{id}", str(ids.get(path, 0)))
        jobs_before, hooks_before, sweeps_before = (TrainingJob.objects.count(), Webhook.objects.count(),
                                                    Sweep.objects.count() + SavedFilter.objects.count())
        response = _isolated(lambda: getattr(client, method)(url, data=text, content_type="application/json", **auth))
        sent += 1
        try:
            messages = _messages(response.json())
        except ValueError:
            messages = []
        if response.status_code != 400 or not messages:
            failures.append(f"{method.upper()} {path} {what} -> {response.status_code} {response.content[:200]!r}")
        elif (TrainingJob.objects.count(), Webhook.objects.count(),
              Sweep.objects.count() + SavedFilter.objects.count()) != (
                jobs_before, hooks_before, sweeps_before):
            failures.append(f"{method.upper()} {path} {what} -> 400, but a row was made")

    from django.db import transaction

    for path in ISSUE_16_BODIES:
        for method in (("put", "patch") if "{id}" in path and "webhooks" in path else ("post",)):
            valid = bodies[path]
            savepoint = transaction.savepoint()  # the valid body is accepted (and rolled back)
            accepted = getattr(client, method)(path.replace("{id}", str(ids.get(path, 0))), data=json.dumps(valid),
                                               content_type="application/json", **auth)
            transaction.savepoint_rollback(savepoint)
            assert accepted.status_code in (200, 201), (method, path, accepted.content.decode()[:3000])
            for text in NOT_JSON:
                if text == "" and (method, path) in EMPTY_BODY_OK:
                    response = _isolated(lambda: getattr(client, method)(
                        path.replace("{id}", str(ids[path])), data="", content_type="application/json", **auth))
                    assert response.status_code in (200, 201), (method, path, response.content[:300])
                    continue
                check(method, path, text, f"body {text[:20]!r}")
            check(method, path, json.dumps({**valid, "bogus": {"x": 1}}), "unknown key bogus")
            for name, value in valid.items():
                for label, junk in JUNK.items():
                    if _kind(junk) == _kind(value):
                        continue
                    check(method, path, json.dumps({**valid, name: junk}), f"{name}={label}")
    assert sent > 150
    assert not failures, f"{len(failures)} of {sent}:\n" + "\n".join(failures[:40])

    # The cancel: a body of any kind changes nothing of what it does.
    dataset_id, model_id, backend_id = (bodies["/api/sweeps/"]["base"][k] for k in ("dataset", "model_spec", "backend"))
    sweep = sweeps.sweep_create(owner=user, name="fz-cancel", base={"dataset": dataset_id, "model_spec": model_id,
                                                                    "backend": backend_id, "epochs": 1},
                                search_space=bodies["/api/sweeps/"]["search_space"], sampler="random", max_trials=2)
    for text in [*NOT_JSON, json.dumps({"bogus": JUNK})]:
        response = _isolated(lambda: client.post(f"/api/sweeps/{sweep.pk}/cancel/", data=text,
                                                 content_type="application/json", **auth))
        assert response.status_code in (200, 400), (text, response.status_code, response.content[:300])
        if response.status_code == 400:
            assert "already ended" in " ".join(_messages(response.json())), response.content[:300]
    assert Sweep.objects.get(pk=sweep.pk).state == Sweep.State.CANCELLED
