"""Trainboard settings, read from the environment (django-environ).

Embedded default: SQLite under ``var/`` and a filesystem Celery broker, so ``make demo`` needs no
server. ``DATABASE_URL`` (e.g. ``postgres://postgres@127.0.0.1:5432/trainboard``) and ``REDIS_URL``
(e.g. ``redis://127.0.0.1:6379/0``) switch to PostgreSQL and Redis.
"""

import os
import re
import shlex
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from webapp import private_files

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
VAR_DIR = Path(env.str("TRAINBOARD_VAR_DIR", default=str(BASE_DIR / "var"))).resolve()
# Entered, not listed, by a GPU box's jobs (their run root is var/runs); the rest is the dashboard's alone.
private_files.traversable_dir(VAR_DIR)

DEBUG = env.bool("DJANGO_DEBUG", default=False)
SECRET_KEY = env.str("DJANGO_SECRET_KEY", default="")
if not SECRET_KEY:
    # The embedded default keeps a generated key beside its database, never in the repository.
    import secrets

    SECRET_KEY = private_files.private_file(VAR_DIR / "secret_key", lambda: secrets.token_urlsafe(50)).read_text().strip()
ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["127.0.0.1", "localhost", "testserver"])
CSRF_TRUSTED_ORIGINS = env.list("DJANGO_CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI assets served locally (no CDN)
    "django_filters",
    "django_htmx",
    "django_celery_beat",
    "csp",
    "axes",
    "jobs",
    "webapp",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "csp.middleware.CSPMiddleware",
    "axes.middleware.AxesMiddleware",  # last: turns a lockout into the lockout response
]

ROOT_URLCONF = "webapp.urls"
WSGI_APPLICATION = "webapp.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {"default": env.db_url("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'trainboard.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    if DATABASES["default"]["NAME"] not in ("", ":memory:") and "mode=memory" not in str(DATABASES["default"]["NAME"]):
        private_files.private_file(Path(DATABASES["default"]["NAME"]))  # every stored credential, encrypted
    # Web, worker and beat share one file: WAL lets readers run beside the writer, IMMEDIATE
    # transactions take the write lock up front instead of failing half-way with "database is locked".
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
else:
    # Keep connections between requests/tasks, but check each one before reuse: after a database
    # restart (or a terminated session) the next request or task reconnects instead of failing.
    DATABASES["default"]["CONN_MAX_AGE"] = env.int("DATABASE_CONN_MAX_AGE", default=60)
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# Login rate limiting (django-axes): after TRAINBOARD_LOGIN_FAILURE_LIMIT failed attempts for one
# username from one IP address, that pair is refused for TRAINBOARD_LOGIN_COOLOFF_MIN minutes (the
# browser login and POST /api/auth/token/ alike); a good login resets the count.
AUTHENTICATION_BACKENDS = [
    "webapp.auth.RateLimitedLoginBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env.int("TRAINBOARD_LOGIN_FAILURE_LIMIT", default=5)
AXES_COOLOFF_TIME = env.float("TRAINBOARD_LOGIN_COOLOFF_MIN", default=15.0) / 60.0  # hours
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "webapp.auth.locked_out"
AXES_VERBOSE = False

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "job-list"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "staticfiles"
STATIC_ROOT.mkdir(exist_ok=True)  # whitenoise serves from the finders too; it warns when this is missing
STATICFILES_DIRS = [d for d in [BASE_DIR / "node_modules" / "chart.js" / "dist"] if d.exists()]
# The charts' plugins from npm (package.json), each under static/vendor/<package>/: zoom and pan
# (chartjs-plugin-zoom, which pans through hammerjs) and the date adapter of the wall-time axis.
STATICFILES_DIRS += [(f"vendor/{package}", BASE_DIR / "node_modules" / package / sub) for package, sub in
                     (("chartjs-plugin-zoom", "dist"), ("hammerjs", ""), ("chartjs-adapter-date-fns", "dist"))
                     if (BASE_DIR / "node_modules" / package / sub).exists()]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True  # serve straight from the apps' static folders, no collectstatic needed

# --- Request size limits --------------------------------------------------------------------
# Django answers 400 past these (RequestDataTooBig / TooManyFieldsSent); nothing reads a larger body.
DATA_UPLOAD_MAX_MEMORY_SIZE = env.int("TRAINBOARD_MAX_REQUEST_BYTES", default=2_621_440)  # bytes (2.5 MiB)
FILE_UPLOAD_MAX_MEMORY_SIZE = 2_621_440  # bytes held in memory before an upload spills to a temp file
# A multipart body's files are not counted by DATA_UPLOAD_MAX_MEMORY_SIZE: the model form and
# POST/PUT /api/models/ refuse a body past TRAINBOARD_CODE_MAX_BYTES (+1 MiB for the other fields) by
# its Content-Length before reading it, and jobs.code_archives counts an archive's bytes as it reads.
DATA_UPLOAD_MAX_NUMBER_FIELDS = 1000
DATA_UPLOAD_MAX_NUMBER_FILES = 10

# --- Content security policy (django-csp) -------------------------------------------------------
# Every script is a file served from this origin (Chart.js, htmx, the page scripts, Swagger UI's split
# view); data for scripts travels in json_script blocks, which are not executed. Inline styles stay
# allowed: htmx injects its indicator style and Swagger UI's page carries a <style> block.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'", "'unsafe-inline'"],
        "img-src": ["'self'", "data:"],
        "font-src": ["'self'"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    },
}

