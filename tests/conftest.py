import pytest
from rest_framework.test import APIClient

from tests.factories import UserFactory

PASSWORD = "correct horse battery"


@pytest.fixture
def alice(db):
    """A renter."""
    return UserFactory(email="alice@example.com")


@pytest.fixture
def bob(db):
    """A provider, with two-factor on (payouts need it)."""
    return UserFactory(email="bob@example.com", two_factor=True)


@pytest.fixture
def carol(db):
    """An API consumer, with two-factor on (keys without a spend limit need it)."""
    return UserFactory(email="carol@example.com", two_factor=True)


@pytest.fixture
def mallory(db):
    """An outsider: owns nothing and must be refused everywhere."""
    return UserFactory(email="mallory@example.com")


@pytest.fixture
def api():
    return APIClient()


@pytest.fixture
def login(client):
    """login(user) -> the Django test client logged in as that user."""

    def _login(user):
        client.force_login(user)
        return client

    return _login


@pytest.fixture
def api_as():
    def _api_as(user):
        client = APIClient()
        client.force_authenticate(user)
        return client

    return _api_as


@pytest.fixture(autouse=True)
def _clear_cache():
    from django.core.cache import cache

    from billing.keys import near_cache_clear

    cache.clear()
    near_cache_clear()
    yield


@pytest.fixture(autouse=True)
def _usage_spool(settings, tmp_path):
    """Each test's usage journal spools to a directory of its own."""
    from billing import usage

    settings.RIGSHARE_USAGE_SPOOL_DIR = str(tmp_path / "usage-spool")
    usage._spool.maybe_full = True
    yield


@pytest.fixture(autouse=True)
def _recent_proof(request, monkeypatch):
    """A logged-in test session counts as just re-authenticated (the password asked again
    before money or secrets move: accounts.security.recent_proof_required), except in tests
    marked `reauth`, which test that asking."""
    if "reauth" not in request.keywords:
        from allauth.account.internal.flows import reauthentication
        monkeypatch.setattr(reauthentication, "did_recently_reauthenticate",
                            lambda request: request.user.is_authenticated)


@pytest.fixture(autouse=True)
def _no_payout_holds(request, settings):
    """Payouts are not held (billing/payout_holds.py: the cooling-off after a change of
    destination or two-factor, an account's first payout, earnings from young card credit),
    except in tests marked `payout_holds`, which test the holds."""
    if "payout_holds" not in request.keywords:
        settings.RIGSHARE_PAYOUT_HOLD_AFTER_DESTINATION_H = 0
        settings.RIGSHARE_PAYOUT_HOLD_AFTER_TWO_FACTOR_H = 0
        settings.RIGSHARE_PAYOUT_HOLD_FIRST_H = 0
        settings.RIGSHARE_CARD_DISPUTE_WINDOW_DAYS = 0


@pytest.fixture(autouse=True)
def _fast_password_hasher(settings):
    # PBKDF2's cost is the point in production and pure waiting in tests.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _db_fixture(request) -> str | None:
    marker = request.node.get_closest_marker("django_db")
    if marker is not None:
        return "transactional_db" if marker.kwargs.get("transaction") else "db"
    for name in ("transactional_db", "db", "live_server"):
        if name in request.fixturenames:
            return "transactional_db" if name != "db" else "db"
    return None


@pytest.fixture(autouse=True)
def _ledger_stays_balanced(request):
    """After every test that touched the ledger: no money lost or invented."""
    from billing import ledger

    db_fixture = _db_fixture(request)
    if db_fixture is None:
        yield
        return
    request.getfixturevalue(db_fixture)  # so the database outlives this check
    ledger.forget_account_ids()
    yield
    from billing.models import Entry
    from billing.selectors import ledger_problems

    if Entry.objects.exists():
        assert ledger_problems() == []
    ledger.forget_account_ids()


@pytest.fixture
def fund():
    """fund(user, micros): operator credit into the user's wallet, through the ledger."""
    import uuid

    from billing.services import credits_grant

    def _fund(user, micros=100_000_000):
        credits_grant(user=user, amount_micros=micros, idempotency_key=f"test:{uuid.uuid4()}")
        return user

    return _fund


@pytest.fixture
def gpu_specs(transactional_db):
    """The reference spec table, which a transactional test's flush empties: seeded again."""
    from verification.models import GpuSpec
    from verification.spec_data import seed_specs

    seed_specs(GpuSpec)


@pytest.fixture
def pg_gate():
    """A gate in front of PostgreSQL for a deployment's processes (tests/deployment.py)."""
    from tests.deployment import PgGate

    gate = PgGate()
    gate.open()
    yield gate
    gate.cut()


@pytest.fixture
def redis_server(tmp_path):
    """A redis-server of the test's own that persists every write, as production's must."""
    from tests.deployment import PrivateRedis

    directory = tmp_path / "redis"
    directory.mkdir()
    redis = PrivateRedis(directory)
    redis.start()
    yield redis
    redis.stop()


@pytest.fixture(scope="session")
def server_threads_closed(django_db_setup, django_db_blocker):
    """An in-process server's threads (the proxy's database threads, routing.calls, and those
    Django's handler served pages in) keep connections open: close them before the test
    database is dropped."""
    yield
    from django.db import connection

    from routing import calls

    calls.close_connections()
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                       " WHERE datname = current_database() AND pid <> pg_backend_pid()")


@pytest.fixture(scope="session", autouse=True)
def _static_files():
    """The pages run with DEBUG off, as in production, so they link the hashed names of
    `collectstatic`'s manifest. It is collected once per set of sources (tests/static.py) and
    used by this process and the servers it starts (STATIC_ROOT in their environment)."""
    import os

    from django.test import override_settings

    from tests.static import collected_static_root

    root = collected_static_root()
    os.environ["STATIC_ROOT"] = str(root)
    with override_settings(STATIC_ROOT=root):
        yield root
