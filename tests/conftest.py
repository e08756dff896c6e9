"""Shared fixtures: users, a digits dataset, a CNN model, a local gpubox backend, AWS on the SageMaker
stand-in, a Chromium page, a real Celery worker (+ beat) process for end-to-end tests, and the test
Slurm cluster (started once per pytest process, a clean view of it per module).

The suite runs on PostgreSQL and Redis (the Makefile sets ``DATABASE_URL`` and ``REDIS_URL``)::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/trainboard REDIS_URL=redis://127.0.0.1:6379/15 \\
        .venv/bin/python -m pytest tests/jobs tests/e2e -q

``celery_worker_process`` (function scope, needs ``transactional_db`` so the worker sees committed
rows) lends the test this pytest process's shared ``celery -A webapp worker -B -Q
celery,notifications,gpubox.local`` (the default queue, the notifications queue and the ``local``
box's; tests/sharedworker.py), on pytest-django's test database and an empty broker of its own, with
``TRAINBOARD_RUN_ROOT`` = the test's ``run_root`` and a 1 s sync interval; it yields a
:class:`workerkit.WorkerProcess` and, at the test's end, pauses the worker and kills any run left
behind::

    @pytest.mark.e2e
    def test_job(celery_worker_process, user, digits_dataset, cnn_model, local_backend):
        job = services.training_job_create(owner=user, ...)
        celery_worker_process.wait_for(lambda: reload(job).is_terminal, timeout=120)
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Iterator

import pytest

from fixture_report import count_start
from polling import wait_for
from sharedworker import SharedWorker
from workerkit import (ALONGSIDE_KEYS, DEFAULT_QUEUES, WorkerProcess, install_flush_retry, live_processes_mentioning,
                       start_worker, use_broker, wait_for_sessions_to_close, worker_environment)

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    install_flush_retry()  # a module's shared worker can deadlock the flush between its tests
    # The launcher samples the hardware every 5 s by default (trainer_pkg/hardware.py) and prints a
    # record each time: launchers the tests start from this environment do not, so a test's stdout
    # holds only the trainer's or the script's records (tests/trainer_pkg/test_hardware.py turns it
    # on with --hardware-every-s). A GPU box's jobs start from an allowlisted environment and sample.
    os.environ["TRAINBOARD_HARDWARE_EVERY_S"] = "0"


@pytest.fixture(scope="session", autouse=True)
def _fast_password_hashing():
    """Users' passwords hashed with 1 PBKDF2 iteration instead of 1,000,000 (tests/fast_hashing.py):
    the same hash format, half a second less per user and per login."""
    from django.conf import settings
    from django.test.utils import override_settings

    with override_settings(PASSWORD_HASHERS=["fast_hashing.FastPBKDF2PasswordHasher", *settings.PASSWORD_HASHERS]):
        yield


_DB_FIXTURES = {"db", "transactional_db", "django_db_reset_sequences", "django_db_serialized_rollback"}


@pytest.fixture(autouse=True)
def _no_optuna_study_left(request):
    """A test that uses the database starts with no Optuna study. Sweeps' studies are written through
    Optuna's own connection, outside the test's transaction and the flush after it, under names made
    of the sweep's id (``trainboard-sweep-<id>``); ids come round again after a rollback, so a later
    test's sweep would load an earlier test's study (other distributions: a refused ask). One query
    when no study is there."""
    if request.node.get_closest_marker("django_db") is None and not _DB_FIXTURES & set(request.fixturenames):
        return
    request.getfixturevalue("_django_db_helper")  # the test's database access, as it would have it
    from django.db import connection

    if "studies" not in connection.introspection.table_names():
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM studies LIMIT 1")
        if cursor.fetchone() is None:
            return
    import optuna

    from jobs import sweeps

    storage = sweeps.optuna_storage()
    for summary in optuna.get_all_study_summaries(storage=storage, include_best_trial=False):
        optuna.delete_study(study_name=summary.study_name, storage=storage)


# ---------------------------------------------------------------------------------------------
# Domain objects
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def user(django_user_model):
    return django_user_model.objects.create_user(username="alice", password="pw-alice-123", is_staff=True)


@pytest.fixture
def other_user(django_user_model):
    return django_user_model.objects.create_user(username="bob", password="pw-bob-123", is_staff=True)


@pytest.fixture
def digits_dataset(user):
    from jobs import services

    return services.dataset_create(owner=user, name="digits", format="builtin", builtin_name="digits")


@pytest.fixture
def cnn_model(user):
    from jobs import services

    return services.model_spec_create(owner=user, name="digits-cnn", architecture="cnn",
                                      params={"channels": 16, "hidden_size": 64})


@pytest.fixture
def code_store(settings, tmp_path) -> Path:
    """An empty content-addressed code store (TRAINBOARD_CODE_STORE) and one allowed code root
    (TRAINBOARD_CODE_ROOTS, ``tmp_path/roots``) for the test; returns the store's path."""
    store = tmp_path / "store"
    settings.TRAINBOARD_CODE_STORE = store
    settings.TRAINBOARD_CODE_ROOTS = [str(tmp_path / "roots")]
    (tmp_path / "roots").mkdir(exist_ok=True)
    return store