# --- Production (DJANGO_ENV=production) -----------------------------------------------------------
# HTTPS only: redirect, HSTS, secure cookies, strict referrer policy. `manage.py check --deploy` is
# clean with these (tests/security/test_production.py).
PRODUCTION = env.str("DJANGO_ENV", default="development").lower() == "production"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
SESSION_COOKIE_HTTPONLY = True
if PRODUCTION:
    if DEBUG:
        raise ImproperlyConfigured("DJANGO_DEBUG must be false when DJANGO_ENV=production")
    if not env.str("DJANGO_SECRET_KEY", default=""):
        raise ImproperlyConfigured("DJANGO_SECRET_KEY must be set when DJANGO_ENV=production "
                                   "(50+ random characters, e.g. python -c 'import secrets; print(secrets.token_urlsafe(50))')")
    SECURE_SSL_REDIRECT = env.bool("DJANGO_SECURE_SSL_REDIRECT", default=True)
    SECURE_REDIRECT_EXEMPT = [r"^healthz$"]  # the containers' health checks ask over plain HTTP on loopback
    SECURE_HSTS_SECONDS = env.int("DJANGO_SECURE_HSTS_SECONDS", default=31_536_000)  # one year
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS", default=True)
    SECURE_HSTS_PRELOAD = env.bool("DJANGO_SECURE_HSTS_PRELOAD", default=True)
    # Behind a TLS-terminating proxy that sets X-Forwarded-Proto (e.g. nginx): DJANGO_SECURE_PROXY_SSL_HEADER=true.
    if env.bool("DJANGO_SECURE_PROXY_SSL_HEADER", default=False):
        SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True

# --- REST API --------------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # Token first: its WWW-Authenticate header turns an anonymous request into a 401, not a 403.
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # JSON bodies through jobs.validation.loads: deep nesting is a 400, not a RecursionError.
    "DEFAULT_PARSER_CLASSES": [
        "webapp.api.parsers.BoundedJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    # Every list: limit at most 500 (a larger one, even past PostgreSQL's bigint, is cut to it), a capped count.
    "DEFAULT_PAGINATION_CLASS": "webapp.api.pagination.CappedLimitOffsetPagination",
    # A 404 of one object names it ("Training job 999 not found (or not yours)."), not Django's class name.
    "EXCEPTION_HANDLER": "webapp.api.exceptions.exception_handler",
    "PAGE_SIZE": 25,  # rows per page without ?limit= (the HTML job list's page); ?limit= up to 500
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Trainboard API",
    "DESCRIPTION": "Datasets, models, compute backends and distributed training jobs.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI from drf-spectacular-sidecar's static files, never from a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAuthenticated"],
    # The choices are the enum's; a "* `ddp` - ddp" list appended to each description said them again
    # (and the client's --help printed it).
    "ENUM_GENERATE_CHOICE_DESCRIPTION": False,
    # A model's kind and a backend's kind are both "kind": each enum gets its own name.
    "ENUM_NAME_OVERRIDES": {
        "ModelKindEnum": "jobs.models.ModelSpec.Kind",
        "JobStateEnum": "jobs.models.JobStateChoices",
        "SweepStateEnum": "jobs.models.Sweep.State",
    },
}

