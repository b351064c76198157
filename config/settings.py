"""Rigshare settings: one file, every value read from the environment.

Defaults make `make demo` work with no services (SQLite, local cache, eager Celery). `make test`
and production set DATABASE_URL (PostgreSQL) and REDIS_URL (cache and Celery broker).
"""

import ipaddress
from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured
from kombu import Queue

from config.env import env_bool, env_int, env_list, env_str

BASE_DIR = Path(__file__).resolve().parent.parent

# Production (RIGSHARE_PRODUCTION=1) takes real money only and refuses to start unless it is set
# up for it: see the end of this file and docs/operations.md.
RIGSHARE_PRODUCTION = env_bool("RIGSHARE_PRODUCTION", False)
DEBUG = env_bool("DEBUG", False)
_DEV_SECRET = "insecure-dev-only-secret-key-do-not-use-in-production"
SECRET_KEY = env_str("SECRET_KEY", _DEV_SECRET)
# The secrets SECRET_KEY replaced, comma-separated, while credentials made under them re-hash on
# use and sealed engine keys are sealed again (docs/operations.md, "Rotating SECRET_KEY").
SECRET_KEY_FALLBACKS = env_list("SECRET_KEY_FALLBACKS", [])
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    # The admin site, open only to staff who log in with a second factor (accounts/admin_site.py).
    "accounts.apps.AdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "axes",
    # Sign-up, email verification, log-in, password reset and change, email addresses,
    # two-factor (TOTP and recovery codes) and the list of one's sessions.
    "allauth",
    "allauth.account",
    "allauth.mfa",
    "allauth.usersessions",
    "accounts",
    "billing",
    "marketplace",
    "verification",
    "routing",
]

MIDDLEWARE = [
    # First: what a proxy says of the client (address, HTTPS) is dropped unless a trusted
    # proxy said it, before anything reads it.
    "config.client_ip.forwarded_headers_middleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "allauth.account.middleware.AccountMiddleware",
    # Remembers the browsers a user has logged in from, to tell them of a new one.
    "accounts.middleware.DeviceCookieMiddleware",
    # Last, as django-axes asks: it answers a locked-out log-in.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
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

DATABASE_URL = env_str("DATABASE_URL", f"sqlite:///{BASE_DIR / 'db.sqlite3'}")
try:
    # No connection kept per thread: under ASGI each request's synchronous view runs in a
    # thread of its own, and a connection kept there outlives the request for nothing.
    DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=0)}
except Exception as exc:  # dj_database_url raises several types for a bad URL
    raise ImproperlyConfigured(f"DATABASE_URL is not a valid database URL: {exc}") from exc
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The demo's server, scheduler and agents write at once: wait for the lock, don't fail.
    DATABASES["default"]["OPTIONS"] = {"timeout": 20, "transaction_mode": "IMMEDIATE",
                                       "init_command": "PRAGMA journal_mode=WAL;"}
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    DATABASES["default"]["TEST"] = {"NAME": env_str("TEST_DATABASE_NAME", "test_rigshare")}
    # A bounded pool per process instead (psycopg_pool): a request borrows a connection and
    # gives it back when it ends, and waits up to the pool's timeout when all are busy rather
    # than open more than PostgreSQL allows. Each borrowed connection is checked first, so a
    # database restart costs no request. Sizing in docs/operations.md.
    RIGSHARE_DB_POOL_SIZE = env_int("RIGSHARE_DB_POOL_SIZE", 24, minimum=0)
    if RIGSHARE_DB_POOL_SIZE:
        DATABASES["default"]["CONN_HEALTH_CHECKS"] = True  # the pool checks what it lends
        DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
            "min_size": 2, "max_size": RIGSHARE_DB_POOL_SIZE, "max_idle": 60,
            "timeout": env_int("RIGSHARE_DB_POOL_TIMEOUT_S", 5, minimum=1),
            # A connection that cannot be made is given up after 2 s (psycopg_pool's default
            # is 5 min of ever longer pauses): the next request tries again at once, so the
            # service is back within a second or two of the database.
            "reconnect_timeout": 2.0}

REDIS_URL = env_str("REDIS_URL", "")
if REDIS_URL:
    # The same pool as every Redis client of the platform (config/redis.py says why).
    from config.redis import pool_options

    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                          "LOCATION": REDIS_URL, "KEY_PREFIX": "rigshare",
                          "OPTIONS": {"pool_class": "redis.BlockingConnectionPool",
                                      **pool_options()}}}
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

