"""Walk every URL of the URLconf (resolved programmatically, so a new URL is covered, or this test
fails until it is classified) as an anonymous client, a stranger, a teammate and a staff stranger.

The rules asserted:

* another user's object (not shared with the requester's team) is a 404 — pages, API and the
  admin's change/history/delete pages alike (existence is never revealed);
* a teammate sees team objects (200) but a write without permission (edit, cancel, re-run, test
  connection, API PUT/PATCH) is a 403;
* anonymous: HTML pages redirect to the login page, the API answers 401, the admin redirects to its
  own login;
* staff-only pages (the admin, /orphans/) refuse non-staff: the admin redirects a signed-in non-staff
  user to its login, /orphans/ answers 403; a staff user who is not a superuser gets 403 on admin pages
  of models governed by Django's permissions and 404 on another user's owned objects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.contrib import admin
from django.utils import timezone
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db

# --- classification ------------------------------------------------------------------------------
# Every named (non-admin) route, by name: what kind of page it is. A route missing here fails
# test_every_url_is_classified. Kinds:
#   public        anyone may GET it (200), or POST it without auth (token: 400 on bad credentials)
#   redirect      a redirect for everyone (the home page)
#   login         a page without an object: anonymous -> login redirect, a user -> 200
#   object-read   GET an object: stranger 404, teammate 200
#   object-write  change an object (method in METHOD): stranger 404, teammate 403
#   staff         staff only: anonymous -> login redirect, signed-in non-staff -> 403
#   api-root/api-list/api-schema   API without an object: anonymous 401, a user 200
#   api-detail    GET 404 / PATCH 404 for a stranger; GET 200 / PATCH 403 for a teammate
#   api-action    POST: stranger 404, teammate 403, anonymous 401
#   api-read      GET an object's read-only action: stranger 404, teammate 200, anonymous 401
#   api-docs      Swagger UI: anonymous -> login redirect, a user 200
#   api-clone     POST a copy of an object: stranger 404, teammate 201 (it becomes theirs), anonymous 401
#   compare / api-compare   a page (API) of jobs chosen by ?ids=: anonymous -> login redirect (401);
#                 a stranger's job id is "not found" like an id of no job, a teammate's job is compared
#   own-read / own-write  a private object (a saved filter): anyone but its owner gets 404, teammates too
#   api-self      the requester's own settings (no object): anonymous 401, a user 200
#   api-own / api-own-read / api-own-list  a private API object (a saved filter): GET (and, for the
#                 object itself, DELETE) 404 for anyone but its owner, teammates too, anonymous 401; the
#                 list never shows another user's
#   token         a bearer-token endpoint (/metrics): 404 while its token is unset, whoever asks
URL_KINDS: dict[str, str] = {
    "home": "redirect",
    "favicon": "redirect",
    "healthz": "public",
    "login": "public",
    "logout": "public-post",
    "dataset-list": "login", "dataset-create": "login",
    "model-list": "login", "model-create": "login",
    "backend-list": "login", "backend-create": "login",
    "job-list": "login", "job-create": "login", "job-estimate": "login", "job-compare": "compare",
    "dataset-edit": "object-write", "model-edit": "object-write", "backend-edit": "object-write",
    "backend-test-connection": "object-write",
    "job-detail": "object-read", "job-live": "object-read", "job-metrics": "object-read",
    "backend-detail": "object-read",
    "job-cancel": "object-write", "job-rerun": "object-write",
    "orphan-list": "staff", "orphan-stop": "staff",
    "api-token": "public-post",
    "api-schema": "api-schema",
    "api-docs": "api-docs",
    "api-root": "api-root",
    "api-dataset-list": "api-list", "api-model-list": "api-list", "api-backend-list": "api-list",
    "api-job-list": "api-list", "api-job-compare": "api-compare",
    "api-dataset-detail": "api-detail", "api-model-detail": "api-detail", "api-backend-detail": "api-detail",
    "api-job-detail": "api-detail",
    "api-backend-test-connection": "api-action", "api-job-cancel": "api-action", "api-job-rerun": "api-action",
    "api-job-clone": "api-clone",
    # A job's price and checks without creating it (docs/client.md): priced for whoever may use the objects.
    "api-job-estimate": "api-estimate",
    "api-backend-queue": "api-read", "api-backend-running-jobs": "api-read", "api-backend-waiting-jobs": "api-read",
    # Artifacts (docs/artifacts.md): carol's job has a run directory with model.pt (the world fixture).
    "job-artifacts": "object-read", "job-artifact-download": "object-read",
    "api-job-artifacts": "api-read", "api-job-artifact-download": "api-read",
    # Sweeps (docs/sweeps.md)
    "sweep-list": "login", "sweep-create": "login", "sweep-detail": "object-read", "sweep-cancel": "object-write",
    "api-sweep-list": "api-list", "api-sweep-detail": "api-detail", "api-sweep-cancel": "api-action",
    # The experiment table and the full log (docs/experiments.md).
    "job-bulk-archive": "login", "job-columns": "login", "savedfilter-create": "login",
    "job-annotate": "object-write", "job-archive": "object-write",
    "job-logs": "object-read", "job-logs-download": "object-read",
    "savedfilter-open": "own-read", "savedfilter-delete": "own-write",
    "api-job-logs": "api-read",
    # Notifications (docs/notifications.md): the user's own settings, webhooks (team ones shared), /metrics
    "notification-settings": "login", "webhook-create": "login",
    "webhook-detail": "object-read", "webhook-edit": "object-write", "webhook-delete": "object-write",
    "metrics": "token",
    "api-notification-settings": "api-self",
    "api-webhook-list": "api-list", "api-webhook-detail": "api-detail", "api-webhook-deliveries": "api-read",
    # Saved filters are private (no team sharing): a 404 for a teammate too, listed for nobody else.
    "api-saved-filter-list": "api-own-list", "api-saved-filter-detail": "api-own", "api-saved-filter-jobs": "api-own-read",
}
# API objects nobody may PUT/PATCH: 405 for everyone (a job's PATCH changes tags, notes and archived only: its owner).
API_NO_UPDATE = {"api-sweep-detail"}
# The method that exercises an object-write / api-action route; GET for edit pages.
METHOD = {"backend-test-connection": "post", "job-cancel": "post", "job-rerun": "post",
          "orphan-stop": "post", "sweep-cancel": "post", "job-bulk-archive": "post", "job-columns": "post",
          "savedfilter-create": "post", "job-annotate": "post", "job-archive": "post", "savedfilter-delete": "post",
          "webhook-delete": "post"}
# Which object a route's pk names: by the route's name prefix.
OBJECT_OF = {"dataset": "dataset", "model": "model", "backend": "backend", "job": "job", "orphan": "orphan",
             "api-dataset": "dataset", "api-model": "model", "api-backend": "backend", "api-job": "job",
             "sweep": "sweep", "api-sweep": "sweep", "savedfilter": "savedfilter", "webhook": "webhook",
             "api-webhook": "webhook", "api-saved": "savedfilter"}
# Admin routes that belong to no model.
ADMIN_SITE_KINDS = {"index": "admin-page", "app_list": "admin-page", "password_change": "admin-page",
                    "password_change_done": "admin-page", "jsi18n": "admin-page", "autocomplete": "admin-misc",
                    "view_on_site": "admin-misc", "login": "admin-login", "logout": "admin-logout",
                    "auth_user_password_change": "admin-misc", None: "admin-misc"}
ADMIN_MODEL_RE = re.compile(r"^(?P<app>[a-z_]+?)_(?P<model>[a-z0-9]+)_(?P<view>changelist|add|change|delete|history)$")


@dataclass
class Route:
    name: str | None  # qualified, e.g. "admin:jobs_dataset_change"; None for an unnamed pattern
    pattern: str      # the full pattern, for messages
    params: list[str] = field(default_factory=list)


def _params(pattern: Any) -> list[str]:
    return list(pattern.regex.groupindex)


def all_routes() -> list[Route]:
    """Every URL pattern of the root URLconf, nested includes flattened, with its qualified name."""
    out: list[Route] = []

    def walk(patterns, prefix: str, namespace: str, params: list[str]) -> None:
        for p in patterns:
            if isinstance(p, URLResolver):
                ns = ":".join(filter(None, [namespace, p.namespace]))
                walk(p.url_patterns, prefix + str(p.pattern), ns, params + _params(p.pattern))
            elif isinstance(p, URLPattern):
                name = f"{namespace}:{p.name}" if (namespace and p.name) else p.name
                out.append(Route(name, prefix + str(p.pattern), params + _params(p.pattern)))

    walk(get_resolver().url_patterns, "", "", [])
    return out


def classify(route: Route) -> str | None:
    if route.name is None:
        return "admin-misc" if route.pattern.startswith("admin/") else None
    if route.name.startswith("admin:"):
        short = route.name.split(":", 1)[1]
        if short in ADMIN_SITE_KINDS:
            return ADMIN_SITE_KINDS[short]
        match = ADMIN_MODEL_RE.match(short)
        return "admin-model" if match and _admin_model(match) is not None else None
    return URL_KINDS.get(route.name)


def _admin_model(match: re.Match):
    for model, model_admin in admin.site._registry.items():
        if (model._meta.app_label, model._meta.model_name) == (match["app"], match["model"]):
            return model, model_admin
    return None


# --- the world -----------------------------------------------------------------------------------


@pytest.fixture
def world(django_user_model, settings, tmp_path):
    """carol owns a dataset, a model, a gpubox backend and a job, all shared with team "vision";
    erin is in the team, dave is not, sam is staff (not superuser) and in no team."""
    from jobs import services
    from jobs.models import Dataset, JobLogLine, MetricPoint, ModelSpec, OrphanJob, Team, TrainingJob

    settings.TRAINBOARD_RUN_ROOT = tmp_path
    settings.TRAINBOARD_K8S_KUBECONFIG = "/etc/operator/kubeconfig"  # never read: no call is made
    settings.TRAINBOARD_K8S_ALLOWED_IMAGES = "ghcr.io/acme/*"
    users = {name: django_user_model.objects.create_user(username=name, password=f"pw-{name}-Secret-1",
                                                          is_staff=(name == "sam"))
             for name in ("carol", "dave", "erin", "sam")}
    team = Team.objects.create(name="vision")
    team.members.add(users["carol"], users["erin"])
    carol = users["carol"]
    dataset = services.dataset_create(owner=carol, name="carol-digits", format="builtin", builtin_name="digits")
    model = services.model_spec_create(owner=carol, name="carol-cnn", architecture="cnn", params={})
    backend = services.backend_create(owner=carol, name="carol-box", kind="gpubox",
                                      config={"hourly_rate_usd": 1.5}, team=team)
    Dataset.objects.filter(pk=dataset.pk).update(team=team)
    ModelSpec.objects.filter(pk=model.pk).update(team=team)
    job = services.training_job_create(owner=carol, dataset=dataset.pk, model_spec=model.pk, backend=backend.pk,
                                       nodes=1, procs_per_node=1, epochs=1, name="carol-job")
    # A run directory with one file, so the artifact download routes have something to serve.
    (tmp_path / "tb-job-carol" / "output").mkdir(parents=True)
    (tmp_path / "tb-job-carol" / "output" / "model.pt").write_bytes(b"carol's weights")
    TrainingJob.objects.filter(pk=job.pk).update(team=team, provider_handle={
        "provider": "gpubox", "job_name": "tb-job-carol", "provider_job_id": str(tmp_path / "tb-job-carol")})
    MetricPoint.objects.create(job=job, name="train_loss", step=1, epoch=0, value=1.0, recorded_at=timezone.now())
    JobLogLine.objects.create(job=job, seq=0, text="hello from carol")
    orphan = OrphanJob.objects.create(backend=backend, provider_job_name="tb-job-999-abc", raw_state="Running",
                                   last_seen_at=timezone.now())
    from jobs import sweeps
    from jobs.models import Sweep

    sweep = sweeps.sweep_create(owner=carol, name="carol-sweep", base={"dataset": dataset.pk, "model_spec": model.pk,
                                                                     "backend": backend.pk, "epochs": 1},
                                search_space={"train.lr": {"type": "categorical", "choices": [0.1, 0.05]}},
                                sampler="grid")
    Sweep.objects.filter(pk=sweep.pk).update(team=team)
    saved = services.saved_filter_create(owner=carol, name="carol-best", query={"sort": "-val_accuracy"})
    settings.TRAINBOARD_METRICS_TOKEN = ""  # /metrics is off: a 404 for everyone
    webhook, _secret = services.webhook_create(owner=carol, url="https://93.184.215.14/hook", events=["job.failed"],
                                               team=team, name="carol-hook")
    import uuid

    from jobs.models import WebhookDelivery

    WebhookDelivery.objects.create(webhook=webhook, job=job, delivery_id=uuid.uuid4(), event="job.failed",
                                   payload={"event": "job.failed", "job": {"id": job.pk}})  # its admin page is walked
    objects = {"dataset": dataset, "model": model, "backend": backend, "job": job, "orphan": orphan, "sweep": sweep,
               "savedfilter": saved, "webhook": webhook}
    return {"users": users, "team": team, "objects": objects}


def _client(user=None) -> Client:
    c = Client()
    if user is not None:
        c.force_login(user)
    return c


def _api(user=None) -> APIClient:
    c = APIClient()
    if user is not None:
        c.force_authenticate(user)
    return c


def _kwargs(route: Route, obj_pk: Any, admin_obj: Any = None) -> dict[str, Any]:
    values = {"pk": obj_pk, "format": "json", "name": "model.pt", "app_label": "jobs", "url": "no-such-page/",
              "content_type_id": 1, "object_id": getattr(admin_obj, "pk", 1), "id": 1}
    return {p: values[p] for p in route.params}


def _url(route: Route, world) -> str:
    prefix = route.name.split("-", 1)[0] if not route.name.startswith("api-") else "-".join(route.name.split("-")[:2])
    obj = world["objects"].get(OBJECT_OF.get(prefix, ""))
    return reverse(route.name, kwargs=_kwargs(route, obj.pk if obj is not None else None))


def _is_login_redirect(response, login_path: str = "/login/") -> bool:
    return response.status_code == 302 and response["Location"].startswith(login_path)


def _html_routes():
    return [r for r in all_routes() if r.name and not r.name.startswith("admin:")]


# --- tests ---------------------------------------------------------------------------------------


def test_every_url_is_classified():
    routes = all_routes()
    assert len(routes) > 60  # the admin alone has dozens; a broken walk finds few
    unclassified = [f"{r.name or '(unnamed)'}: {r.pattern}" for r in routes if classify(r) is None]
    assert not unclassified, "classify these URLs in tests/security/test_permission_walk.py: " + \
        "; ".join(unclassified)
    stale = set(URL_KINDS) - {r.name for r in routes}
    assert not stale, f"URL_KINDS names routes that no longer exist: {sorted(stale)}"


def test_anonymous_is_sent_to_login_or_gets_401(world):
    problems = []
    anon, api = _client(), _api()
    for route in _html_routes():
        kind, url = classify(route), _url(route, world)
        method = METHOD.get(route.name, "get")
        if kind in ("login", "object-read", "object-write", "staff", "api-docs", "compare", "own-read", "own-write"):
            r = getattr(anon, method)(url)
            if not _is_login_redirect(r):
                problems.append(f"{method.upper()} {url}: {r.status_code}, expected a redirect to /login/")
        elif kind == "token":
            r = anon.get(url)
            if r.status_code != 404:
                problems.append(f"GET {url}: {r.status_code}, expected 404 (its token is unset)")
        elif kind in ("api-root", "api-list", "api-schema", "api-detail", "api-read", "api-compare", "api-self",
                      "api-own", "api-own-read", "api-own-list"):
            r = api.get(url)
            if r.status_code != 401:
                problems.append(f"GET {url}: {r.status_code}, expected 401")
        elif kind in ("api-action", "api-clone", "api-estimate"):
            r = api.post(url)
            if r.status_code != 401:
                problems.append(f"POST {url}: {r.status_code}, expected 401")
        elif kind == "public":
            r = anon.get(url)
            if r.status_code != 200:
                problems.append(f"GET {url}: {r.status_code}, expected 200 (public)")
        elif kind == "public-post" and route.name == "api-token":
            r = api.post(url, {"username": "carol", "password": "wrong"})
            if r.status_code != 400 or "token" in r.json():
                problems.append(f"POST {url} with a wrong password: {r.status_code} {r.content[:100]!r}")
        elif kind == "redirect":
            r = anon.get(url)
            if r.status_code != 302:
                problems.append(f"GET {url}: {r.status_code}, expected 302")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("who", ["dave", "erin"])
def test_object_urls_as_stranger_and_teammate(world, who):
    """dave (stranger): every object URL is a 404, the API lists do not show carol's objects.
    erin (teammate): reads are 200, writes are 403."""
    user = world["users"][who]
    web, api = _client(user), _api(user)
    stranger = who == "dave"
    problems = []
    checked = 0
    for route in _html_routes():
        kind, url = classify(route), _url(route, world)
        method = METHOD.get(route.name, "get")
        expected = None
        if kind == "object-read":
            expected, r = (404 if stranger else 200), getattr(web, method)(url)
        elif kind == "object-write":
            expected, r = (404 if stranger else 403), getattr(web, method)(url)
        elif kind in ("own-read", "own-write"):
            expected, r = 404, getattr(web, method)(url)
        elif kind == "staff":
            expected, r = 403, getattr(web, method)(url)
        elif kind == "api-detail":
            r = api.get(url)
            if r.status_code != (404 if stranger else 200):
                problems.append(f"GET {url}: {r.status_code}")
            expected = 405 if route.name in API_NO_UPDATE else (404 if stranger else 403)
            r, method = api.patch(url, {"name": "renamed"}, format="json"), "patch"
        elif kind == "api-action":
            expected, r, method = (404 if stranger else 403), api.post(url), "post"
        elif kind == "api-clone":
            expected, r, method = (404 if stranger else 201), api.post(url, {}, format="json"), "post"
        elif kind == "api-estimate":
            # carol's dataset, model and backend: priced for a teammate; for a stranger they do not exist.
            objects = world["objects"]
            body = {"dataset": objects["dataset"].pk, "model_spec": objects["model"].pk,
                    "backend": objects["backend"].pk, "nodes": 1, "procs_per_node": 1}
            r, method = api.post(url, body, format="json"), "post"
            expected = 400 if stranger else 200
            if r.status_code == 400 and not {"dataset", "model_spec", "backend"} <= set(r.json()):
                problems.append(f"POST {url}: {r.json()}, expected errors on dataset, model_spec and backend")
            if r.status_code == 200 and r.json()["job"]["id"] is not None:
                problems.append(f"POST {url}: an estimate made job {r.json()['job']['id']}")
        elif kind == "api-read":
            expected, r = (404 if stranger else 200), api.get(url)
        elif kind == "api-own":
            r = api.get(url)
            if r.status_code != 404:
                problems.append(f"GET {url}: {r.status_code}, expected 404 (private to carol)")
            expected, r, method = 404, api.delete(url), "delete"
        elif kind == "api-own-read":
            expected, r = 404, api.get(url)
        elif kind in ("compare", "api-compare"):
            job = world["objects"]["job"]
            asked = f"{url}?ids={job.pk},{job.pk + 1000}"
            r = web.get(asked) if kind == "compare" else api.get(asked)
            if kind == "compare":
                page = r.content.decode()
                shown = f'data-job-id="{job.pk}"' in page or "carol-job" in page
                told = f"#{job.pk}," in page and f"#{job.pk + 1000} " in page if stranger else f"#{job.pk + 1000} " in page
            else:
                body = r.json() if r.status_code == 200 else {}
                shown = [run["id"] for run in body.get("runs", [])] == [job.pk]
                told = body.get("not_found") == ([job.pk, job.pk + 1000] if stranger else [job.pk + 1000])
            if r.status_code != 200 or shown == stranger or not told:
                problems.append(f"GET {asked}: {r.status_code}, carol's job shown: {shown}, not found told: {told}")
            checked += 1
            continue
        elif kind in ("api-list", "api-own-list"):
            r = api.get(url)
            ids = {row["id"] for row in r.json()["results"]} if r.status_code == 200 else set()
            obj = world["objects"][OBJECT_OF["-".join(route.name.split("-")[:2])]]
            if r.status_code != 200 or (obj.pk in ids) == (stranger or kind == "api-own-list"):
                problems.append(f"GET {url}: {r.status_code}, carol's object listed: {obj.pk in ids}")
            checked += 1
            continue
        else:
            continue
        checked += 1
        if r.status_code != expected:
            problems.append(f"{method.upper()} {url}: {r.status_code}, expected {expected}")
    assert checked >= 20
    assert not problems, "\n".join(problems)
    # Nothing was changed or created by the refused writes.
    from jobs.models import ComputeBackend, Dataset, TrainingJob, Webhook

    assert Webhook.objects.get(pk=world["objects"]["webhook"].pk).name == "carol-hook"
    assert Dataset.objects.get(pk=world["objects"]["dataset"].pk).name == "carol-digits"
    assert ComputeBackend.objects.get(pk=world["objects"]["backend"].pk).name == "carol-box"
    carol_job = world["objects"]["job"]
    assert TrainingJob.objects.get(pk=carol_job.pk).state == "QUEUED"
    # The only jobs made are the teammate's own clones (api-clone, with and without .json); none for a stranger.
    made = list(TrainingJob.objects.exclude(pk=carol_job.pk).values_list("owner__username", "cloned_from", "state"))
    assert made == ([] if stranger else [(who, carol_job.pk, "QUEUED")] * 2)
    from jobs.models import SavedFilter

    carol = TrainingJob.objects.get(pk=carol_job.pk)
    assert (carol.tags, carol.notes, carol.archived_at) == ([], "", None)
    assert list(SavedFilter.objects.values_list("name", flat=True)) == ["carol-best"]


def test_teammate_can_launch_on_shared_objects_and_stranger_cannot(world):
    from django.core.exceptions import ValidationError

    from jobs import services

    o = world["objects"]
    job = services.training_job_create(owner=world["users"]["erin"], dataset=o["dataset"].pk,
                                       model_spec=o["model"].pk, backend=o["backend"].pk, nodes=1,
                                       procs_per_node=1, epochs=1, name="erin-job")
    assert job.owner == world["users"]["erin"] and job.backend_id == o["backend"].pk
    with pytest.raises(ValidationError) as exc:
        services.training_job_create(owner=world["users"]["dave"], dataset=o["dataset"].pk,
                                     model_spec=o["model"].pk, backend=o["backend"].pk)
    assert set(exc.value.message_dict) == {"dataset", "model_spec", "backend"}


def _admin_routes(world):
    for route in all_routes():
        if route.pattern.startswith("admin/"):
            yield route


def _admin_url(route: Route, world, carol) -> str | None:
    kind = classify(route)
    if route.name is None:
        return "/admin/no-such-page/"
    short = route.name.split(":", 1)[1]
    if kind == "admin-model":
        model, model_admin = _admin_model(ADMIN_MODEL_RE.match(short))
        obj = None
        if "object_id" in route.params:
            owner_path = getattr(model_admin, "owner_path", None)
            qs = model._default_manager.all()
            obj = (qs.filter(**{owner_path: carol}) if owner_path else qs).first()
            if obj is None:
                return None  # e.g. no row of this model exists in the world; the changelist still runs
        return reverse(route.name, kwargs=_kwargs(route, None, obj))
    if short == "view_on_site":
        return reverse(route.name, kwargs={"content_type_id": 1, "object_id": 1})
    return reverse(route.name, kwargs=_kwargs(route, None))


def _request_as(user):
    from django.test import RequestFactory

    request = RequestFactory().get("/admin/")
    request.user = user
    return request


@pytest.mark.parametrize("who", ["anonymous", "dave"])
def test_admin_refuses_anonymous_and_non_staff(world, who):
    user = None if who == "anonymous" else world["users"][who]
    c = _client(user)
    problems = []
    for route in _admin_routes(world):
        url = _admin_url(route, world, world["users"]["carol"])
        if url is None:
            continue
        kind = classify(route)
        r = c.get(url)
        if kind == "admin-login":
            ok = r.status_code == 200 if user is None else r.status_code in (200, 302)
        elif kind == "admin-logout":
            ok = r.status_code in (302, 405)  # POST only; a GET logs nobody out and shows nothing
        else:
            ok = _is_login_redirect(r, "/admin/login/")
        if not ok:
            problems.append(f"GET {url} ({kind}): {r.status_code} {r.get('Location', '')}")
    assert not problems, "\n".join(problems)


def test_admin_as_staff_who_is_not_the_owner(world):
    """sam (staff, not superuser): another user's owned rows are a 404 on their pages and absent from
    the changelists; models governed by Django's permissions are a 403 without them."""
    from jobs.admin import OwnedAdmin

    carol, sam = world["users"]["carol"], world["users"]["sam"]
    c = _client(sam)
    problems, seen = [], 0
    for route in _admin_routes(world):
        if classify(route) != "admin-model":
            continue
        url = _admin_url(route, world, carol)
        if url is None:
            continue
        model, model_admin = _admin_model(ADMIN_MODEL_RE.match(route.name.split(":", 1)[1]))
        view = ADMIN_MODEL_RE.match(route.name.split(":", 1)[1])["view"]
        owned = isinstance(model_admin, OwnedAdmin)
        r = c.get(url)
        seen += 1
        if not owned:
            expected = 403
        elif view in ("change", "delete", "history"):
            expected = 404
        elif view == "add":
            # Rows only the services write (jobs, events, metrics, logs) have no add page.
            expected = 200 if model_admin.has_add_permission(_request_as(sam)) else 403
        else:
            expected = 200
        if r.status_code != expected:
            problems.append(f"GET {url}: {r.status_code}, expected {expected}")
        elif owned and view == "changelist":
            body = r.content.decode()
            for name in ("carol-digits", "carol-cnn", "carol-box", "carol-job", "hello from carol", "carol-sweep",
                         "carol-hook", "93.184.215.14"):
                if name in body:
                    problems.append(f"GET {url} shows carol's {name!r}")
    assert seen > 30
    # Staff pages outside the admin open for staff (the walk above showed non-staff get 403).
    orphans = c.get(reverse("orphan-list"))
    if orphans.status_code != 200:
        problems.append(f"GET /orphans/ as staff: {orphans.status_code}")
    assert not problems, "\n".join(problems)