# --- Celery ----------------------------------------------------------------------------------
REDIS_URL = env.str("REDIS_URL", default="")
if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
else:
    _broker_dir = private_files.private_dir(VAR_DIR / "broker")  # messages carry the tasks' arguments
    for _sub in ("queue", "staging", "processed", "control"):
        (_broker_dir / _sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_URL = "filesystem://"
    CELERY_BROKER_TRANSPORT = "webapp.broker:Transport"  # kombu's, with atomic message files
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir / "queue"),
        "data_folder_out": str(_broker_dir / "queue"),
        "data_folder_processed": str(_broker_dir / "processed"),
        "staging_folder": str(_broker_dir / "staging"),
        "control_folder": str(_broker_dir / "control"),  # default is ./control in the working directory
    }
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TIMEZONE = "UTC"
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
TRAINBOARD_SYNC_INTERVAL_S = env.float("TRAINBOARD_SYNC_INTERVAL_S", default=2.0)
if TRAINBOARD_SYNC_INTERVAL_S <= 0:
    raise ImproperlyConfigured("TRAINBOARD_SYNC_INTERVAL_S must be a positive number of seconds")
# A worker reconnects to a restarted broker by itself (Celery 6 changes the start-up default).
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True


def _positive_seconds(name: str, default: float) -> float:
    value = env.float(name, default=default)
    if not value > 0:
        raise ImproperlyConfigured(f"{name} must be a positive number of seconds (got {value!r})")
    return value


# Recovery sweep (jobs.recovery): re-sends lost submissions, resumes submissions whose worker died,
# flags (and by policy cancels) jobs past their state's deadline. Seconds.
TRAINBOARD_RECOVERY_INTERVAL_S = _positive_seconds("TRAINBOARD_RECOVERY_INTERVAL_S", 30.0)
# A QUEUED job no worker has picked up for this long gets its submit message sent again.
TRAINBOARD_RECOVERY_REQUEUE_AFTER_S = _positive_seconds("TRAINBOARD_RECOVERY_REQUEUE_AFTER_S", 60.0)
# The submit task's hard time limit: a SUBMITTING job without a provider handle for longer than
# this has lost its worker, and the sweep resumes it (the provider adopts the job by name).
TRAINBOARD_SUBMIT_TIME_LIMIT_S = _positive_seconds("TRAINBOARD_SUBMIT_TIME_LIMIT_S", 150.0)
# How many times the sweep resumes one job's submission before it marks the job FAILED.
TRAINBOARD_RECOVERY_MAX_RESUMES = env.int("TRAINBOARD_RECOVERY_MAX_RESUMES", default=3)
# Default deadlines per non-terminal state, seconds (a backend's state_deadlines override them);
# RUNNING defaults to the job's max runtime plus TRAINBOARD_RUNNING_DEADLINE_MARGIN_S.
TRAINBOARD_STATE_DEADLINES_S = {"QUEUED": 600, "SUBMITTING": 300, "PENDING": 3600, "STOPPING": 900}
TRAINBOARD_RUNNING_DEADLINE_MARGIN_S = _positive_seconds("TRAINBOARD_RUNNING_DEADLINE_MARGIN_S", 600.0)

# Metric retention (jobs.metric_retention; docs/operations.md): a job's step-level metric points are
# removed this many days after it ended, its buckets, per-epoch validation points and final values kept.
# 0 (the default) keeps every point.
TRAINBOARD_METRIC_POINTS_RETENTION_DAYS = env.float("TRAINBOARD_METRIC_POINTS_RETENTION_DAYS", default=0.0)
if not 0 <= TRAINBOARD_METRIC_POINTS_RETENTION_DAYS <= 36_500:
    raise ImproperlyConfigured("TRAINBOARD_METRIC_POINTS_RETENTION_DAYS must be 0 (keep every point) to 36,500 days "
                               f"(got {TRAINBOARD_METRIC_POINTS_RETENTION_DAYS!r})")