# Celery: Redis is the broker when REDIS_URL is set; without it (the demo) tasks run eagerly.
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", REDIS_URL)
CELERY_RESULT_BACKEND = env_str("CELERY_RESULT_BACKEND", REDIS_URL or None) or None
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", not CELERY_BROKER_URL)
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_TASK_ACKS_LATE = True
# A task whose worker process died goes back on the queue at once instead of being acked: the
# verification steps it redelivers take up their run again (they are idempotent).
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TIMEZONE = "UTC"
# Load tests wait on the network for a minute or more: they have a queue of their own, for
# workers that run many at once (`--pool threads`, docs/operations.md), so that the short
# steps (evaluation, publication, the schedule's tasks) never wait behind them. A worker
# started without -Q takes both.
CELERY_TASK_QUEUES = (Queue("celery"), Queue("verification.load"))
CELERY_TASK_ROUTES = {"verification.tasks.verification_load_test": {"queue": "verification.load"}}

AUTH_USER_MODEL = "accounts.User"
# django-axes counts failed log-ins per (email, address) and locks that pair out for a while;
# the standalone backend must come first. allauth's backend logs in by email address.
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend",
                           "allauth.account.auth_backends.AuthenticationBackend",
                           "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = env_int("RIGSHARE_LOGIN_FAILURE_LIMIT", 10, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("RIGSHARE_LOGIN_COOLOFF_MIN", 15, minimum=1))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
# The email being tried, from allauth's credentials or its log-in form's "login" field.
AXES_USERNAME_CALLABLE = "accounts.security.axes_username"
AXES_VERBOSE = False
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "accounts/locked_out.html"
# Behind a load balancer the client's address is in X-Forwarded-For: how many proxies in front
# of the site to trust. One definition of the client's address for axes, allauth and the rest
# (config/client_ip.py).
RIGSHARE_TRUSTED_PROXIES = env_int("RIGSHARE_TRUSTED_PROXIES", 0, minimum=0)
# The addresses (networks) the proxy in front of the site connects from: X-Forwarded-For and
# X-Forwarded-Proto are believed only on a connection from one of them, never from a client
# that reaches a replica directly. Required in production; elsewhere, unset means any peer.
RIGSHARE_TRUSTED_PROXY_NETWORKS = tuple(env_list("RIGSHARE_TRUSTED_PROXY_NETWORKS", []))
for _network in RIGSHARE_TRUSTED_PROXY_NETWORKS:
    try:
        ipaddress.ip_network(_network, strict=False)
    except ValueError:
        raise ImproperlyConfigured(f"RIGSHARE_TRUSTED_PROXY_NETWORKS: {_network!r} is not an "
                                   "address or a network (10.0.0.0/8, 2001:db8::/32).") from None
AXES_CLIENT_IP_CALLABLE = "config.client_ip.client_ip"

# Accounts (django-allauth): log in by email; sign-up logs in at once and sends a verification
# email. An unverified address may browse and rent; payouts and API keys without a spend limit
# need a verified address and two-factor authentication (accounts/security.py).
ACCOUNT_ADAPTER = "accounts.adapter.AccountAdapter"  # the client's address: config/client_ip.py
ACCOUNT_FORMS = {"signup": "accounts.forms.SignUpForm", "login": "accounts.forms.LoginForm",
                 "reset_password_from_key": "accounts.forms.ResetPasswordKeyForm"}