def test_sharing_is_only_with_a_team_one_belongs_to(world):
    from django.core.exceptions import ValidationError

    from jobs import services
    from jobs.models import ComputeBackend

    with pytest.raises(ValidationError) as exc:
        services.backend_create(owner=world["users"]["dave"], name="dave-box", kind="gpubox", config={},
                                team=world["team"])
    assert exc.value.message_dict["team"] == ["Choose one of your teams; you are not a member of this one."]
    assert not ComputeBackend.objects.filter(name="dave-box").exists()
    # The API offers only the user's teams: another team's id is a 400 naming the field.
    r = _api(world["users"]["dave"]).post(reverse("api-backend-list"),
                                          {"name": "dave-box", "kind": "gpubox", "config": {},
                                           "team": world["team"].pk}, format="json")
    assert r.status_code == 400 and "team" in r.json()
    r = _api(world["users"]["erin"]).post(reverse("api-backend-list"),
                                          {"name": "erin-box", "kind": "gpubox", "config": {},
                                           "team": world["team"].pk}, format="json")
    assert r.status_code == 201 and r.json()["team"] == world["team"].pk
    # carol (a member) now sees erin's shared backend; dave does not.
    ids = {row["id"] for row in _api(world["users"]["carol"]).get(reverse("api-backend-list")).json()["results"]}
    assert r.json()["id"] in ids
    ids = {row["id"] for row in _api(world["users"]["dave"]).get(reverse("api-backend-list")).json()["results"]}
    assert r.json()["id"] not in ids