@pytest.fixture
def run_root(request, tmp_path) -> Path:
    """Where the gpubox backend of this test keeps its run directories: ``tmp_path/runs``, or, in a
    test that borrows the shared worker (``celery_worker_process``), that worker's run root (empty
    when the test starts; its runs are moved to ``tmp_path/runs`` at the end)."""
    if "celery_worker_process" in request.fixturenames:
        return request.getfixturevalue("shared_celery_worker").run_root
    path = tmp_path / "runs"
    path.mkdir()
    return path


@pytest.fixture
def local_backend(user, run_root, settings):
    """A gpubox backend named "local" ($3.60 per node-hour) on a box whose host settings (this
    installation's: run root ``run_root``, 2 processes per node) come from Django settings, as a
    real box's do."""
    from jobs import services

    settings.TRAINBOARD_RUN_ROOT = run_root
    settings.TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE = 2
    return services.backend_create(
        owner=user, name="local", kind="gpubox", config={"hourly_rate_usd": 3.6, "grace_period_s": 3.0},
    )


# ---------------------------------------------------------------------------------------------
# Provider stand-ins
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """Every AWS call of the test goes to the SageMaker stand-in (moto in-process, with jobs in
    progress and StopTrainingJob: tests/cloud_adapters/sagemaker/standin.py); boto3's default chain
    finds fake credentials and nothing of this machine's. No bucket exists yet. Yields the stand-in
    module (``create_bucket``, ``set_status``, ``status``, ...)."""
    from adapter_standins import standin

    sagemaker_standin = standin("sagemaker")
    sagemaker_standin.fake_aws_env(monkeypatch, tmp_path)
    with sagemaker_standin.aws(monkeypatch):
        yield sagemaker_standin


@pytest.fixture
def trainer_standin(tmp_path):
    """The trainer stand-in (tests/standins/trainer.py): a torch-free torchrun + trainer that steps
    only as the test allows. Name ``trainer_standin.python`` as a GPU box's interpreter: the
    adapter's config ``"python"``, a staff user's backend row's (``services.backend_update(backend=b,
    config={**b.config, "python": ...})``: any worker then uses it), ``settings.TRAINBOARD_GPUBOX_PYTHON``
    (this process) or a worker's ``extra_env={"TRAINBOARD_GPUBOX_PYTHON": ...}``. ``hold(steps=N)``,
    ``wait_at(N)``, ``release()``, ``fail(...)``. The gate starts open (jobs run to their end at once)."""
    from standins.trainer import TrainerStandin

    return TrainerStandin.create(tmp_path / "trainer-standin")


# ---------------------------------------------------------------------------------------------
# Browser
# ---------------------------------------------------------------------------------------------


CHROMIUM = "/usr/bin/chromium"  # Debian's package: the tests never download a browser
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]


class BrowserRun:
    """Playwright and one Chromium, kept open across consecutive browser tests (those that use
    ``browser_page``) and closed before any other test runs.

    Why not for the whole session: while Playwright's sync API is open, its asyncio event loop counts
    as running in this thread, so ``asyncio.run`` fails and Django refuses ORM calls
    (SynchronousOnlyOperation) unless ``DJANGO_ALLOW_ASYNC_UNSAFE`` is set — which this sets only
    while the browser is open. Each test still gets a browser context of its own (cookies, storage,
    cache), closed at its end."""

    def __init__(self) -> None:
        self.playwright = None
        self.browser = None
        self._saved_env: str | None = None

    def get(self):
        """The open Chromium (a Playwright ``Browser``), launched first if none is, or if it died."""
        if self.browser is not None and self.browser.is_connected():
            return self.browser
        self.close()
        from playwright.sync_api import sync_playwright

        if not os.path.exists(CHROMIUM):
            pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium package (apt-get install chromium)")
        # The live server runs in this process; Playwright's sync API needs Django's async-safety check off.
        self._saved_env = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
        self.playwright = sync_playwright().start()
        self.browser = self.playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        count_start("chromium")
        return self.browser

    @property
    def is_open(self) -> bool:
        return self.playwright is not None

    def close(self) -> None:
        """Close Chromium and Playwright (its event loop), and set the async-safety check back."""
        from django.db import connections

        if self.playwright is None:
            return
        try:
            if self.browser is not None and self.browser.is_connected():
                self.browser.close()
        finally:
            self.browser = None
            self.playwright.stop()
            self.playwright = None
            connections.close_all()  # see browser_page
            if self._saved_env is None:
                os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
            else:
                os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = self._saved_env