ACCOUNT_USER_MODEL_USERNAME_FIELD = None
ACCOUNT_LOGIN_METHODS = {"email"}
ACCOUNT_SIGNUP_FIELDS = ["email*", "password1*", "password2*"]
ACCOUNT_UNIQUE_EMAIL = True
ACCOUNT_EMAIL_VERIFICATION = "optional"
ACCOUNT_CONFIRM_EMAIL_ON_GET = False  # a link opens a page with a button: scanners click nothing
ACCOUNT_EMAIL_CONFIRMATION_EXPIRE_DAYS = 3
ACCOUNT_LOGIN_ON_EMAIL_CONFIRMATION = False
ACCOUNT_LOGIN_ON_PASSWORD_RESET = False  # a reset never logs in: the log-in asks the code
ACCOUNT_LOGOUT_ON_GET = False
ACCOUNT_SESSION_REMEMBER = True  # sessions last as Django's do; "log out everywhere" ends them
ACCOUNT_PREVENT_ENUMERATION = True
ACCOUNT_EMAIL_NOTIFICATIONS = True  # password, email and two-factor changes are emailed
ACCOUNT_EMAIL_SUBJECT_PREFIX = "[Rigshare] "
ACCOUNT_DEFAULT_HTTP_PROTOCOL = "https" if RIGSHARE_PRODUCTION else "http"
ACCOUNT_MAX_EMAIL_ADDRESSES = 5
# Adding, removing or choosing an email address and changing the password ask for the password
# (or a two-factor code) again after ACCOUNT_REAUTHENTICATION_TIMEOUT (5 minutes) since the
# last proof; so do the platform's moves of money and secrets (accounts.security).
ACCOUNT_REAUTHENTICATION_REQUIRED = True
# allauth's own limits stay on (kept in the cache): among them, failed log-ins and failed
# second-factor codes, 5 per 5 minutes per account and 10 a minute per address, so a 6-digit
# code cannot be guessed. django-axes (above) locks an (email, address) pair out for longer.
#
# Sign-up tells a taken address ("already registered"): it logs in at once, before the address
# is verified, and one account per address comes first; log-in, password reset and adding an
# address tell nothing (ACCOUNT_PREVENT_ENUMERATION). So sign-up's own limit per address is
# tighter than allauth's (20 a minute): probing a list of addresses takes days per client.
ACCOUNT_RATE_LIMITS: dict = {"signup": "10/m/ip,100/d/ip"}
MFA_SUPPORTED_TYPES = ["totp", "recovery_codes"]
MFA_TOTP_ISSUER = "Rigshare"
MFA_RECOVERY_CODE_COUNT = 10
# A session is recorded when it logs in (address, browser); tracking every request's time
# would write to the database on every page.
USERSESSIONS_TRACK_ACTIVITY = False
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "account_login"
LOGIN_REDIRECT_URL = "marketplace:catalog"
LOGOUT_REDIRECT_URL = "marketplace:catalog"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(BASE_DIR / "staticfiles")))
# `collectstatic` names every file by its content's hash and writes gzip and brotli copies;
# WhiteNoise serves a hashed name with a year's immutable max-age and the smallest encoding
# the browser accepts. With DEBUG off, pages need that manifest: `make` runs collectstatic
# (demo, test, bench), and the tests run it once per session (tests/conftest.py). With DEBUG
# on, pages link the plain names and WhiteNoise serves them from the source folders.
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
}
# Only the hashed names are served; source maps are for developer tools, not worth compressing.
WHITENOISE_KEEP_ONLY_HASHED_FILES = True
WHITENOISE_SKIP_COMPRESS_EXTENSIONS = ("png", "jpg", "jpeg", "gif", "webp", "woff", "woff2",
                                       "gz", "br", "zip", "map")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # First, so that a refused request answers 401 with WWW-Authenticate: Bearer.
        "accounts.authentication.PersonalTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": ["config.parsers.JSONParser",
                               "rest_framework.parsers.FormParser",
                               "rest_framework.parsers.MultiPartParser"],
    # drf-spectacular's, with the 4xx answers each operation can give (config/schema.py).
    "DEFAULT_SCHEMA_CLASS": "config.schema.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.PageNumberPagination",
    "PAGE_SIZE": 50,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Rigshare API",
    "DESCRIPTION": "Catalog, rentals, provider nodes and the node-agent protocol.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI's files come from drf-spectacular-sidecar, not a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # /v1 is not DRF: its operations are written in by routing/openapi.py.
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums",
                             "routing.openapi.add_v1"],
}

# Node agents: how often they report, and how many missed reports make a node offline.
RIGSHARE_HEARTBEAT_INTERVAL_S = env_int("RIGSHARE_HEARTBEAT_INTERVAL_S", 10, minimum=1)
RIGSHARE_OFFLINE_AFTER_MISSED = env_int("RIGSHARE_OFFLINE_AFTER_MISSED", 3, minimum=1)
RIGSHARE_ENROLMENT_TOKEN_TTL_H = env_int("RIGSHARE_ENROLMENT_TOKEN_TTL_H", 24, minimum=1)
RIGSHARE_RELIABILITY_WINDOW_DAYS = env_int("RIGSHARE_RELIABILITY_WINDOW_DAYS", 30, minimum=1)
# The public URL that agents use, shown in the copy-paste enrolment command.
RIGSHARE_PUBLIC_URL = env_str("RIGSHARE_PUBLIC_URL", "")
# /v1 bodies (long prompts) may be larger than Django's 2.5 MB default; routing/openai.py
# refuses more than this with an OpenAI-style 413.
DATA_UPLOAD_MAX_MEMORY_SIZE = 4 * 1024 * 1024
# Bearer token Prometheus sends to /metrics; unset, only this machine may scrape.
RIGSHARE_METRICS_TOKEN = env_str("RIGSHARE_METRICS_TOKEN", "")

