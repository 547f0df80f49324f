"""Holdfast settings, read from the environment (DESIGN §7).

Nothing here needs editing to run Holdfast: every knob is an environment variable with a
safe default, so a fresh clone runs on the embedded SQLite database under ``var/``.
"""

import math
import os
import secrets
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from jobs import durations

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("HOLDFAST_VAR_DIR", BASE_DIR / "var"))


TRUE_WORDS, FALSE_WORDS = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def env_bool(name: str, default: bool = False) -> bool:
    """A flag; anything but the usual words is a configuration error, so a typo in, say,
    HOLDFAST_BEHIND_TLS_PROXY never silently turns a protection off."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    word = value.strip().lower()
    if word not in TRUE_WORDS | FALSE_WORDS:
        raise ImproperlyConfigured(f"{name} must be 1/true/yes/on or 0/false/no/off, got {value!r}")
    return word in TRUE_WORDS


#: The most any ``…_SECONDS`` setting may be: a century, as every duration (jobs.durations).
#: A larger one is accepted by ``float`` and then fails at run time, in a timedelta or a
#: wait, long after the process started.
SECONDS_MAXIMUM = durations.MAXIMUM.total_seconds()


def env_number(
    name: str,
    default: float,
    *,
    positive: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
) -> float:
    """A number from the environment: finite, not negative (``positive``: above 0), at
    least ``minimum``, at most ``maximum`` (for a ``…_SECONDS`` setting, at most
    ``SECONDS_MAXIMUM`` when none is given); anything else is a one-line configuration
    error naming it."""
    if maximum is None and name.endswith("_SECONDS"):
        maximum = SECONDS_MAXIMUM
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        number = float(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ImproperlyConfigured(f"{name} must be a finite number, got {value!r}")
    if number < 0 or (positive and number == 0):
        above = "above 0" if positive else "0 or more"
        raise ImproperlyConfigured(f"{name} must be {above}, got {value!r}")
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum:g}, got {value!r}")
    if maximum is not None and number > maximum:
        raise ImproperlyConfigured(f"{name} must be at most {maximum:g}, got {value!r}")
    return number


def var_dir() -> Path:
    """``HOLDFAST_VAR_DIR``, created if missing; a path that cannot be a directory is a
    configuration error (one line, exit 2), not a traceback."""
    try:
        VAR_DIR.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ImproperlyConfigured(
            f"HOLDFAST_VAR_DIR {str(VAR_DIR)!r} is not a usable directory: {exc.strerror or exc}"
        ) from None
    return VAR_DIR


def env_duration(name: str, default: str) -> timedelta | None:
    """A duration above 0 (``14d``, ``12h``, ``30m``; jobs.durations), or None for ``off``."""
    value = os.environ.get(name, "").strip() or default
    if value.lower() == "off":
        return None
    try:
        kept = durations.parse(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}: {exc}, or off") from None
    if not kept:  # 0s would delete what had just finished
        raise ImproperlyConfigured(f"{name} must be longer than 0 ({durations.EXAMPLES}), or off")
    return kept


# Server-side prepared statements for the engine's hot path. Off behind a pooler that
# does not keep them per client (PgBouncer < 1.21 in transaction mode): then nothing
# Holdfast or Django runs keeps any session state (docs/operations.md, "PgBouncer").
HOLDFAST_PREPARED_STATEMENTS = env_bool("HOLDFAST_PREPARED_STATEMENTS", True)


def local_secret_key() -> str:
    """Return the development key kept in ``var/secret_key``, creating it once (mode 0600).

    There is deliberately no insecure built-in key: production sets DJANGO_SECRET_KEY.
    """
    path = VAR_DIR / "secret_key"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    except NotADirectoryError:
        pass  # var_dir() says why
    var_dir()
    key = secrets.token_urlsafe(50)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process won the race; use its key
        return path.read_text().strip()
    except OSError as exc:
        raise ImproperlyConfigured(
            f"cannot write the local secret key {str(path)!r} ({exc.strerror or exc}); "
            "set DJANGO_SECRET_KEY or make HOLDFAST_VAR_DIR writable"
        ) from None
    with os.fdopen(fd, "w") as handle:
        handle.write(key)
    return key


SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY") or local_secret_key()
DEBUG = env_bool("DJANGO_DEBUG")
ALLOWED_HOSTS = [
    host.strip()
    for host in os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,testserver").split(",")
    if host.strip()
]

# Behind a TLS-terminating proxy (docs/deployment.md): the proxy says the original scheme in
# X-Forwarded-Proto (and must overwrite any the client sent), so request.is_secure() and
# every absolute URL (the API's pagination links) keep https; plain-http requests are
# redirected and browsers are told HSTS. Each piece can be set on its own too.
BEHIND_TLS_PROXY = env_bool("HOLDFAST_BEHIND_TLS_PROXY")
if BEHIND_TLS_PROXY:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env_bool("DJANGO_SECURE_SSL_REDIRECT", BEHIND_TLS_PROXY)
SECURE_HSTS_SECONDS = int(
    env_number("DJANGO_SECURE_HSTS_SECONDS", 31_536_000 if BEHIND_TLS_PROXY else 0)
)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS", True)
SECURE_HSTS_PRELOAD = env_bool("DJANGO_SECURE_HSTS_PRELOAD", BEHIND_TLS_PROXY)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = BEHIND_TLS_PROXY or SECURE_SSL_REDIRECT
# Exempt paths from the https redirect (a regex each, comma-separated), e.g. a load
# balancer's plain-http probe of health/: "^internal/v1/health/$".
SECURE_REDIRECT_EXEMPT = [
    path.strip()
    for path in os.environ.get("DJANGO_SECURE_REDIRECT_EXEMPT", "").split(",")
    if path.strip()
]

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "rest_framework",
    "drf_spectacular",
    "jobs",
    "ingestion",
    "ops",
    "demo",
]

MIDDLEWARE = [
    # A HEAD answer without its body (Django's WSGI handler leaves it in).
    "ops.middleware.HeadWithoutBody",
    # Every answer JSON, DEBUG or not (ops.middleware).
    "ops.middleware.JsonErrors",
    "django.middleware.security.SecurityMiddleware",
    # CommonMiddleware, with no slash redirect for a POST (its body would be lost).
    "ops.middleware.SlashRedirects",
    # No cookies or forms here (bearer tokens only), but `check --deploy` rightly wants
    # both: a view added later is protected by default.
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # PostgreSQL: an API request's lock waits and statements end before gunicorn's timeout.
    "ops.middleware.BoundedDatabaseWaits",
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"
ASGI_APPLICATION = "config.asgi.application"


SQLITE_WAL_LIMIT = 16 * 1024 * 1024  # bytes; the WAL's usual size is about 4 MiB
SQLITE_INIT = (
    "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; "
    f"PRAGMA journal_size_limit={SQLITE_WAL_LIMIT};"
)


def application_name(argv: list[str] | None = None) -> str:
    """What ``pg_stat_activity.application_name`` shows for this process's connections:
    ``holdfast runworker``, ``holdfast runscheduler``, ... (``holdfast`` for the API),
    so operators can count each kind's connections; ``PGAPPNAME`` wins when set."""
    if name := os.environ.get("PGAPPNAME", "").strip():
        return name
    argv = sys.argv if argv is None else argv
    command = ""
    if len(argv) > 1 and Path(argv[0]).name in ("manage.py", "django-admin", "__main__.py"):
        command = argv[1] if argv[1].isidentifier() else ""
    return f"holdfast {command}".strip()[:63]  # PostgreSQL keeps 63 bytes