_BROWSER = BrowserRun()
_NEXT_ITEM: list = [None]  # the item pytest runs after the current one (pytest_runtest_protocol's nextitem)


def _uses_browser(item) -> bool:
    return item is not None and "browser_page" in getattr(item, "fixturenames", ())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    _NEXT_ITEM[0] = nextitem


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """No test but a browser test runs with Playwright open (see :class:`BrowserRun`)."""
    if _BROWSER.is_open and not _uses_browser(item):
        _BROWSER.close()


def pytest_runtest_teardown(item, nextitem):
    """A shared Ray head (tests/raykit.py) is stopped as soon as the next test does not take it."""
    raykit = sys.modules.get("raykit")
    if raykit is not None and (nextitem is None or "head" not in nextitem.fixturenames):
        raykit.stop_shared_head()


def pytest_sessionfinish(session):
    _BROWSER.close()
    raykit = sys.modules.get("raykit")
    if raykit is not None:
        raykit.stop_shared_head()


@pytest.fixture
def browser_page():
    """A fresh page (1280 × 900) in a fresh browser context of Debian's Chromium driven by Playwright,
    closed after the test; the Chromium is shared by consecutive browser tests (:class:`BrowserRun`)."""
    from django.db import connections

    context = _BROWSER.get().new_context(viewport={"width": 1280, "height": 900})
    try:
        yield context.new_page()
    finally:
        try:
            context.close()
        finally:
            # Django keeps one connection per async context, and Playwright's sync API runs the
            # test in a context of its own: close the connections the test opened in it, or the
            # test database cannot be dropped at the end of the run.
            connections.close_all()
            if not _uses_browser(_NEXT_ITEM[0]):
                _BROWSER.close()  # before the module's and session's fixtures are torn down


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def wait_until():
    """``wait_until(predicate, timeout=..., what=...)``: poll with a deadline, fail on timeout."""
    return wait_for


@pytest.fixture
def live_processes():
    """``live_processes(text)``: pids of live processes whose cmdline or environment holds ``text``."""
    return live_processes_mentioning


@contextlib.contextmanager
def running_celery_worker(directory: Path, run_root: Path, extra_env: dict[str, str] | None = None,
                          queues: str | None = None, beat: bool = True) -> Iterator[WorkerProcess]:
    """A real Celery worker with embedded beat on the test database and a flushed Redis database,
    running gpubox jobs under ``run_root``, its log and beat schedule in ``directory``, with
    ``extra_env`` over its environment (:func:`workerkit.worker_environment`), consuming ``queues``
    (comma-separated; default :data:`workerkit.DEFAULT_QUEUES`), with embedded beat unless ``beat`` is
    False (a second worker beside a first: it also leaves the broker unflushed). On exit it is
    stopped, with every process of its runs, and its database sessions are waited out. Needs
    database access (a ``transactional_db`` test, or ``django_db_blocker.unblock()``)."""
    import redis
    from django.db import connection

    from webapp.celery import app

    broker_url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/14"
    if beat:  # the first worker of a test: a clean broker (a second one keeps the first's queues)
        redis.Redis.from_url(broker_url).flushdb()
    saved_broker = (app.conf.broker_url, dict(app.conf.broker_transport_options or {}))
    use_broker(broker_url)  # this process publishes where the worker listens

    var_dir = directory / "worker-var"
    var_dir.mkdir()
    env = worker_environment(settings_dict=connection.settings_dict, broker_url=broker_url, run_root=run_root,
                             var_dir=var_dir, repo_root=REPO_ROOT, extra=extra_env)
    proc, log_path = start_worker(directory, env, REPO_ROOT, queues or DEFAULT_QUEUES, beat=beat)
    worker = WorkerProcess(proc, log_path, broker_url, run_root, {k: env[k] for k in ALONGSIDE_KEYS}, full_env=env,
                           cwd=REPO_ROOT)
    try:
        worker.wait_for(lambda: " ready." in worker.log(), timeout=90, what="the Celery worker to be ready")
        yield worker
    finally:
        worker.stop()
        for pid in live_processes_mentioning(str(run_root)):  # supervisors and ranks of this test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_for_sessions_to_close(connection)
        use_broker(*saved_broker)