def test_dataset_validation_refuses_a_team_the_owner_is_not_in(world):
    # dataset_create takes no team yet (see the report); its validation already checks membership.
    from jobs import validation
    from jobs.models import Dataset
    from jobs.services import resources

    errors = validation.Errors()
    resources._validate_dataset(errors, Dataset(owner=world["users"]["dave"], name="d", format="builtin",
                                               builtin_name="digits", team=world["team"]))
    assert errors == {"team": ["Choose one of your teams; you are not a member of this one."]}
    errors = validation.Errors()
    resources._validate_dataset(errors, Dataset(owner=world["users"]["erin"], name="d", format="builtin",
                                               builtin_name="digits", team=world["team"]))
    assert errors == {}


# --- backend settings: what a non-staff user's backend can reach ----------------------------------
# Every setting of every registered kind (the adapter's declaration, ``settings.keys``), classified.
# "host": the operator's (``settings.host``): refused for a backend whose owner is not staff through
# the UI form, the API and the service, and the installation's value is used. Anything else: what it
# reaches, which is the owner's own jobs on that provider only. A new setting fails
# test_every_backend_setting_is_classified until it is classified here.
# Whose account those settings reach: a cloud backend's calls carry its stored credentials. Without
# them they would carry the worker's own identity (the adapter's ``ambient_identity``: the operator's
# account), which only a staff user's backend may use (TRAINBOARD_WORKER_CREDENTIALS=staff, the
# default): anyone else's is refused (test_a_non_staff_cloud_backend_cannot_use_the_workers_identity),
# so a role or service account of theirs never reaches the operator's account.
OWN_ACCOUNT = ("the provider account of the backend's stored credentials (its own jobs there); the worker's "
               "own identity only for a staff user's backend, or for every user's where the operator sets "
               "TRAINBOARD_WORKER_CREDENTIALS=everyone")