# Email (verification, password reset, security notices, provider alerts): printed to the console unless an SMTP server is configured.
EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 587, minimum=1)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", True)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "Rigshare <noreply@rigshare.test>")

# Billing. The platform's share of every rental and metered request, in basis points.
RIGSHARE_PLATFORM_FEE_BPS = env_int("RIGSHARE_PLATFORM_FEE_BPS", 1500, minimum=0)
if RIGSHARE_PLATFORM_FEE_BPS > 10_000:
    raise ImproperlyConfigured("RIGSHARE_PLATFORM_FEE_BPS must be at most 10000 (100%).")
# Where a server keeps delivered usage that Redis could not take (billing/usage.py): on the
# server's own disk, moved back to Redis when it answers again.
RIGSHARE_USAGE_SPOOL_DIR = env_str("RIGSHARE_USAGE_SPOOL_DIR",
                                   str(BASE_DIR / "var" / "spool" / "usage"))
RIGSHARE_MIN_PAYOUT_MICROS = env_int("RIGSHARE_MIN_PAYOUT_MICROS", 10_000_000, minimum=1)
# Cooling-off before money leaves (billing/payout_holds.py): a payout requested within these
# hours of the payout destination changing or two-factor turning on, and an account's first
# payout, wait this long before an operator can pay them; earnings paid from card credit
# younger than the card networks' dispute window cannot be requested until it passes.
RIGSHARE_PAYOUT_HOLD_AFTER_DESTINATION_H = env_int("RIGSHARE_PAYOUT_HOLD_AFTER_DESTINATION_H",
                                                   72, minimum=0)
RIGSHARE_PAYOUT_HOLD_AFTER_TWO_FACTOR_H = env_int("RIGSHARE_PAYOUT_HOLD_AFTER_TWO_FACTOR_H", 72,
                                                  minimum=0)
RIGSHARE_PAYOUT_HOLD_FIRST_H = env_int("RIGSHARE_PAYOUT_HOLD_FIRST_H", 168, minimum=0)
RIGSHARE_CARD_DISPUTE_WINDOW_DAYS = env_int("RIGSHARE_CARD_DISPUTE_WINDOW_DAYS", 120, minimum=0)
# An API key that may spend more than this a month (a daily limit counts 31 times, a weekly one
# 5), or without a limit, needs a verified email and two-factor: a stolen session cannot make
# itself a key that drains the balance by naming a huge limit.
RIGSHARE_KEY_SPEND_WITHOUT_2FA_MICROS = env_int("RIGSHARE_KEY_SPEND_WITHOUT_2FA_MICROS",
                                                100_000_000, minimum=0)
# The test-card gateway (demo and tests only) signs its own webhook events with this.
RIGSHARE_PAYMENT_WEBHOOK_SECRET = env_str("RIGSHARE_PAYMENT_WEBHOOK_SECRET",
                                          "dev-only-payment-webhook-secret")
# Stripe (billing/gateway.py): production needs both; set in development, Stripe's test mode is
# used instead of the test-card gateway.
STRIPE_SECRET_KEY = env_str("STRIPE_SECRET_KEY", "")
STRIPE_WEBHOOK_SECRET = env_str("STRIPE_WEBHOOK_SECRET", "")

# Shared /v1 traffic only to engines the platform reaches over TLS, pinned to the certificate
# their agent reports (marketplace/engine_tls.py): renters' prompts cross the internet.
RIGSHARE_ENGINE_TLS_REQUIRED = env_bool("RIGSHARE_ENGINE_TLS_REQUIRED", RIGSHARE_PRODUCTION)
# Networks where the platform may call a provider's engine although they are not public
# (marketplace/engine_address.py). Outside production, loopback: the demo's and the tests'
# engines run on this machine. In production none unless an operator names one.
RIGSHARE_ENGINE_NETWORKS = tuple(env_list(
    "RIGSHARE_ENGINE_NETWORKS", [] if RIGSHARE_PRODUCTION else ["127.0.0.0/8", "::1/128"]))

