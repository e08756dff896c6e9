"""The suite under pytest-xdist: what each worker process gets for itself, and what runs where.

Loaded in every pytest process, serial or not, before pytest-django reads Django's settings
(``-p xdist_workers`` in pyproject.toml's ``addopts``; ``pythonpath = ["tests"]`` makes it importable
that early). ``make test`` runs ``pytest -n $(TEST_WORKERS) --dist loadgroup``; with
``TEST_WORKERS=0`` it runs serially, and then this module changes nothing.

- **Database**: pytest-django already gives worker ``gwN`` the test database ``test_<name>_gwN``
  (``<name>``: ``DATABASE_URL``'s), and the Celery workers the tests start are handed that one
  (tests/workerkit.py ``database_url``).
- **Redis**: worker ``gwN`` uses database ``base + N`` of ``REDIS_URL``'s server, ``base`` being
  ``REDIS_URL``'s own (``redis://127.0.0.1:6379/12`` → 12, 13, …): ``REDIS_URL`` is rewritten in its
  environment before Django's settings are read. Everything the tests do with Redis goes through that
  variable — the settings' broker, the fixtures that ``FLUSHDB`` before they start a Celery worker, the
  Celery workers themselves (they inherit it) — so a flush empties its own worker's database only.
  Redis has databases 0–15: ``base + workers - 1`` past 15 is refused before any worker starts.
- **What runs where**: each test file is one unit of work that one worker runs whole (many keep a
  module-scoped stand-in, cluster or Celery worker that a split would start twice), and the files
  marked ``pytest.mark.xdist_group("name")`` make one unit together: ``slurm``, the files that use
  the test Slurm cluster (tests/slurmkit.py), which that worker then starts once, as a serial run does. Units start
  longest first, by the seconds each took in a measured run (tests/unit_seconds.json, written by
  ``scripts/unit-seconds.py`` from a ``--durations=0`` log), a unit it does not list by its tests'
  markers (``slow`` 60, ``e2e`` 20, ``browser`` 10, any other 1), so the longest units (the compose
  stack's) do not come at the end of the run.

  xdist's own ``loadgroup`` marks a group by appending ``@name`` to each node id, which pytest 9.2's
  structured node ids ignore (pytest-xdist 3.8 assigns ``item._nodeid``): here each worker writes the
  unit of every node id to ``$TRAINBOARD_XDIST_UNITS/<worker>.json`` when it has collected, and the
  controller's scheduler (:class:`UnitScheduling`, a ``LoadScopeScheduling`` keeping that order) reads
  them, since it schedules only once every worker has collected.
- Ports: every server the tests start (live server, stand-ins, sshd, slurmd, emulators, webhook
  receivers, the demo) listens on a free port the kernel picked; the one fixed port, the SageMaker
  container's 7777, is used by tests/cloud_adapters/sagemaker/test_sagemaker_toolkit.py alone, one
  test at a time. Files go to ``tmp_path`` or carry their test's name (test-artifacts/browser/); the
  SageMaker toolkit's virtualenv is built once under a file lock (its conftest).
- **GPU box jobs**: a GPU box's default interpreter (``TRAINBOARD_GPUBOX_PYTHON``) is the torch-free
  torchrun's wrapper (tests/standins/torchrun_lite.py) in every pytest process and the Celery workers
  they start: the jobs run the real launcher and trainer, their torchrun imports no torch. Torch's own
  torchrun on a GPU box runs where a test names the interpreter (``config={"python": sys.executable}``)
  and in the compose stack's image.
- **Shared uids**: serial or not, ``TRAINBOARD_GPUBOX_ALLOW_SHARED_UID`` defaults to true for the tests and
  the Celery workers they start (docs/gpu-boxes.md "Isolation"). The tests' GPU boxes keep their run
  roots under pytest's ``/tmp/pytest-of-<user>`` (0700), where no job uid can reach them, so they cannot
  isolate, and many tests have several users. The suite is those boxes' operator. The tests of
  isolation set it themselves (tests/cloud_adapters/gpubox/test_gpubox_isolation.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

os.environ.setdefault("TRAINBOARD_GPUBOX_ALLOW_SHARED_UID", "true")  # see "Shared uids" above

REDIS_DATABASES = 16
"""Redis's default ``databases``: numbered 0–15."""