CELERY_BEAT_SCHEDULE = {
    "sync-jobs": {"task": "jobs.tasks.sync_jobs", "schedule": TRAINBOARD_SYNC_INTERVAL_S},
    "recovery-sweep": {"task": "jobs.tasks.recovery_sweep", "schedule": TRAINBOARD_RECOVERY_INTERVAL_S},
    "reconcile-orphans": {"task": "jobs.tasks.reconcile_orphans",
                          "schedule": _positive_seconds("TRAINBOARD_ORPHAN_INTERVAL_S", 300.0)},
    # Sweeps (jobs.sweeps): report intermediate values and prune, repair stale trials, fill free slots.
    "sweep-tick": {"task": "jobs.tasks.sweep_tick",
                   "schedule": _positive_seconds("TRAINBOARD_SWEEP_INTERVAL_S", TRAINBOARD_SYNC_INTERVAL_S)},
    # Webhook retries that are due, and deliveries a killed worker left (jobs.webhooks).
    "webhook-deliveries-due": {"task": "jobs.tasks.webhook_deliveries_due",
                               "schedule": _positive_seconds("TRAINBOARD_WEBHOOK_SWEEP_INTERVAL_S", 15.0)},
    # Metric retention: step-level points of jobs past TRAINBOARD_METRIC_POINTS_RETENTION_DAYS.
    "prune-metric-points": {"task": "jobs.tasks.prune_metric_points", "schedule": 3600.0},
}

# Webhook deliveries and notification emails wait on other people's servers (up to
# TRAINBOARD_WEBHOOK_TIMEOUT_S per attempt), so they have a queue of their own, served by a worker of
# its own (`celery -A webapp worker -Q notifications`; compose's `notifier`, the demo's): an endpoint
# that is down holds that worker's processes, never one that syncs or submits jobs.
TRAINBOARD_NOTIFICATIONS_QUEUE = "notifications"
CELERY_TASK_ROUTES = {name: {"queue": TRAINBOARD_NOTIFICATIONS_QUEUE} for name in (
    "jobs.tasks.deliver_webhook", "jobs.tasks.webhook_deliveries_due", "jobs.tasks.send_notification_email")}

# --- Notifications: email and webhooks (docs/notifications.md) ------------------------------------
# Django's mail settings; the default backend prints messages on the console (no SMTP server needed).
EMAIL_BACKEND = env.str("EMAIL_BACKEND", default="django.core.mail.backends.console.EmailBackend")
EMAIL_HOST = env.str("EMAIL_HOST", default="localhost")
EMAIL_PORT = env.int("EMAIL_PORT", default=25)
EMAIL_HOST_USER = env.str("EMAIL_HOST_USER", default="")
EMAIL_HOST_PASSWORD = env.str("EMAIL_HOST_PASSWORD", default="")
EMAIL_USE_TLS = env.bool("EMAIL_USE_TLS", default=False)
EMAIL_USE_SSL = env.bool("EMAIL_USE_SSL", default=False)
EMAIL_TIMEOUT = env.float("EMAIL_TIMEOUT", default=10.0)  # seconds
EMAIL_FILE_PATH = env.str("EMAIL_FILE_PATH", default=str(VAR_DIR / "mail"))  # the file-based backend's folder
if EMAIL_BACKEND == "django.core.mail.backends.filebased.EmailBackend":
    private_files.private_dir(Path(EMAIL_FILE_PATH))  # password-reset links: not a job's to read
DEFAULT_FROM_EMAIL = env.str("DEFAULT_FROM_EMAIL", default="trainboard@localhost")
# One webhook attempt's HTTP timeout, and the waits between attempts (5 attempts over 31 minutes).
TRAINBOARD_WEBHOOK_TIMEOUT_S = _positive_seconds("TRAINBOARD_WEBHOOK_TIMEOUT_S", 5.0)
TRAINBOARD_WEBHOOK_RETRY_DELAYS_S = [float(x) for x in env.list("TRAINBOARD_WEBHOOK_RETRY_DELAYS_S",
                                                                default=["60", "180", "540", "1080"])]