SETTING_REACH: dict[str, dict[str, str]] = {
    "gpubox": {
        "run_root": "host", "python": "host", "max_procs_per_node": "host",
        "pip_args": "host", "run_as": "host", "job_uids": "host", "job_memory_limit": "host",
        "env_passthrough": "host", "allowed_images": "host", "gpu_ids": "host", "slots": "host", "max_concurrent_jobs": "host",
        "hourly_rate_usd": "the price of this backend's jobs: their cost and budget stop (0-100,000 USD/h)",
        "grace_period_s": "how long a cancelled job of this backend has to stop before SIGKILL (0-600 s)",
        "gpu_model": "the name the memory plan shows for this backend's GPUs (text, at most 100 characters)",
        "gpu_memory_gib": "the GPU memory the memory plan checks this backend's jobs against (0-100,000 GiB): "
                          "a wrong value misjudges only this backend's jobs, it runs nothing",
    },
    "sagemaker": {
        "profile": "host", "endpoint_url": "host",
        **{key: OWN_ACCOUNT for key in ("region", "role_arn", "bucket", "prefix", "image_uri", "instance_type",
                                        "spot_allowed", "max_nodes", "max_procs_per_node", "volume_size_gb",
                                        "max_calls_per_second")},
    },
    "vertex": {
        "api_endpoint": "host", "storage_endpoint": "host",
        **{key: OWN_ACCOUNT for key in ("project", "region", "staging_bucket", "image_uri", "service_account",
                                        "machine_type", "accelerator_type", "accelerator_count", "spot_allowed",
                                        "max_nodes")},
    },
    "azureml": {
        "base_url": "host",
        **{key: OWN_ACCOUNT for key in ("subscription_id", "resource_group", "workspace", "compute",
                                        "environment", "vm_size", "tier", "region", "max_nodes")},
    },
    "slurm": {
        "transport": "host", "login_host": "host", "ssh_port": "host", "ssh_user": "host", "ssh_host_key": "host",
        "slurm_conf": "host", "work_dir": "host", "python": "host", "allowed_images": "host",
        **{key: "which of the cluster's partitions, accounts and QoS this backend's jobs ask for: Slurm itself "
                "checks them against the worker's cluster user and the site's limits" for key in ("partition", "account",
                                                                                                 "qos")},
        **{key: "the resources one job of this backend requests per node or task (within the partition's limits; "
                "extra sbatch options only from the allowlist, never --uid, --chdir, --export, --wrap)"
           for key in ("gpus_per_node", "gpu_request", "cpus_per_task", "mem_per_node_gb", "max_nodes",
                       "extra_sbatch_options")},
        "container_image": "the image this backend's jobs run in, one the operator's allowed_images admits (else refused)",
        "cluster": "the price of this backend's jobs: which internal-rate row (cluster, partition) prices them",
    },
    "kubernetes": {
        "kubeconfig": "host", "context": "host", "in_cluster": "host", "service_account": "host",
        "allowed_images": "host",
        **{key: OWN_ACCOUNT for key in ("namespace", "runtime", "image", "gpus_per_node", "cpu_request",
                                        "memory_request", "node_selector", "tolerations", "suspend", "queue_name",
                                        "output_path", "max_nodes", "max_procs_per_node")},
        **{key: "the price of this backend's jobs: which catalog row (internal rate or cloud instance type) prices "
                "them, for their cost and budget stop" for key in ("cluster", "node_pool", "price_provider",
                                                                  "price_region", "price_instance_type")},
    },
    "ray": {
        "address": "host", "python": "host",
        **{key: "the resources one job of this backend reserves on the operator's Ray cluster per worker and how "
                "Ray places them (within what the cluster has; Ray refuses or queues the rest)"
           for key in ("cpus_per_worker", "gpus_per_worker", "placement", "max_workers")},
        "output_path": "where on the cluster's nodes this backend's jobs write their outputs (an absolute path the "
                       "job's own processes, already running the user's code there, can write)",
        "cluster": "the price of this backend's jobs: which internal-rate row (cluster, worker) prices them",
    },
}
# A value of the right type for each host setting (refused before its value is looked at).
HOST_VALUES = {"run_root": "/tmp/owned", "python": "/bin/echo", "max_procs_per_node": 1000,
               "pip_args": "--index-url http://127.0.0.1:9/simple", "run_as": "root", "env_passthrough": "AWS_SECRET_ACCESS_KEY",
               "job_uids": "none", "job_memory_limit": "none", "allowed_images": "*", "gpu_ids": "0,1,2,3,4,5,6,7", "slots": 1024, "max_concurrent_jobs": 10_000,
               "profile": "operator", "endpoint_url": "http://127.0.0.1:9/", "api_endpoint": "http://127.0.0.1:9",
               "storage_endpoint": "http://127.0.0.1:9", "base_url": "http://127.0.0.1:9",
               "kubeconfig": "/etc/operator/kubeconfig", "context": "operator-admin", "in_cluster": True,
               "service_account": "cluster-admin", "transport": "ssh", "login_host": "login.operator.example",
               "ssh_port": 2222, "ssh_user": "root",
               "ssh_host_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBvXzRn4Gq3wbYl0RkU5kq4c2fJ8bEM2sS0Yb1cKpQ8h",
               "slurm_conf": "/etc/operator/slurm.conf", "work_dir": "/tmp/owned-slurm",
               "address": "http://127.0.0.1:9"}


