"""The REST API: who may see and change what, with session and bearer-token auth."""

import pytest
from rest_framework.test import APIClient

from accounts.services import personal_token_create, personal_token_revoke
from marketplace import services
from marketplace.models import EnrolmentToken, Listing, Rental
from tests.factories import CardFactory, ListingFactory, NodeFactory, listed_card

pytestmark = pytest.mark.django_db


def bearer(user):
    _, token = personal_token_create(user=user, name="test")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


def test_bearer_token_auth_and_revocation(alice):
    row, token = personal_token_create(user=alice, name="ci")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert client.get("/api/rentals/").status_code == 200
    row.refresh_from_db()
    assert row.last_used_at is not None and token not in row.digest
    personal_token_revoke(user=alice, token_id=row.pk)
    assert client.get("/api/rentals/").status_code == 401
    client.credentials(HTTP_AUTHORIZATION="Bearer rst_000000000000_forged")
    assert client.get("/api/rentals/").status_code == 401


def test_session_auth_works_and_enforces_csrf(alice, fund):
    fund(alice)
    card = listed_card()
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(alice)
    assert client.get("/api/rentals/").status_code == 200
    assert client.post("/api/rentals/", {"card": card.pk}, format="json").status_code == 403
    assert not Rental.objects.exists()


def test_anonymous_may_browse_cards_but_nothing_else(api):
    card = listed_card()
    assert api.get("/api/cards/").json()["count"] == 1
    assert api.get(f"/api/cards/{card.pk}/").status_code == 200
    for url in ["/api/rentals/", "/api/nodes/", "/api/enrolment-tokens/",
                f"/api/listings/{card.pk}/"]:
        assert api.get(url).status_code in (401, 403), url


def test_rent_and_stop_through_the_api(alice, fund):
    fund(alice)
    card = listed_card()
    client = bearer(alice)
    response = client.post("/api/rentals/", {"card": card.pk, "hours": 2}, format="json")
    assert response.status_code == 201, response.content
    rental = response.json()
    assert rental["card"] == card.pk and rental["ends_at"] and rental["stopped_at"] is None
    again = client.post("/api/rentals/", {"card": card.pk}, format="json")
    assert again.status_code == 400 and "Someone else" in again.json()["card"][0]
    stopped = client.post(f"/api/rentals/{rental['id']}/stop/").json()
    assert stopped["stopped_at"] and stopped["stop_reason"] == "requested"
    bad = client.post("/api/rentals/", {"card": card.pk, "hours": 0}, format="json")
    assert bad.status_code == 400 and "hours" in bad.json()
    assert client.post("/api/rentals/", {"card": "x"}, format="json").status_code == 400


def test_users_never_see_or_change_each_others_rentals(alice, mallory, fund):
    fund(alice)
    rental = services.rental_start(renter=alice, card_id=listed_card().pk)
    client = bearer(mallory)
    assert client.get("/api/rentals/").json()["results"] == []
    assert client.get(f"/api/rentals/{rental.pk}/").status_code == 404
    assert client.post(f"/api/rentals/{rental.pk}/stop/").status_code == 404
    rental.refresh_from_db()
    assert rental.is_active


def test_nodes_are_the_providers_own_and_only_name_and_region_change(bob, mallory):
    node = NodeFactory(owner=bob, name="box")
    card = CardFactory(node=node)
    ListingFactory(card=card)
    client = bearer(bob)
    rows = client.get("/api/nodes/").json()["results"]
    assert [r["id"] for r in rows] == [node.pk]
    assert rows[0]["cards"][0]["memory_total_mib"] == 24564
    response = client.patch(f"/api/nodes/{node.pk}/", {
        "name": "renamed", "region": "us-west", "status": "offline",
        "reliability_pct": "100", "driver_version": "999"}, format="json")
    assert response.status_code == 200
    node.refresh_from_db()
    assert (node.name, node.region, node.status, node.driver_version) == (
        "renamed", "us-west", "online", "")

    outsider = bearer(mallory)
    assert outsider.get("/api/nodes/").json()["results"] == []
    assert outsider.get(f"/api/nodes/{node.pk}/").status_code == 404
    assert outsider.patch(f"/api/nodes/{node.pk}/", {"name": "x"},
                          format="json").status_code == 404
    assert outsider.post(f"/api/nodes/{node.pk}/revoke/").status_code == 404
    node.refresh_from_db()
    assert node.name == "renamed" and node.credential_revoked_at is None

    assert client.post(f"/api/nodes/{node.pk}/revoke/").json()["credential_revoked_at"]


def test_listing_through_the_api(bob, mallory):
    card = CardFactory(node=NodeFactory(owner=bob))
    ListingFactory(card=card, is_listed=False, price_per_hour_micros=0)
    client = bearer(bob)
    refused = client.patch(f"/api/listings/{card.pk}/", {"is_listed": True}, format="json")
    assert refused.status_code == 400 and "above zero" in refused.json()["is_listed"][0]
    response = client.patch(f"/api/listings/{card.pk}/", {
        "is_listed": True, "price_per_hour_usd": "0.75"}, format="json")
    assert response.status_code == 200 and response.json()["price_per_hour_usd"] == "0.750000"
    assert Listing.objects.get(card=card).price_per_hour_micros == 750_000
    negative = client.patch(f"/api/listings/{card.pk}/", {"price_per_hour_usd": "-1"},
                            format="json")
    assert negative.status_code == 400

    outsider = bearer(mallory)
    assert outsider.get(f"/api/listings/{card.pk}/").status_code == 404
    assert outsider.patch(f"/api/listings/{card.pk}/", {"price_per_hour_usd": "0.01"},
                          format="json").status_code == 404
    assert Listing.objects.get(card=card).price_per_hour_micros == 750_000


def test_enrolment_tokens_through_the_api(bob, mallory):
    client = bearer(bob)
    created = client.post("/api/enrolment-tokens/")
    assert created.status_code == 201
    token = created.json()["token"]
    assert token.startswith("rse_") and created.json()["state"] == "active"
    listed = client.get("/api/enrolment-tokens/").json()["results"]
    assert len(listed) == 1 and "token" not in listed[0]  # shown once, at creation

    outsider = bearer(mallory)
    row_id = created.json()["id"]
    assert outsider.get("/api/enrolment-tokens/").json()["results"] == []
    assert outsider.post(f"/api/enrolment-tokens/{row_id}/revoke/").status_code == 404
    assert EnrolmentToken.objects.get(pk=row_id).state() == "active"
    assert client.post(f"/api/enrolment-tokens/{row_id}/revoke/").json()["state"] == "revoked"


def test_openapi_schema_and_docs_page(client):
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    for path in ["/api/cards/", "/api/rentals/", "/api/nodes/", "/api/agent/heartbeat/",
                 "/api/agent/enroll/", "/api/listings/{card_id}/", "/api/enrolment-tokens/"]:
        assert path in paths, path
    # The agent's calls name the node credential as their security scheme.
    body = schema.json()
    assert body["components"]["securitySchemes"]["nodeCredential"]["scheme"] == "bearer"
    for path in ["/api/agent/heartbeat/", "/api/agent/jobs/{job_id}/result/"]:
        assert paths[path]["post"]["security"] == [{"nodeCredential": []}], path
    docs = client.get("/api/docs/")
    assert docs.status_code == 200 and b"swagger" in docs.content.lower()