WEIGHTS = {"slow": 60, "e2e": 20, "browser": 10}
"""A test's weight in its unit by its heaviest marker (a test with none of them: 1), in rough seconds:
for a unit tests/unit_seconds.json does not list."""

UNIT_SECONDS = Path(__file__).with_name("unit_seconds.json")
"""Each unit's seconds in a measured run (``scripts/unit-seconds.py`` writes it from a ``--durations=0``
log): the units start longest first by these, so the longest (the compose stack's) does not come last."""


def measured_unit_seconds() -> dict[str, float]:
    """tests/unit_seconds.json as ``{unit: seconds}``; ``{}`` when it is missing or unreadable."""
    try:
        data = json.loads(UNIT_SECONDS.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, (int, float))}

UNITS_ENV = "TRAINBOARD_XDIST_UNITS"
"""The directory (made by the controller, inherited by its workers) where the workers write their
node id → unit maps."""


def worker_index() -> int | None:
    """This process's xdist worker number (``gw3`` → 3), or None in the controller or a serial run."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else None


def redis_db(url: str) -> int:
    """The database number of a ``redis://host:port/db`` URL (no path: 0).

    Raises ValueError naming the URL when the path is not a number."""
    path = urlsplit(url).path.strip("/")
    if not path:
        return 0
    if not path.isdigit():
        raise ValueError(f"REDIS_URL {url!r}: the path must be a database number (redis://host:port/12)")
    return int(path)


def redis_url_for_worker(url: str, index: int) -> str:
    """``url`` with its database number raised by ``index`` (worker ``gw<index>``'s database)."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{redis_db(url) + index}"))


def check_redis_databases(url: str, workers: int) -> None:
    """Raise ``pytest.UsageError`` if ``workers`` databases from ``url``'s on do not fit in 0–15
    (ValueError if ``url`` has no database number)."""
    base = redis_db(url)
    last = base + workers - 1
    if last >= REDIS_DATABASES:
        raise pytest.UsageError(
            f"{workers} xdist workers use Redis databases {base}–{last} (REDIS_URL's {base} plus the worker "
            f"number), but Redis has databases 0–{REDIS_DATABASES - 1}: use a REDIS_URL whose database is "
            f"at most {REDIS_DATABASES - workers} (make test TEST_REDIS_URL=redis://127.0.0.1:6379/"
            f"{REDIS_DATABASES - workers}) or fewer workers (TEST_WORKERS={REDIS_DATABASES - base})")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args) -> None:
    """In worker ``gwN``: ``REDIS_URL`` becomes database base + N, before pytest-django's hook of the
    same name reads Django's settings (tryfirst: this one runs first). In every process, serial or not:
    ``TRAINBOARD_GPUBOX_PYTHON`` (a GPU box's default interpreter, read by the settings) is the torch-free
    torchrun's wrapper unless set (see "GPU box jobs" above)."""
    from standins import torchrun_lite

    os.environ.setdefault("TRAINBOARD_GPUBOX_PYTHON", torchrun_lite.wrapper())
    index = worker_index()
    url = os.environ.get("REDIS_URL", "")
    if index is None or not url:
        return
    try:
        check_redis_databases(url, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or index + 1))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    os.environ["REDIS_URL"] = redis_url_for_worker(url, index)


def _controller_of_parallel_run(config) -> bool:
    return worker_index() is None and bool(getattr(config.option, "numprocesses", None))