if any(not d > 0 for d in TRAINBOARD_WEBHOOK_RETRY_DELAYS_S):
    raise ImproperlyConfigured("TRAINBOARD_WEBHOOK_RETRY_DELAYS_S must be positive seconds, comma-separated")
# A host setting: networks webhooks may call although not public (CIDRs, comma-separated), e.g. an
# in-house chat server's 10.0.0.0/8. Blank: only public addresses (no loopback, private, link-local
# or cloud metadata address).
TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS = env.list("TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS", default=[])
try:
    import ipaddress as _ipaddress

    for _network in TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS:
        _ipaddress.ip_network(_network, strict=False)
except ValueError as _exc:
    raise ImproperlyConfigured(f"TRAINBOARD_WEBHOOK_ALLOWED_NETWORKS: {_exc}") from _exc
# /metrics (Prometheus): scraped with "Authorization: Bearer <token>"; blank = /metrics is off (404).
TRAINBOARD_METRICS_TOKEN = env.str("TRAINBOARD_METRICS_TOKEN", default="")

# --- Trainboard ------------------------------------------------------------------------------
# Keys for secrets stored encrypted at rest (jobs.fields.EncryptedJSONField): comma-separated Fernet
# keys, newest first. The embedded default keeps a generated key beside its database.
_encryption_keys = env.list("TRAINBOARD_ENCRYPTION_KEY", default=[])
if not _encryption_keys:
    from cryptography.fernet import Fernet

    _key_file = private_files.private_file(VAR_DIR / "encryption_key", lambda: Fernet.generate_key().decode())
    _encryption_keys = [_key_file.read_text().strip()]
TRAINBOARD_ENCRYPTION_KEYS = tuple(k.strip() for k in _encryption_keys if k.strip())

# Log reads per sync pass for jobs whose provider status did not change (least recently read first);
# jobs whose status changed are always read. Bounds a pass's provider calls at any number of active jobs.
TRAINBOARD_LOG_READS_PER_SYNC = env.int("TRAINBOARD_LOG_READS_PER_SYNC", default=100)
if TRAINBOARD_LOG_READS_PER_SYNC < 1:
    raise ImproperlyConfigured("TRAINBOARD_LOG_READS_PER_SYNC must be at least 1")
# Where users reach the web UI; links printed outside a request (CLI output) are absolute under it.
TRAINBOARD_BASE_URL = env.str("TRAINBOARD_BASE_URL", default="http://127.0.0.1:8000").rstrip("/")
# Local dataset paths must lie inside one of these directories (symlinks and ".." resolved; a relative
# path is relative to the first). Production: var/datasets unless TRAINBOARD_DATASET_ROOTS is set;
# development also allows the system temp directory (scratch data, the test suite's tmp_path).
_dataset_roots_default = [str(VAR_DIR / "datasets")]
if not PRODUCTION:
    import tempfile

    _dataset_roots_default.append(tempfile.gettempdir())
TRAINBOARD_DATASET_ROOTS = [str(Path(p).resolve()) for p in
                            env.list("TRAINBOARD_DATASET_ROOTS", default=_dataset_roots_default) if p]

# Users' code archives (docs/user-code.md "Code archives", jobs.code_archives): where the normalized
# archives are stored once by SHA-256, the directories a model's code may be registered from (symlinks
# and ".." resolved; defaults like the dataset roots), and the limits: bytes (the upload as sent and
# the archive's total uncompressed size, each) and regular files.
TRAINBOARD_CODE_STORE = private_files.private_dir(
    Path(env.str("TRAINBOARD_CODE_STORE", default=str(VAR_DIR / "code"))).resolve())  # users' code: not other jobs'
_code_roots_default = [str(VAR_DIR / "code-src")]
if not PRODUCTION:
    _code_roots_default.append(tempfile.gettempdir())