def database_config(variable: str = "DATABASE_URL") -> dict[str, Any]:
    url = os.environ.get(variable, "").strip()
    if not url:
        url = f"sqlite:///{var_dir() / 'holdfast.sqlite3'}"
    try:
        config: dict[str, Any] = dict(dj_database_url.parse(url))
    except Exception as exc:  # dj-database-url raises several types for bad URLs
        raise ImproperlyConfigured(f"{variable} is not a usable database URL: {exc}") from None
    engine = config["ENGINE"]
    if engine == "django.db.backends.sqlite3":
        # WAL lets readers run beside one writer; IMMEDIATE takes the write lock at BEGIN,
        # so two processes never deadlock upgrading read locks; the busy timeout makes
        # the loser wait instead of failing. A checkpoint cannot pass a reader's snapshot,
        # so the -wal file grows while a read stays open (a shell, a frozen process);
        # journal_size_limit cuts it back once the reader is gone (docs/operations.md).
        config["OPTIONS"] = {
            "transaction_mode": "IMMEDIATE",
            "timeout": 20,
            "init_command": SQLITE_INIT,
        }
        name = str(config["NAME"])
        config["TEST"] = {"NAME": f"{name.removesuffix('.sqlite3')}-test.sqlite3"}
    elif engine == "django.db.backends.postgresql":
        # Workers keep their connection across jobs; health checks replace dead ones.
        config["CONN_MAX_AGE"] = None
        config["CONN_HEALTH_CHECKS"] = True
        # A partitioned network must fail fast, so the worker can log and back off; TCP
        # keepalives find a dead peer on an idle connection within about a minute.
        keepalives = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10}
        config["OPTIONS"] = {
            "connect_timeout": 10,
            "application_name": application_name(),
            **keepalives,
            "keepalives_count": 3,
            **dict(config.get("OPTIONS") or {}),
        }
        if not HOLDFAST_PREPARED_STATEMENTS:
            # Behind a transaction-mode pooler: psycopg never prepares, and querysets'
            # .iterator() uses no server-side (WITH HOLD) cursors, which outlive a
            # transaction on the server connection.
            config["OPTIONS"]["prepare_threshold"] = None
            config["DISABLE_SERVER_SIDE_CURSORS"] = True
        test_url = os.environ.get("TEST_DATABASE_URL", "").strip()
        if test_url:
            config["TEST"] = {"NAME": dj_database_url.parse(test_url)["NAME"]}
    else:
        raise ImproperlyConfigured(
            f"{variable} must name PostgreSQL or SQLite, got engine {engine!r}"
        )
    return config


