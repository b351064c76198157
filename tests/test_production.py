"""Production takes real money only: it refuses to start unless it is set up for it, Django's
deployment checks pass in its settings, and only Stripe takes payments there."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GOOD = {
    "RIGSHARE_PRODUCTION": "1", "DEBUG": "0",
    "SECRET_KEY": "k3y-" + "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJ",
    "STRIPE_SECRET_KEY": "sk_live_rigshare", "STRIPE_WEBHOOK_SECRET": "whsec_rigshare",
    "DATABASE_URL": "postgres://rigshare@db.internal:5432/rigshare",
    "REDIS_URL": "redis://cache.internal:6379/0", "ALLOWED_HOSTS": "rigshare.example",
    "EMAIL_BACKEND": "django.core.mail.backends.smtp.EmailBackend",
    "EMAIL_HOST": "smtp.rigshare.example", "RIGSHARE_PUBLIC_URL": "https://rigshare.example",
    "RIGSHARE_METRICS_TOKEN": "m3trics-" + "0123456789abcdefghijklmnopqrstuv",
    "RIGSHARE_TRUSTED_PROXY_NETWORKS": "10.0.0.0/16",
}


def django_in(env: dict, code: str = "pass", *args) -> subprocess.CompletedProcess:
    """A fresh interpreter with only these settings: production is decided at start-up."""
    clean = {k: v for k, v in os.environ.items()
             if k not in GOOD and not k.startswith(("STRIPE_", "DJANGO_"))}
    return subprocess.run(
        [sys.executable, "-c", "import django, os; os.environ.setdefault('DJANGO_SETTINGS_MODULE',"
         " 'config.settings'); django.setup(); " + code, *args],
        cwd=REPO, env=clean | env, capture_output=True, text=True, timeout=60)


def test_production_starts_when_set_up():
    started = django_in(GOOD, "from billing.gateway import get_gateway; "
                              "print(type(get_gateway()).__name__)")
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip() == "StripeGateway"


@pytest.mark.parametrize("change, refusal", [
    ({"DEBUG": "1"}, "DEBUG must be off"),
    ({"SECRET_KEY": ""}, "SECRET_KEY must be set"),
    ({"SECRET_KEY": "x"}, "at least 50 characters"),
    ({"SECRET_KEY": "a" * 60}, "at least 50 characters, of at least 5 different"),
    ({"STRIPE_SECRET_KEY": ""}, "STRIPE_SECRET_KEY"),
    ({"STRIPE_SECRET_KEY": "pk_live_public"}, "STRIPE_SECRET_KEY"),
    ({"STRIPE_WEBHOOK_SECRET": ""}, "STRIPE_WEBHOOK_SECRET"),
    ({"STRIPE_WEBHOOK_SECRET": "dev-only-payment-webhook-secret"}, "STRIPE_WEBHOOK_SECRET"),
    ({"REDIS_URL": ""}, "REDIS_URL"),
    ({"DATABASE_URL": "sqlite:///tmp/x.sqlite3"}, "PostgreSQL"),
    ({"EMAIL_BACKEND": ""}, "EMAIL_BACKEND must send mail"),
    ({"EMAIL_BACKEND": "django.core.mail.backends.locmem.EmailBackend"}, "EMAIL_BACKEND"),
    ({"ALLOWED_HOSTS": "*"}, "ALLOWED_HOSTS must name the site's hosts"),
    ({"ALLOWED_HOSTS": "rigshare.example,*"}, "ALLOWED_HOSTS must name the site's hosts"),
    ({"ALLOWED_HOSTS": ""}, "ALLOWED_HOSTS must name the site's hosts"),
    ({"RIGSHARE_PUBLIC_URL": ""}, "RIGSHARE_PUBLIC_URL must be"),
    ({"RIGSHARE_PUBLIC_URL": "http://rigshare.example"}, "RIGSHARE_PUBLIC_URL must be"),
    ({"RIGSHARE_METRICS_TOKEN": ""}, "RIGSHARE_METRICS_TOKEN must be set"),
    ({"RIGSHARE_METRICS_TOKEN": "short"}, "RIGSHARE_METRICS_TOKEN must be set"),
    ({"RIGSHARE_TRUSTED_PROXY_NETWORKS": ""}, "RIGSHARE_TRUSTED_PROXY_NETWORKS must name"),
    ({"RIGSHARE_TRUSTED_PROXY_NETWORKS": "10.0.0.0/33"}, "is not an address or a network"),
])
def test_production_refuses_to_start_without_what_it_needs(change, refusal):
    refused = django_in(GOOD | change)
    assert refused.returncode != 0
    assert "ImproperlyConfigured" in refused.stderr and refusal in refused.stderr


def test_the_test_card_gateway_does_not_exist_in_production(settings):
    from django.core.exceptions import ImproperlyConfigured

    from billing.gateway import get_gateway

    settings.RIGSHARE_PRODUCTION, settings.STRIPE_SECRET_KEY = True, ""
    with pytest.raises(ImproperlyConfigured):
        get_gateway()


def test_djangos_deployment_checks_pass_in_production_settings():
    checked = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=REPO, env={k: v for k, v in os.environ.items() if not k.startswith("STRIPE_")}
        | GOOD, capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "no issues" in checked.stdout


def test_production_cookies_and_https():
    shown = django_in(GOOD, "from django.conf import settings as s; print(s.SESSION_COOKIE_SECURE,"
                            " s.CSRF_COOKIE_SECURE, s.SESSION_COOKIE_HTTPONLY, s.SECURE_SSL_REDIRECT,"
                            " s.SECURE_HSTS_SECONDS, s.SECURE_PROXY_SSL_HEADER)")
    assert shown.stdout.split(maxsplit=5) == ["True", "True", "True", "True", "31536000",
                                              "('HTTP_X_FORWARDED_PROTO', 'https')\n"]