def _host_settings() -> list[tuple[str, str]]:
    return [(kind, key) for kind, keys in SETTING_REACH.items() for key, reach in keys.items() if reach == "host"]


def test_every_backend_setting_is_classified():
    from cloud_adapters.registry import KINDS, backend_class

    assert set(SETTING_REACH) == set(KINDS)
    for kind in KINDS:
        cls = backend_class(kind)
        assert set(SETTING_REACH[kind]) == set(cls.settings.keys), f"classify {kind}'s settings here"
        assert {k for k, reach in SETTING_REACH[kind].items() if reach == "host"} == set(cls.settings.host)
    assert set(HOST_VALUES) == {key for _, key in _host_settings()}


@pytest.mark.parametrize("kind,key", _host_settings())
def test_a_host_setting_is_refused_for_non_staff_through_the_form_the_api_and_the_service(world, kind, key):
    import json

    from django.core.exceptions import ValidationError

    from jobs import adapters, services
    from jobs.models import ComputeBackend

    dave, sam = world["users"]["dave"], world["users"]["sam"]
    label = adapters.backend_setting_labels(kind).get(key, key)
    refusal = f"{label}: only a backend owned by staff may set this"
    # The service (what the admin and any command call): on the setting itself.
    with pytest.raises(ValidationError) as exc:
        services.backend_create(owner=dave, name="dave-box", kind=kind, config={key: HOST_VALUES[key]})
    assert any(m.startswith(refusal) for m in exc.value.message_dict[f"config.{key}"])
    # The API: a 400 naming the setting.
    r = _api(dave).post(reverse("api-backend-list"), {"name": "dave-box", "kind": kind,
                                                       "config": {key: HOST_VALUES[key]}}, format="json")
    assert r.status_code == 400 and any(m.startswith(refusal) for m in r.json()["config"]), r.content
    # The UI form: the page comes back with the refusal (on the setting's input or the JSON field).
    r = _client(dave).post(reverse("backend-create"), {"name": "dave-box", "kind": kind, "enabled": "on",
                                                        "extra_config": json.dumps({key: HOST_VALUES[key]})})
    assert r.status_code == 200 and refusal in r.content.decode()
    assert not ComputeBackend.objects.filter(name="dave-box").exists()
    # A setting with an input of its own is shown disabled to dave (the browser sends nothing), not to sam.
    from webapp.forms import _registered_kind_settings

    for name in [n for n, k in _registered_kind_settings().get(kind, {}).items() if k == key]:
        pattern = re.compile(rf'<input[^>]*name="{name}"[^>]*>')
        for who, disabled in ((dave, True), (sam, False)):
            tag = pattern.search(_client(who).get(reverse("backend-create")).content.decode()).group(0)
            assert ('disabled' in tag) == disabled, (who.username, tag)
    # Staff may (the mechanism is the owner's staff flag, shown here on the GPU box).
    if kind == "gpubox":
        r = _api(sam).post(reverse("api-backend-list"), {"name": "sam-box", "kind": kind,
                                                          "config": {key: HOST_VALUES[key]}}, format="json")
        assert r.status_code == 201 and r.json()["config"] == {key: HOST_VALUES[key]}