TRAINBOARD_CODE_ROOTS = [str(Path(p).resolve()) for p in
                         env.list("TRAINBOARD_CODE_ROOTS", default=_code_roots_default) if p]
TRAINBOARD_CODE_MAX_BYTES = env.int("TRAINBOARD_CODE_MAX_BYTES", default=50 * 1024 * 1024)  # bytes (50 MiB)
TRAINBOARD_CODE_MAX_FILES = env.int("TRAINBOARD_CODE_MAX_FILES", default=2000)
if TRAINBOARD_CODE_MAX_BYTES < 1 or TRAINBOARD_CODE_MAX_FILES < 1:
    raise ImproperlyConfigured("TRAINBOARD_CODE_MAX_BYTES and TRAINBOARD_CODE_MAX_FILES must be at least 1")

# The GPU box's host settings: where it keeps one run directory per job (job.json, log, metrics,
# exit code), the interpreter that runs torchrun, and the most ranks one job may start there. They
# are the box operator's decision (DESIGN.md §8): only these settings or a staff user's backend set
# them, never another user's backend (jobs.adapters.backend_adapter).
# Artifacts (docs/artifacts.md): how long a signed download URL lives, and the largest file whose
# sha256 the dashboard reads to compute (a larger one shows "not computed").
TRAINBOARD_ARTIFACT_URL_EXPIRES_S = env.int("TRAINBOARD_ARTIFACT_URL_EXPIRES_S", default=300)
if not 10 <= TRAINBOARD_ARTIFACT_URL_EXPIRES_S <= 7 * 24 * 3600:
    raise ImproperlyConfigured("TRAINBOARD_ARTIFACT_URL_EXPIRES_S must be 10 to 604800 seconds (S3's and "
                               f"Cloud Storage's longest signature is 7 days), got {TRAINBOARD_ARTIFACT_URL_EXPIRES_S}")
TRAINBOARD_ARTIFACT_HASH_MAX_BYTES = env.int("TRAINBOARD_ARTIFACT_HASH_MAX_BYTES", default=2 << 30)
TRAINBOARD_RUN_ROOT = Path(env.str("TRAINBOARD_RUN_ROOT", default=str(VAR_DIR / "runs"))).resolve()
TRAINBOARD_GPUBOX_PYTHON = env.str("TRAINBOARD_GPUBOX_PYTHON", default="")  # "" = the worker's own interpreter
if TRAINBOARD_GPUBOX_PYTHON and not os.path.isabs(TRAINBOARD_GPUBOX_PYTHON):
    raise ImproperlyConfigured(f"TRAINBOARD_GPUBOX_PYTHON must be an absolute interpreter path "
                               f"(got {TRAINBOARD_GPUBOX_PYTHON!r})")
# Blank = the box's visible GPUs, else its CPU cores (at most 1024).
_max_procs = env.str("TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE", default="").strip()
if _max_procs and not (_max_procs.isdigit() and 1 <= int(_max_procs) <= 1024):
    raise ImproperlyConfigured(f"TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE must be a whole number from 1 to 1024 "
                               f"(got {_max_procs!r})")
TRAINBOARD_GPUBOX_MAX_PROCS_PER_NODE = int(_max_procs) if _max_procs else None
# How user code runs on the GPU box, also the operator's alone: pip's options for a job's
# requirements.txt (e.g. "--no-index --find-links /wheels" on a box without internet), the OS user a
# job's processes run as (the worker must be root; "" = the worker's user), and the names of the
# worker's variables a job inherits besides the allowlist of docs/user-code.md.
TRAINBOARD_GPUBOX_PIP_ARGS = env.str("TRAINBOARD_GPUBOX_PIP_ARGS", default="")
try:
    shlex.split(TRAINBOARD_GPUBOX_PIP_ARGS)
except ValueError as _exc:
    raise ImproperlyConfigured(f"TRAINBOARD_GPUBOX_PIP_ARGS must split like a shell line ({_exc})") from None
