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
    """A provider."""
    return UserFactory(email="bob@example.com")


@pytest.fixture
def carol(db):
    """An API consumer."""
    return UserFactory(email="carol@example.com")


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

    cache.clear()
    yield


@pytest.fixture(autouse=True)
def _fast_password_hasher(settings):
    # PBKDF2's cost is the point in production and pure waiting in tests.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