DATABASES = {"default": database_config()}
# The spool ingester's own connection, e.g. as HOLDFAST_INGESTER_DB_ROLE (docs/ingestion.md,
# "Least privilege"); unset, the ingester uses "default". Under test it is a mirror of the
# test database, connecting with its own user.
if os.environ.get("HOLDFAST_INGESTER_DATABASE_URL", "").strip():
    DATABASES["ingester"] = {
        **database_config("HOLDFAST_INGESTER_DATABASE_URL"),
        "TEST": {"MIRROR": "default"},
    }
# A worker's side connection (its lease keeper's: LISTEN for wake-ups and cancel requests,
# heartbeats, reclaim; docs/operations.md): when DATABASE_URL goes through a pooler, this
# names a direct connection to the same database for it. Unset: the side connection uses
# DATABASE_URL, and (prepared statements off, i.e. behind a pooler) workers poll.
HOLDFAST_LISTEN_DATABASE = (
    database_config("HOLDFAST_LISTEN_DATABASE_URL")
    if os.environ.get("HOLDFAST_LISTEN_DATABASE_URL", "").strip()
    else None
)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

USE_TZ = True
TIME_ZONE = "UTC"
LANGUAGE_CODE = "en-us"
USE_I18N = False

TEMPLATES: list[dict] = []