TRAINBOARD_GPUBOX_RUN_AS = env.str("TRAINBOARD_GPUBOX_RUN_AS", default="").strip()
# Isolation (docs/gpu-boxes.md): the uids a root worker gives jobs, one each ("" = 20000-20999, "none" = off),
# and whether an installation of several users may still run jobs on a box that cannot isolate them.
TRAINBOARD_GPUBOX_JOB_UIDS = env.str("TRAINBOARD_GPUBOX_JOB_UIDS", default="").strip()
TRAINBOARD_GPUBOX_ALLOW_SHARED_UID = env.bool("TRAINBOARD_GPUBOX_ALLOW_SHARED_UID", default=False)
# The most memory one job may allocate on a box, its ranks together ("8GiB"; "" = 80% of the host's, "none").
TRAINBOARD_GPUBOX_JOB_MEMORY_LIMIT = env.str("TRAINBOARD_GPUBOX_JOB_MEMORY_LIMIT", default="").strip()
TRAINBOARD_GPUBOX_ENV_PASSTHROUGH = env.str("TRAINBOARD_GPUBOX_ENV_PASSTHROUGH", default="").strip()
# The container images a GPU-box job may name (exact references or prefixes ending in *, separated by
# commas or spaces); "" = none: every job runs on the host.
TRAINBOARD_GPUBOX_ALLOWED_IMAGES = env.str("TRAINBOARD_GPUBOX_ALLOWED_IMAGES", default="").strip()
# What the GPU box shares between its jobs (docs/gpu-boxes.md): the GPU indices it hands out ("0,1,2,3";
# "" = every GPU NVML finds), on a box without GPUs its process slots ("" = max processes per node), and
# the most jobs it runs at once ("" = no limit but its devices).
TRAINBOARD_GPUBOX_GPU_IDS = env.str("TRAINBOARD_GPUBOX_GPU_IDS", default="").strip()
if TRAINBOARD_GPUBOX_GPU_IDS and not re.fullmatch(r"\d{1,4}([\s,]+\d{1,4})*", TRAINBOARD_GPUBOX_GPU_IDS):
    raise ImproperlyConfigured(f"TRAINBOARD_GPUBOX_GPU_IDS must be GPU indices separated by commas, e.g. 0,1,2,3 "
                               f"(got {TRAINBOARD_GPUBOX_GPU_IDS!r})")


def _whole_or_none(name: str, ceiling: int) -> int | None:
    text = env.str(name, default="").strip()
    if text and not (text.isdigit() and 1 <= int(text) <= ceiling):
        raise ImproperlyConfigured(f"{name} must be a whole number from 1 to {ceiling} or blank (got {text!r})")
    return int(text) if text else None


TRAINBOARD_GPUBOX_SLOTS = _whole_or_none("TRAINBOARD_GPUBOX_SLOTS", 1024)
TRAINBOARD_GPUBOX_MAX_CONCURRENT_JOBS = _whole_or_none("TRAINBOARD_GPUBOX_MAX_CONCURRENT_JOBS", 10_000)
# A Slurm backend's host settings (cloud_adapters.slurm.backend.SETTINGS): how the worker reaches the
# cluster ("local": it runs on the login node and consumes slurm.<backend>; "ssh": to the login host
# with the backend's stored key), the slurm.conf every command gets as SLURM_CONF, the run directories'
# place on the shared filesystem, the nodes' interpreter and the images a job may run in. The
# operator's alone, as the GPU box's are; the adapter checks their form.
TRAINBOARD_SLURM_TRANSPORT = env.str("TRAINBOARD_SLURM_TRANSPORT", default="local").strip()
if TRAINBOARD_SLURM_TRANSPORT not in ("local", "ssh"):
    raise ImproperlyConfigured(f"TRAINBOARD_SLURM_TRANSPORT must be local or ssh (got {TRAINBOARD_SLURM_TRANSPORT!r})")
TRAINBOARD_SLURM_LOGIN_HOST = env.str("TRAINBOARD_SLURM_LOGIN_HOST", default="").strip()
_ssh_port = env.str("TRAINBOARD_SLURM_SSH_PORT", default="").strip()
if _ssh_port and not (_ssh_port.isdigit() and 1 <= int(_ssh_port) <= 65535):
    raise ImproperlyConfigured(f"TRAINBOARD_SLURM_SSH_PORT must be a TCP port (got {_ssh_port!r})")
