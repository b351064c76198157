"""REST API for API keys: own keys only, the secret once, revocation that takes effect at once."""

import pytest
from rest_framework.test import APIClient

from accounts.services import personal_token_create
from billing import keys
from billing.models import ApiKey

pytestmark = pytest.mark.django_db


def test_anonymous_is_refused(api):
    assert api.get("/api/keys/").status_code in (401, 403)
    assert api.post("/api/keys/", {"name": "x"}, format="json").status_code in (401, 403)
    assert not ApiKey.objects.exists()


def test_create_returns_the_key_once(api_as, carol):
    client = api_as(carol)
    response = client.post("/api/keys/", {
        "name": "batch", "spend_limit_usd": "12.5", "spend_period": "daily",
        "allowed_models": ["m1", " m2 ", "m1"], "requests_per_minute": 30}, format="json")
    assert response.status_code == 201, response.content
    data = response.json()
    token = data["key"]
    row = ApiKey.objects.get()
    assert data["id"] == row.pk and data["display"] == f"rs_{row.prefix}_…"
    assert data["spend_limit_usd"] == "12.500000" and data["allowed_models"] == ["m1", "m2"]
    assert (row.spend_limit_micros, row.spend_period, row.requests_per_minute) == (
        12_500_000, "daily", 30)
    assert keys.api_key_authenticate(token).key_id == row.pk
    listed = client.get("/api/keys/").json()
    assert listed["count"] == 1 and "key" not in listed["results"][0]
    assert token not in client.get(f"/api/keys/{row.pk}/").content.decode()


def test_create_with_defaults_and_bad_input(api_as, carol):
    client = api_as(carol)
    plain = client.post("/api/keys/", {"name": "plain"}, format="json").json()
    assert plain["spend_limit_usd"] is None and plain["spend_period"] == "monthly"
    assert plain["allowed_models"] == [] and plain["tokens_per_minute"] is None
    for bad in [{}, {"name": "x", "spend_limit_usd": "-1"},
                {"name": "x", "spend_limit_usd": "1000000.01"}, {"name": "x", "spend_limit_usd": "x"}, {"name": "x", "spend_period": "hourly"},
                {"name": "x", "requests_per_minute": 0}, {"name": "x", "allowed_models": "m1"},
                {"name": "x" * 101}]:
        response = client.post("/api/keys/", bad, format="json")
        assert response.status_code == 400, bad
    assert ApiKey.objects.count() == 1


def test_only_own_keys_are_seen_changed_or_revoked(api_as, carol, mallory):
    row, token = keys.api_key_create(user=carol, name="carols")
    keys.api_key_authenticate(token)  # cached
    outsider = api_as(mallory)
    assert outsider.get("/api/keys/").json()["count"] == 0
    assert outsider.get(f"/api/keys/{row.pk}/").status_code == 404
    assert outsider.patch(f"/api/keys/{row.pk}/", {"name": "mine"},
                          format="json").status_code == 404
    assert outsider.post(f"/api/keys/{row.pk}/revoke/").status_code == 404
    row.refresh_from_db()
    assert row.name == "carols" and row.revoked_at is None
    assert keys.api_key_authenticate(token) is not None


def test_update_limits_and_revoke(api_as, carol):
    row, token = keys.api_key_create(user=carol, name="k")
    keys.api_key_authenticate(token)
    client = api_as(carol)
    response = client.patch(f"/api/keys/{row.pk}/", {"tokens_per_minute": 5000,
                                                     "allowed_models": ["m1"]}, format="json")
    assert response.status_code == 200, response.content
    info = keys.api_key_authenticate(token)  # the service dropped the cached copy
    assert info.tokens_per_minute == 5000 and info.allowed_models == ("m1",)
    assert client.put(f"/api/keys/{row.pk}/", {"name": "x"}, format="json").status_code == 405
    assert client.delete(f"/api/keys/{row.pk}/").status_code == 405

    revoked = client.post(f"/api/keys/{row.pk}/revoke/")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    assert keys.api_key_authenticate(token) is None
    assert client.patch(f"/api/keys/{row.pk}/", {"name": "back"},
                        format="json").status_code == 400
    assert client.post(f"/api/keys/{row.pk}/revoke/").status_code == 200  # idempotent


def test_bearer_token_auth_works_for_keys(carol):
    _, rest_token = personal_token_create(user=carol, name="ci")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {rest_token}")
    assert client.post("/api/keys/", {"name": "from-ci"}, format="json").status_code == 201


def test_marketplace_api_root_is_still_served(api_as, carol):
    assert api_as(carol).get("/api/").status_code == 200
    assert "/api/keys/" in api_as(carol).get("/api/schema/").content.decode()