# Holdfast (DESIGN §7)
HOLDFAST_SHUTDOWN_GRACE_SECONDS = env_number("HOLDFAST_SHUTDOWN_GRACE_SECONDS", 25)
# At most a day, as jobs.options.MAX_LEASE_SECONDS (a longer lease would overflow the
# database's timestamps; heartbeats renew it, so long jobs need no long lease).
HOLDFAST_LEASE_SECONDS = env_number("HOLDFAST_LEASE_SECONDS", 60, positive=True, maximum=86_400)
HOLDFAST_POLL_SECONDS = env_number("HOLDFAST_POLL_SECONDS", 1, positive=True, maximum=3600)
HOLDFAST_RECLAIM_SECONDS = env_number("HOLDFAST_RECLAIM_SECONDS", 5, positive=True, maximum=3600)
# health/ fails (ingester_stuck) when a submission waits in incoming/ longer than this: a
# running ingester takes files within seconds. 0 turns the check off.
HOLDFAST_SPOOL_STUCK_SECONDS = env_number("HOLDFAST_SPOOL_STUCK_SECONDS", 300)
# A worker whose heartbeat stopped is shown as gone, and its row deleted after this long.
HOLDFAST_WORKER_RETENTION_SECONDS = env_number("HOLDFAST_WORKER_RETENTION_SECONDS", 7 * 86400)
HOLDFAST_SPOOL_DIR = Path(os.environ.get("HOLDFAST_SPOOL_DIR", VAR_DIR / "spool"))
# A malformed spool file is quarantined only once unchanged this long (docs/ingestion.md).
HOLDFAST_SPOOL_SETTLE_SECONDS = env_number("HOLDFAST_SPOOL_SETTLE_SECONDS", 2)
# The ingester stops (exit 1), and health/ fails, when a submission has waited in incoming/
# longer than this (docs/ingestion.md, "When a file is overdue"); 0 turns the check off.
HOLDFAST_SPOOL_GRACE_SECONDS = env_number("HOLDFAST_SPOOL_GRACE_SECONDS", 3600)
# A spool batch holds at most this many bytes of submissions (besides 500 files, 20,000 facts).
HOLDFAST_SPOOL_MAX_BATCH_BYTES = int(env_number("HOLDFAST_SPOOL_MAX_BATCH_BYTES", 32 * 1024 * 1024))
# PostgreSQL role granted exactly the spool ingester's privileges by a migration (unset: none).
HOLDFAST_INGESTER_DB_ROLE = os.environ.get("HOLDFAST_INGESTER_DB_ROLE", "").strip()
HOLDFAST_BLOB_DIR = Path(os.environ.get("HOLDFAST_BLOB_DIR", VAR_DIR / "blobs"))
HOLDFAST_LANES: dict[str, dict] = {"default": {}}
# Recurring jobs declared in settings (DESIGN §6); handlers may also declare schedule=.
HOLDFAST_SCHEDULES: dict[str, dict] = {}
# Built-in retention (jobs/retention.py, run by every scheduler): finished jobs, with their
# attempts and events, are deleted this long after they finished; "off" keeps them.
HOLDFAST_RETAIN_SUCCEEDED = env_duration("HOLDFAST_RETAIN_SUCCEEDED", "14d")
HOLDFAST_RETAIN_CANCELLED = env_duration("HOLDFAST_RETAIN_CANCELLED", "14d")
HOLDFAST_RETAIN_DEAD = env_duration("HOLDFAST_RETAIN_DEAD", "90d")
HOLDFAST_RETENTION_SECONDS = env_number("HOLDFAST_RETENTION_SECONDS", 600)  # between passes
# Resolved reconciliation issues are deleted this long after they were resolved ("off":
# kept); open ones never are.
HOLDFAST_RETAIN_RESOLVED_ISSUES = env_duration("HOLDFAST_RETAIN_RESOLVED_ISSUES", "180d")
# How often the built-in refresh job asks each registered refresher for due refreshes.
# The refresh schedule's interval: at least jobs.options.MIN_EVERY, as every schedule's.
HOLDFAST_REFRESH_SECONDS = env_number("HOLDFAST_REFRESH_SECONDS", 300, minimum=0.1)
# Polite HTTP for sources and artifacts (ingestion/http.py, docs/sources.md).
HOLDFAST_USER_AGENT = (
    os.environ.get("HOLDFAST_USER_AGENT", "").strip()
    or "Holdfast/0.1 (+https://github.com/holdfast; ingestion bot)"
)
HOLDFAST_FETCH_TIMEOUT_SECONDS = env_number("HOLDFAST_FETCH_TIMEOUT_SECONDS", 20)
# Total network time of one fetch, robots.txt and redirects included (per-read timeouts
# above still apply): a server trickling a byte a second is cut off here.
HOLDFAST_FETCH_DEADLINE_SECONDS = env_number("HOLDFAST_FETCH_DEADLINE_SECONDS", 120)
HOLDFAST_FETCH_MAX_BYTES = int(env_number("HOLDFAST_FETCH_MAX_BYTES", 10 * 1024 * 1024))
# Django's Tasks framework runs on Holdfast (docs/django-tasks.md): `@task` functions are
# enqueued as `django.task` jobs and run by `manage.py runworker`, with leases and retries.
# (Django's own default, the ImmediateBackend, would run them inline in the caller.)
TASKS = {"default": {"BACKEND": "jobs.tasks_backend.HoldfastBackend"}}