# Verification: how long a run waits for the agent's probes before judging without them, and
# the concurrency levels of the platform-side load test (the node's maximum is added).
RIGSHARE_PROBE_WAIT = timedelta(seconds=env_int("RIGSHARE_PROBE_WAIT_S", 600, minimum=1))
RIGSHARE_LOAD_TEST_LEVELS = tuple(int(x) for x in env_list("RIGSHARE_LOAD_TEST_LEVELS",
                                                           ["1", "8", "32"]))
# A load test whose reading event loop woke later than this (ms, 90th percentile of a level)
# was read by a starved worker: measured again later, up to REMEASURES times, never judged. The
# same tries take again a load test the engine cut short and serving read short (a card is
# flagged on serving only when a second reading, REMEASURE_AFTER or more later, agrees).
RIGSHARE_LOAD_TEST_LAG_MS = env_int("RIGSHARE_LOAD_TEST_LAG_MS", 100, minimum=1)
RIGSHARE_LOAD_TEST_REMEASURES = env_int("RIGSHARE_LOAD_TEST_REMEASURES", 4, minimum=0)
RIGSHARE_LOAD_TEST_REMEASURE_AFTER = timedelta(seconds=env_int(
    "RIGSHARE_LOAD_TEST_REMEASURE_AFTER_S", 60, minimum=1))
# How long a run waits for a machine's engine to serve the platform's yardstick (drain, load
# the weights, a first download included) before it judges the machine without it.
RIGSHARE_YARDSTICK_READY = timedelta(seconds=env_int("RIGSHARE_YARDSTICK_READY_S", 900,
                                                     minimum=1))

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {"django.server": {"level": "WARNING"},
                # one line per request of the load tests and the proxy: too much at INFO
                "httpx": {"level": "WARNING"}},
}

if RIGSHARE_PRODUCTION:
    _problems = [
        message for failed, message in (
            (DEBUG, "DEBUG must be off"),
            (SECRET_KEY == _DEV_SECRET, "SECRET_KEY must be set"),
            (any(len(key) < 50 or len(set(key)) < 5 for key in [SECRET_KEY,
                                                                 *SECRET_KEY_FALLBACKS]),
             "SECRET_KEY (and each of SECRET_KEY_FALLBACKS) must be at least 50 characters, of "
             "at least 5 different ones"),
            (not STRIPE_SECRET_KEY.startswith(("sk_live_", "sk_test_", "rk_live_", "rk_test_")),
             "STRIPE_SECRET_KEY must be a Stripe secret key (sk_... or rk_...)"),
            (not STRIPE_WEBHOOK_SECRET.startswith("whsec_"),
             "STRIPE_WEBHOOK_SECRET must be the endpoint's signing secret (whsec_...)"),
            (not REDIS_URL, "REDIS_URL must be set (cache, rate limits, Celery)"),
            # A wildcard lets any Host header through: links built from it (a password reset)
            # would point wherever a stranger's request said.
            (not ALLOWED_HOSTS or any("*" in host for host in ALLOWED_HOSTS),
             "ALLOWED_HOSTS must name the site's hosts (no *)"),
            (not RIGSHARE_PUBLIC_URL.startswith("https://"),
             "RIGSHARE_PUBLIC_URL must be the site's https:// address"),
            (len(RIGSHARE_METRICS_TOKEN) < 32,
             "RIGSHARE_METRICS_TOKEN must be set (at least 32 characters)"),
            (not RIGSHARE_TRUSTED_PROXY_NETWORKS,
             "RIGSHARE_TRUSTED_PROXY_NETWORKS must name the addresses of the proxy that "
             "terminates TLS"),
            (DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql",
             "DATABASE_URL must name PostgreSQL"),
            # Verification links, password resets and security notices must reach people.
            (EMAIL_BACKEND.rsplit(".", 2)[-2] in ("console", "locmem", "dummy", "filebased"),
             "EMAIL_BACKEND must send mail (SMTP: django.core.mail.backends.smtp.EmailBackend)"),
        ) if failed]
    if _problems:
        raise ImproperlyConfigured("Refusing to start in production (RIGSHARE_PRODUCTION=1): "
                                   + "; ".join(_problems) + ".")
    # HTTPS only, behind a proxy that terminates TLS and says so in X-Forwarded-Proto.
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
    SECURE_REDIRECT_EXEMPT = [r"^healthz$"]  # the load balancer's plain-HTTP probe
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31_536_000, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", True)
    SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", True)
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SESSION_COOKIE_HTTPONLY = True
    CSRF_COOKIE_HTTPONLY = True  # the pages post forms with the token; no script reads it