TRAINBOARD_SLURM_SSH_PORT = int(_ssh_port) if _ssh_port else None
TRAINBOARD_SLURM_SSH_USER = env.str("TRAINBOARD_SLURM_SSH_USER", default="").strip()
TRAINBOARD_SLURM_SSH_HOST_KEY = env.str("TRAINBOARD_SLURM_SSH_HOST_KEY", default="").strip()
TRAINBOARD_SLURM_CONF = env.str("TRAINBOARD_SLURM_CONF", default="").strip()
TRAINBOARD_SLURM_WORK_DIR = env.str("TRAINBOARD_SLURM_WORK_DIR", default="").strip()
TRAINBOARD_SLURM_PYTHON = env.str("TRAINBOARD_SLURM_PYTHON", default="").strip()  # "" = python3 on the nodes
TRAINBOARD_SLURM_ALLOWED_IMAGES = env.str("TRAINBOARD_SLURM_ALLOWED_IMAGES", default="").strip()
# A Kubernetes backend's host settings (cloud_adapters.kubernetes.backend.SETTINGS): which cluster the
# worker calls and as whom (a kubeconfig file and context, or the worker pod's in-cluster service
# account), the service account the pods run as and the images a job may run in. The operator's
# alone; the adapter checks their form.
TRAINBOARD_K8S_KUBECONFIG = env.str("TRAINBOARD_K8S_KUBECONFIG", default="").strip()
if TRAINBOARD_K8S_KUBECONFIG and not os.path.isabs(TRAINBOARD_K8S_KUBECONFIG):
    raise ImproperlyConfigured(f"TRAINBOARD_K8S_KUBECONFIG must be an absolute path (got {TRAINBOARD_K8S_KUBECONFIG!r})")
TRAINBOARD_K8S_CONTEXT = env.str("TRAINBOARD_K8S_CONTEXT", default="").strip()  # "" = the kubeconfig's current-context
TRAINBOARD_K8S_IN_CLUSTER = env.bool("TRAINBOARD_K8S_IN_CLUSTER", default=False)
TRAINBOARD_K8S_SERVICE_ACCOUNT = env.str("TRAINBOARD_K8S_SERVICE_ACCOUNT", default="").strip()  # "" = the runtime's
TRAINBOARD_K8S_ALLOWED_IMAGES = env.str("TRAINBOARD_K8S_ALLOWED_IMAGES", default="").strip()
# A Ray backend's host settings (cloud_adapters.ray.backend.SETTINGS): which Ray cluster's dashboard the
# worker calls (http://<head>:8265) and the interpreter the jobs' entrypoint runs with there. The
# operator's alone; the adapter checks their form.
TRAINBOARD_RAY_ADDRESS = env.str("TRAINBOARD_RAY_ADDRESS", default="").strip()
TRAINBOARD_RAY_PYTHON = env.str("TRAINBOARD_RAY_PYTHON", default="").strip()  # "" = python on the nodes' PATH
# Whose cloud backends may call their provider with the worker's own identity (boto3's default chain,
# Application Default Credentials, DefaultAzureCredential) when they store no credentials of their
# own: "staff" (backends owned by active staff only) or "everyone". The default is "staff" because
# that identity is the operator's account: with "everyone", any user's backend naming any role or
# service account launches billable jobs there (jobs.adapters.may_use_worker_credentials).
TRAINBOARD_WORKER_CREDENTIALS = env.str("TRAINBOARD_WORKER_CREDENTIALS", default="staff").strip().lower()
if TRAINBOARD_WORKER_CREDENTIALS not in ("staff", "everyone"):
    raise ImproperlyConfigured(f"TRAINBOARD_WORKER_CREDENTIALS must be staff or everyone "
                               f"(got {TRAINBOARD_WORKER_CREDENTIALS!r})")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("TRAINBOARD_LOG_LEVEL", default="INFO")},
    # kombu warns "No hostname was supplied" for the filesystem broker, which has no host by design.
    "loggers": {"kombu.connection": {"level": "ERROR" if not REDIS_URL else "WARNING"}},
}