@pytest.fixture(scope="session")
def shared_celery_worker(django_db_setup, django_db_blocker, tmp_path_factory):
    """This pytest process's shared worker (:class:`sharedworker.SharedWorker`), started by its
    first :meth:`~sharedworker.SharedWorker.lend`; stopped, with its runs, at the end of the session
    (before the test database is dropped)."""
    shared = SharedWorker(tmp_path_factory.mktemp("shared-worker"), REPO_ROOT)
    try:
        yield shared
    finally:
        shared.close(django_db_blocker)


@pytest.fixture
def celery_worker_process(transactional_db, shared_celery_worker, tmp_path, settings):
    """A real Celery worker with embedded beat on this test's database, the shared one of this pytest
    process (tests/sharedworker.py): consuming the default queues on an empty broker of its own, its
    run root the test's ``run_root``, its ``log()`` from the test's start. At the end the worker is
    paused, every process of the test's runs killed by PID, and the runs moved to ``tmp_path/runs``."""
    settings.TRAINBOARD_RUN_ROOT = shared_celery_worker.run_root
    settings.TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE = 2  # the test box's host limit, as in local_backend
    worker = shared_celery_worker.lend()
    try:
        yield worker
    finally:
        shared_celery_worker.take_back(tmp_path / "runs")


@pytest.fixture(scope="session")
def celery_worker_factory():
    """:func:`running_celery_worker`, for a worker shared by the tests of a module (a module-scoped
    fixture enters it under ``django_db_blocker.unblock()``; its tests are ``transaction=True``)."""
    return running_celery_worker


@pytest.fixture
def allow_job_images(settings):
    """This installation's GPU boxes run any image a job names (``TRAINBOARD_GPUBOX_ALLOWED_IMAGES`` =
    ``*``; blank, the default, allows none): for tests of how a job's image is carried, not whether
    it may run (tests/cloud_adapters/gpubox/test_gpubox_user_code.py and test_job_code.py test that)."""
    settings.TRAINBOARD_GPUBOX_ALLOWED_IMAGES = "*"


# ---------------------------------------------------------------------------------------------
# Kubernetes
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kube_standin(tmp_path_factory):
    """A stand-in Kubernetes API server with Kubeflow Trainer (tests/k8s_standin.py), shared by the
    tests of a module: namespace ``default`` and its kubeconfig (``.kubeconfig_path``, context
    ``standin``). It and every pod process it started are stopped by PID at the end."""
    from k8s_standin import kube_standin_server

    with kube_standin_server(tmp_path_factory.mktemp("k8s-standin")) as server:
        yield server


# ---------------------------------------------------------------------------------------------
# Slurm
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def slurm_cluster_shared():
    """The test Slurm cluster (tests/slurmkit.py), started once per pytest process and stopped by PID
    at its end. Tests do not take it directly: ``slurm_cluster_module`` gives each module a clean view."""
    import slurmkit

    with slurmkit.slurm_cluster() as running:
        yield running


@pytest.fixture(scope="module")
def slurm_cluster_module(request):
    """The shared Slurm cluster for one test module: :func:`slurmkit.reset` before (no job, both nodes
    idle) and after it (its jobs cancelled, a node it set down resumed: a failure there is the module's),
    and a :class:`slurmkit.SlurmCluster` whose ``work_dir`` is the module's own directory.

    A module that takes it must carry ``slurmkit.SLURM_GROUP`` (``pytest.mark.xdist_group("slurm")``):
    under ``-n`` every such module then runs on one worker, which starts the cluster once. A module
    without the mark fails here (it would start a second cluster on another worker). A test must not
    stop or restart a daemon of this cluster; one that needs that starts its own
    (``slurmkit.slurm_cluster()``)."""
    import slurmkit

    groups = [m.args[0] if m.args else m.kwargs.get("name") for m in request.node.iter_markers("xdist_group")]
    if "slurm" not in groups:
        pytest.fail(f"{request.node.nodeid} uses the shared Slurm cluster without slurmkit.SLURM_GROUP "
                    f"(pytestmark): under -n it would start another cluster on another worker", pytrace=False)
    shared = request.getfixturevalue("slurm_cluster_shared")  # started only past that check
    slurmkit.reset(shared)
    yield slurmkit.module_view(shared, request.module.__name__.rsplit(".", 1)[-1])
    slurmkit.reset(shared)


def pytest_terminal_summary(terminalreporter):
    import sys

    slurmkit = sys.modules.get("slurmkit")
    if slurmkit is not None and slurmkit.STARTS:
        terminalreporter.write_line(f"test Slurm cluster: started {slurmkit.STARTS} time(s) in this process")
    raykit = sys.modules.get("raykit")
    if raykit is not None and raykit.STARTS:
        terminalreporter.write_line(f"test Ray head: started {raykit.STARTS} time(s) in this process")
