"""SECRET_KEY rotates: the old one moves to SECRET_KEY_FALLBACKS, and everything made under it
keeps working. Credentials (node credentials, enrolment tokens, REST tokens, API keys) match
under a fallback and are re-hashed under the new key on that use; sealed engine keys open under
a fallback and `manage.py secrets_reseal` seals them again; sessions stay logged in. Once the
fallback is dropped, what was re-hashed or re-sealed still works and nothing else does."""

from io import StringIO

import pytest
from django.core.cache import cache
from django.core.management import call_command
from django.test import Client
from rest_framework.test import APIClient

from accounts.models import PersonalToken
from accounts.secrets import secret_check, secret_digest, secret_issue
from accounts.services import personal_token_create
from billing import keys
from billing.keys import api_key_authenticate, api_key_create
from billing.models import ApiKey
from marketplace import engine_keys, services
from marketplace.models import Node
from tests.marketplace.test_agent_api import beat, enroll, report

pytestmark = pytest.mark.django_db

OLD = "the-secret-key-before-the-rotation-0123456789abcdefghij"
NEW = "the-secret-key-after-the-rotation-9876543210zyxwvutsrqp"


@pytest.fixture
def rotate(settings):
    """rotate(): what was SECRET_KEY becomes the fallback; rotate(drop=True): the fallback
    goes too."""
    settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = OLD, []

    def _rotate(drop: bool = False):
        settings.SECRET_KEY = NEW
        settings.SECRET_KEY_FALLBACKS = [] if drop else [OLD]

    return _rotate


def test_a_digest_under_a_fallback_matches_and_is_re_hashed(rotate):
    issued = secret_issue("rst")
    rotate()
    assert secret_check(issued.token, issued.digest) == secret_digest(issued.token, NEW)
    assert secret_check(issued.token + "x", issued.digest) is None
    fresh = secret_issue("rst")
    assert secret_check(fresh.token, fresh.digest) == fresh.digest  # made under SECRET_KEY
    rotate(drop=True)
    assert secret_check(issued.token, issued.digest) is None


def test_a_node_keeps_reporting_through_the_rotation(api, bob, rotate):
    enrolled = enroll(api, bob)
    credential = enrolled["credential"]
    assert beat(api, credential, report()).status_code == 200
    rotate()
    assert beat(api, credential, report()).status_code == 200
    node = Node.objects.get(pk=enrolled["node_id"])
    assert node.credential_digest == secret_digest(credential, NEW)
    rotate(drop=True)
    assert beat(api, credential, report()).status_code == 200
    # A node that did not report while the fallback was there is cut off once it goes.
    other = enroll(api, bob, hostname="gpu-box-2")
    rotate(drop=True)
    Node.objects.filter(pk=other["node_id"]).update(
        credential_digest=secret_digest(other["credential"], OLD))
    assert beat(api, other["credential"], report()).status_code == 401


def test_an_enrolment_token_from_before_the_rotation_still_enrolls(api, bob, rotate):
    _, token = services.enrolment_token_create(owner=bob)
    rotate()
    response = api.post("/api/agent/enroll/", {"token": token, "hostname": "box"},
                        format="json")
    assert response.status_code == 201, response.content


def test_a_rest_token_is_re_hashed_on_use(alice, rotate):
    row, token = personal_token_create(user=alice, name="script")
    rest = APIClient()
    rest.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    rotate()
    assert rest.get("/api/keys/").status_code == 200
    assert PersonalToken.objects.get(pk=row.pk).digest == secret_digest(token, NEW)
    rotate(drop=True)
    assert rest.get("/api/keys/").status_code == 200


def test_an_api_key_is_re_hashed_on_use_and_its_cached_copies_follow(carol, rotate):
    row, token = api_key_create(user=carol, name="laptop")
    assert api_key_authenticate(token) is not None  # cached under its digest as it was
    rotate()
    assert api_key_authenticate(token) is not None
    row.refresh_from_db()
    assert row.digest == secret_digest(token, NEW)
    rotate(drop=True)
    cache.delete(keys._cache_key(row.digest))  # read from the database again
    assert api_key_authenticate(token) is not None
    # Revoking it drops the copy cached under its digest now.
    assert keys.api_key_revoke(user=carol, key_id=row.pk)
    assert api_key_authenticate(token) is None
    assert ApiKey.objects.get(pk=row.pk).revoked_at is not None


def test_a_session_stays_logged_in(alice, rotate):
    client = Client()
    client.force_login(alice)
    assert client.get("/accounts/").status_code == 200
    rotate()
    assert client.get("/accounts/").status_code == 200


def test_engine_keys_open_under_a_fallback_and_are_sealed_again(bob, rotate):
    key, pending = engine_keys.issue(), engine_keys.issue()
    node = Node.objects.create(owner=bob, name="box", credential_prefix="p" * 12,
                               credential_digest="0", engine_key_sealed=engine_keys.seal(key),
                               engine_key_fingerprint=engine_keys.fingerprint(key),
                               engine_key_next=engine_keys.seal(pending))
    untouched = Node.objects.create(owner=bob, name="new", credential_prefix="q" * 12,
                                    credential_digest="0")
    rotate()
    assert engine_keys.unseal(node.engine_key_sealed) == key  # MultiFernet: the fallback
    out = StringIO()
    call_command("secrets_reseal", stdout=out)
    assert out.getvalue().startswith("2 engine keys sealed again")
    node.refresh_from_db()
    assert engine_keys.reseal(node.engine_key_sealed) is None  # under SECRET_KEY now
    assert services.engine_keys_reseal() == 0
    rotate(drop=True)
    assert engine_keys.unseal(node.engine_key_sealed) == key
    assert engine_keys.unseal(node.engine_key_next) == pending
    assert node.engine_key_fingerprint == engine_keys.fingerprint(key)
    untouched.refresh_from_db()
    assert (untouched.engine_key_sealed, untouched.engine_key_next) == ("", "")