def pytest_configure(config) -> None:
    """In the controller of ``-n N``: refuse what would make the workers share a resource (another
    ``--dist`` than loadgroup, no ``REDIS_URL``, too few Redis databases), and make the directory the
    workers write their units to."""
    if not _controller_of_parallel_run(config):
        return
    dist = config.getoption("dist", "no")
    if dist != "loadgroup":
        raise pytest.UsageError(
            f"-n runs this suite only with --dist loadgroup (got --dist {dist}): each test file and each "
            "xdist_group must run whole on one worker (tests/xdist_workers.py). make test passes it.")
    url = os.environ.get("REDIS_URL", "")
    if not url:
        raise pytest.UsageError(
            "-n needs REDIS_URL (each worker gets its own database of that server: tests/xdist_workers.py); "
            "without it the workers would share the file-system broker under var/. make test sets it.")
    try:
        check_redis_databases(url, int(config.option.numprocesses))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    units = tempfile.mkdtemp(prefix="tb-xdist-units-")
    os.environ[UNITS_ENV] = units  # before the workers start (at session start): they inherit it
    config.add_cleanup(lambda: shutil.rmtree(units, ignore_errors=True))


def _unit(item) -> str:
    """The unit an item runs in: its xdist_group's name, else its file's path."""
    group = item.get_closest_marker("xdist_group")
    if group is None:
        return item.nodeid.split("::", 1)[0]
    return "group:" + str(group.args[0] if group.args else group.kwargs.get("name", "default"))


def _weight(item) -> int:
    return max((w for name, w in WEIGHTS.items() if item.get_closest_marker(name)), default=1)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """In a worker of a ``--dist loadgroup`` run: order the units longest first (by
    tests/unit_seconds.json, else by their tests' markers; within a unit the
    order stays pytest-django's: trylast, after its sort) and write each node id's unit for the
    controller's scheduler. Serial runs are left as they are."""
    units_dir = os.environ.get(UNITS_ENV)
    if worker_index() is None or not units_dir or not getattr(config.option, "loadgroup", False):
        return
    weights: dict[str, float] = {}
    first: dict[str, int] = {}
    for position, item in enumerate(items):
        unit = _unit(item)
        weights[unit] = weights.get(unit, 0) + _weight(item)
        first.setdefault(unit, position)
    weights.update({unit: seconds for unit, seconds in measured_unit_seconds().items() if unit in weights})
    items.sort(key=lambda item: (-weights[_unit(item)], first[_unit(item)]))
    target = Path(units_dir) / f"{os.environ['PYTEST_XDIST_WORKER']}.json"
    partial = target.with_suffix(".partial")
    partial.write_text(json.dumps({item.nodeid: _unit(item) for item in items}))
    partial.replace(target)  # whole or absent: the controller never reads half a map


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The controller's scheduler for ``--dist loadgroup`` (:class:`UnitScheduling`); optional: a
    run without xdist (``-p no:xdist``) has no such hook."""
    if config.getvalue("dist") != "loadgroup" or not os.environ.get(UNITS_ENV):
        return None
    return UnitScheduling(config, log, Path(os.environ[UNITS_ENV]))


try:
    from xdist.scheduler import LoadScopeScheduling as _LoadScopeScheduling
except ImportError:  # pytest-xdist not installed: serial runs need none of this
    _LoadScopeScheduling = object


class UnitScheduling(_LoadScopeScheduling):
    """xdist's ``LoadScopeScheduling`` whose scopes are this module's units (a node id's file, or its
    xdist_group), read from the maps the workers wrote, in the workers' collection order (heaviest
    first) rather than by test count. A node id in no map (none should be) is its own file's."""

    def __init__(self, config, log, units_dir: Path) -> None:
        super().__init__(config, log)
        self.units_dir = units_dir
        self._units: dict[str, str] | None = None
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        if self._units is None:  # first called in schedule(), once every worker has collected
            self._units = {}
            for path in sorted(self.units_dir.glob("*.json")):
                self._units.update(json.loads(path.read_text()))
        return self._units.get(nodeid) or nodeid.split("::", 1)[0]