LOG_FORMAT = os.environ.get("LOG_FORMAT", "").strip().lower() or None
LOG_LEVEL = os.environ.get("LOG_LEVEL", "INFO").strip().upper() or "INFO"
if LOG_FORMAT not in (None, "json", "console"):
    raise ImproperlyConfigured(f"LOG_FORMAT must be 'json' or 'console', got {LOG_FORMAT!r}")
if LOG_LEVEL not in ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", "FATAL"):
    raise ImproperlyConfigured(
        f"LOG_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {LOG_LEVEL!r}"
    )
# Every standard-library record (django.request: a 500 with its traceback at error, 4xx at
# warning; django.security; py.warnings; libraries) goes to stderr through structlog's
# renderer (jobs.log.StdlibFormatter), whatever DEBUG is; structlog's own events go there too.
_TO_STDERR = {"handlers": ["stderr"], "level": LOG_LEVEL, "propagate": False}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"structlog": {"()": "jobs.log.StdlibFormatter"}},
    "filters": {"client_fault": {"()": "jobs.log.ClientFaultAsWarning"}},
    "handlers": {
        "stderr": {
            "class": "logging.StreamHandler",
            "stream": "ext://sys.stderr",
            "formatter": "structlog",
        },
        # django.security: a client's suspicious request is a warning, no traceback.
        "stderr_client_fault": {
            "class": "logging.StreamHandler",
            "stream": "ext://sys.stderr",
            "formatter": "structlog",
            "filters": ["client_fault"],
        },
    },
    "root": {"handlers": ["stderr"], "level": LOG_LEVEL},
    "loggers": {
        **{
            name: _TO_STDERR
            for name in ("django", "django.request", "django.server", "py.warnings")
        },
        "django.security": {**_TO_STDERR, "handlers": ["stderr_client_fault"]},
    },
}

# The internal API (ops/, docs/api.md): JSON only, bearer tokens only (no session or basic
# auth, so no CSRF exposure), errors as {"error", "code"} JSON (ops/exceptions.py).
REST_FRAMEWORK = {
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["ops.parsers.JSONParser"],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "ops.negotiation.ContentNegotiation",
    "DEFAULT_AUTHENTICATION_CLASSES": ["ops.authentication.BearerTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["ops.authentication.TokenScope"],
    "UNAUTHENTICATED_USER": None,
    "EXCEPTION_HANDLER": "ops.exceptions.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "URL_FORMAT_OVERRIDE": None,  # no ?format=: JSON is the only format
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Holdfast internal API",
    "DESCRIPTION": "Operator API of the Holdfast job system; see docs/api.md.",
    "VERSION": "1",
    "SCHEMA_PATH_PREFIX": "/internal/v1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "ops.schema.closed_request_bodies",
    ],
}

# Full-text search over artifacts (ingestion/search.py). The PostgreSQL text-search
# configuration used to index and to query; after changing it, re-index the artifacts.
HOLDFAST_SEARCH_CONFIG = os.environ.get("HOLDFAST_SEARCH_CONFIG", "").strip() or "english"