def test_a_non_staff_gpubox_backend_reaches_only_its_price_and_its_cancel_grace(world, settings, tmp_path):
    """carol's own settings change her jobs' price and cancel grace, within bounds; where they run,
    with which interpreter and how many ranks stay the installation's."""
    import sys

    from django.core.exceptions import ValidationError

    from jobs import adapters, services

    settings.TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE = 3
    settings.TRAINBOARD_GPUBOX_PYTHON = ""  # the installation's default: the worker's own interpreter
    carol = world["users"]["carol"]
    backend = services.backend_update(backend=world["objects"]["backend"],
                                      config={"hourly_rate_usd": 100_000, "grace_period_s": 600})
    adapter = adapters.backend_adapter(backend)
    assert adapter.price() == 100_000.0 and adapter.config["grace_period_s"] == 600.0
    assert (adapter.config["run_root"], adapter.config["python"], adapter.capabilities.max_procs_per_node) == \
        (str(tmp_path), sys.executable, 3)
    for config, needle in (({"hourly_rate_usd": 100_001}, "Hourly rate (USD): must be 0 to 100,000"),
                           ({"grace_period_s": 601}, "Cancel grace period (s): must be 0 to 600")):
        with pytest.raises(ValidationError) as exc:
            services.backend_create(owner=carol, name="carol-2", kind="gpubox", config=config)
        assert exc.value.message_dict[f"config.{next(iter(config))}"][0].startswith(needle)


