"""The OpenAPI schema at /api/schema/ tells the truth about the REST API.

schemathesis sends each operation requests drawn from the schema, valid and invalid ones, through
the real WSGI app on PostgreSQL, as a real user with a personal API token (the node agent's
operations with a real node credential): every answer must be a status code the schema
documents, in the documented content type and shape, and never a 5xx. The schema itself must
name both bearer credentials and document on every operation the 4xx answers it can give."""

import pytest
import schemathesis
from django.core import signals
from django.db import close_old_connections
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from accounts.services import personal_token_create
from billing.keys import api_key_create
from marketplace import services as marketplace
from tests.factories import ListingFactory, NodeFactory, RentalFactory, listed_card

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
# Requests per operation, valid and invalid data together: about 15 s for the whole API.
MAX_EXAMPLES = 12


@pytest.fixture
def wsgi_app():
    """The project's WSGI app, called in-process inside the test's transaction. Like Django's
    test client, it must not close the database connection as each request starts and ends
    (that would end the transaction the test runs in)."""
    from config.wsgi import application

    for signal in (signals.request_started, signals.request_finished):
        signal.disconnect(close_old_connections)
    yield application
    for signal in (signals.request_started, signals.request_finished):
        signal.connect(close_old_connections)


@pytest.fixture
def api_schema(wsgi_app):
    config = schemathesis.Config.from_dict({"cache": {"enabled": False}})
    return schemathesis.openapi.from_wsgi("/api/schema/?format=json", wsgi_app, config=config)


@pytest.fixture
def world(alice, fund):
    """alice rents and provides at once, so that each operation finds rows of her own: a node
    with a listed card, a node enrolled through the agent API (its credential for the agent's
    operations), a rental of someone else's card, enrolment tokens and an API key."""
    fund(alice)
    node = NodeFactory(owner=alice)
    own_card = ListingFactory(card__node=node).card
    rental = RentalFactory(renter=alice, card=listed_card())
    free_card = listed_card()
    token_row, token = marketplace.enrolment_token_create(owner=alice)
    agent_node = marketplace.node_enroll(token=token, hostname="rig-1", agent_version="1.0.0")
    spare_row, spare_token = marketplace.enrolment_token_create(owner=alice)
    key, _ = api_key_create(user=alice, name="schema", spend_limit_micros=10**12,
                            by_operator=True)
    _, personal_token = personal_token_create(user=alice, name="schema")
    return {
        "personal_token": personal_token,
        "node_credential": agent_node.credential,
        # Path parameters that name alice's real rows, by path: generated ones almost never
        # do, and would meet only 404s.
        "rows": {
            "/api/cards/{id}/": {"id": own_card.pk},
            "/api/listings/{card_id}/": {"card_id": own_card.pk},
            "/api/nodes/{id}/": {"id": node.pk},
            "/api/nodes/{id}/revoke/": {"id": node.pk},
            "/api/rentals/{id}/": {"id": rental.pk},
            "/api/rentals/{id}/stop/": {"id": rental.pk},
            "/api/enrolment-tokens/{id}/": {"id": token_row.pk},
            "/api/enrolment-tokens/{id}/revoke/": {"id": spare_row.pk},
            "/api/keys/{id}/": {"id": key.pk},
            "/api/keys/{id}/revoke/": {"id": key.pk},
        },
        # Bodies that succeed once (then meet "already rented", "already used"), by operation.
        "bodies": {
            "POST /api/rentals/": {"card": free_card.pk, "hours": 1},
            "POST /api/agent/enroll/": {"token": spare_token, "hostname": "rig-2",
                                        "agent_version": "1.0.0"},
        },
    }


def _cases(operation, world):
    credential = (world["node_credential"] if operation.path.startswith("/api/agent/")
                  else world["personal_token"])
    headers = {"Authorization": f"Bearer {credential}"}
    strategies = []
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        strategies.append(operation.as_strategy(mode, headers=headers))
        if operation.path in world["rows"]:
            strategies.append(operation.as_strategy(
                mode, headers=headers, path_parameters=world["rows"][operation.path]))
    if operation.label in world["bodies"]:
        strategies.append(operation.as_strategy(
            GenerationMode.POSITIVE, headers=headers, media_type="application/json",
            body=world["bodies"][operation.label]))
    return st.one_of(strategies)