# A minimal valid configuration of each cloud kind (a role or service account of the user's choosing).
CLOUD_CONFIGS = {
    "sagemaker": {"region": "us-east-1", "role_arn": "arn:aws:iam::210987654321:role/AnyRoleIWant",
                  "bucket": "dave-bucket"},
    "vertex": {"project": "operator-prod", "staging_bucket": "gs://dave/staging",
               "service_account": "owner@operator-prod.iam.gserviceaccount.com"},
    "azureml": {"subscription_id": "3f2b6c1e-8a4d-4e7b-9c0a-5d1e2f3a4b5c", "resource_group": "ops-rg",
                "workspace": "ops-ws", "compute": "gpu-cluster"},
    # The installation's kubeconfig and allowed images are the world's (TRAINBOARD_K8S_*).
    "kubernetes": {"image": "ghcr.io/acme/trainer:1", "namespace": "operator-system"},
}


def test_the_kinds_that_use_the_workers_identity_are_the_clouds():
    from cloud_adapters.registry import KINDS, backend_class

    assert {k for k in KINDS if backend_class(k).ambient_identity} == set(CLOUD_CONFIGS)
    assert {k for k, keys in SETTING_REACH.items() if OWN_ACCOUNT in keys.values()} == set(CLOUD_CONFIGS)