def test_rest_api_answers_as_its_schema_says(api_schema, world, subtests):
    operations = [op for result in api_schema.get_all_operations()
                  if (op := result.ok()).path.startswith("/api/")]
    assert len(operations) > 20  # the whole REST API, not a schema that lost its paths
    # Every REST operation is exercised, each can be called with the rows above. /v1's are
    # held to the schema against a live server and engine (tests/routing/test_v1_schema.py).
    for operation in operations:
        with subtests.test(operation=operation.label):
            @given(case=_cases(operation, world))
            @settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None,
                      deadline=None, phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            def call(case):
                case.call_and_validate(checks=CHECKS)

            call()


def _operations(schema):
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            yield f"{method.upper()} {path}", operation


def test_schema_names_both_bearer_credentials_and_every_operations_4xx(api):
    response = api.get("/api/schema/?format=json")
    assert response.status_code == 200
    schema = response.json()
    components = schema["components"]
    schemes = components["securitySchemes"]
    assert schemes["personalToken"] == {
        "type": "http", "scheme": "bearer", "bearerFormat": "rst_...",
        "description": "A personal API token from Account > API tokens."}
    assert schemes["nodeCredential"]["scheme"] == "bearer"
    assert schemes["nodeCredential"]["bearerFormat"] == "rsn_..."
    assert components["schemas"]["Error"]["required"] == ["detail"]

    operations = dict(_operations(schema))
    assert len(operations) > 20
    v1 = {label: operations.pop(label) for label in list(operations)
          if label.split()[1].startswith("/v1")}
    assert set(v1) == {"GET /v1/models", "GET /v1/models/{model}",
                       "POST /v1/chat/completions", "POST /v1/completions"}
    assert schemes["apiKey"]["scheme"] == "bearer"
    for label, operation in v1.items():  # OpenAI's error shape, the API key
        assert operation["security"] == [{"apiKey": []}], label
        assert "401" in operation["responses"] and "503" in operation["responses"], label
        for code, answer in operation["responses"].items():
            if code != "200":
                assert answer["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/OpenAIError"}, (label, code)
    for label, operation in operations.items():
        codes = set(operation["responses"])
        assert {code for code in codes if code.startswith("4")}, label
        for code in codes - {"400"}:
            if code.startswith("4"):  # DRF's {"detail": "..."}
                body = operation["responses"][code]["content"]["application/json"]["schema"]
                assert body == {"$ref": "#/components/schemas/Error"}, (label, code)
        security = [name for requirement in operation["security"] for name in requirement]
        if label.split()[1].startswith("/api/agent/"):
            assert security in ([], ["nodeCredential"]), label
        else:
            assert "personalToken" in security, label
            assert "401" in codes, label
        if operation.get("requestBody"):
            assert {"400", "413", "415"} <= codes, label
        if "{" in label:
            assert "404" in codes, label

    assert "401" in operations["POST /api/agent/enroll/"]["responses"]
    assert "409" in operations["POST /api/agent/jobs/{job_id}/result/"]["responses"]
    assert "403" in operations["POST /api/agent/heartbeat/"]["responses"]  # revoked
    assert "400" in operations["GET /api/cards/"]["responses"]  # the catalog's filters
    assert "404" in operations["GET /api/rentals/"]["responses"]  # ?page= past the end
    assert "403" in operations["POST /api/rentals/"]["responses"]  # CSRF with the cookie
    assert "403" not in operations["GET /api/rentals/"]["responses"]


def test_what_django_refuses_before_a_view_answers_is_json_under_api_and_a_page_elsewhere(
        api, alice):
    response = api.get("/api/nodes/not-a-number/x/")
    assert (response.status_code, response.json()) == (404, {"detail": "Not found."})
    assert api.get("/no-such-page/")["Content-Type"].startswith("text/html")

    _, token = personal_token_create(user=alice, name="ci")
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    too_big = b'{"name": "' + b"x" * (4 * 1024 * 1024) + b'"}'
    response = api.post("/api/keys/", too_big, content_type="application/json")
    assert response.status_code == 413
    assert response.json() == {"detail": "The body is over the limit of 4 MB."}
    too_many = "&".join(f"field{i}=1" for i in range(1001))
    response = api.post("/api/keys/", too_many, content_type="application/x-www-form-urlencoded")
    assert response.status_code == 400
    assert response.json() == {"detail": "The body has too many fields or files."}