@pytest.mark.parametrize("kind", sorted(CLOUD_CONFIGS))
def test_a_non_staff_cloud_backend_cannot_use_the_workers_identity(world, kind, settings):
    from django.core.exceptions import ValidationError

    from cloud_adapters.base import CredentialsError
    from cloud_adapters.registry import backend_class
    from jobs import adapters, services
    from jobs.models import ComputeBackend

    dave, sam = world["users"]["dave"], world["users"]["sam"]
    config = CLOUD_CONFIGS[kind]
    first = next(k for k, required in backend_class(kind).settings.secret_keys.items() if required)
    refusal = (f"{first}: required, because this backend stores no credentials of its own, so its calls would "
               f"use the worker's own identity ({backend_class(kind).ambient_identity}), which only a backend "
               f"owned by staff may use.")
    with pytest.raises(ValidationError) as exc:
        services.backend_create(owner=dave, name="dave-cloud", kind=kind, config=config)
    assert exc.value.message_dict["secrets"][0].startswith(refusal)
    r = _api(dave).post(reverse("api-backend-list"), {"name": "dave-cloud", "kind": kind, "config": config},
                        format="json")
    assert r.status_code == 400 and r.json()["secrets"][0].startswith(refusal), r.content
    assert not ComputeBackend.objects.filter(name="dave-cloud").exists()
    # A row stored before the rule is refused where it is used: no adapter, so no provider call.
    old = ComputeBackend.objects.create(owner=dave, name="dave-old", kind=kind, config=config)
    with pytest.raises(CredentialsError):
        adapters.backend_adapter(old)
    # Staff's backend may, and so may dave's where the operator allows it.
    r = _api(sam).post(reverse("api-backend-list"), {"name": "sam-cloud", "kind": kind, "config": config},
                       format="json")
    assert r.status_code == 201, r.content
    settings.TRAINBOARD_WORKER_CREDENTIALS = "everyone"
    assert adapters.backend_adapter(old).kind == kind


@pytest.mark.parametrize("who", ["dave", "erin"])
def test_the_job_form_prefilled_from_a_job_is_404_for_a_stranger_and_200_for_a_teammate(world, who):
    """``/jobs/new/?from=<id>`` (New job like this, Continue, Fine-tune) reads the job: a stranger
    gets 404 for GET and POST and nothing is created; a teammate gets the prefilled form."""
    from jobs.models import TrainingJob

    job = world["objects"]["job"]
    web = _client(world["users"][who])
    before = TrainingJob.objects.count()
    for mode in ("", "continue", "finetune"):
        url = reverse("job-create") + f"?from={job.pk}" + (f"&mode={mode}" if mode else "")
        r = web.get(url)
        assert r.status_code == (404 if who == "dave" else 200), (url, r.status_code)
        if who == "dave":
            assert web.post(url, {"dataset": 1}).status_code == 404
    assert TrainingJob.objects.count() == before
    assert web.get(reverse("job-create") + "?from=abc").status_code == 404
