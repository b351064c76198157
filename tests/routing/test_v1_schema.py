"""/v1 answers as the OpenAPI schema says: schemathesis sends each /v1 operation requests drawn
from the schema, valid and invalid, through the real server (uvicorn, the ASGI front) to a
fleetsim engine, with a real API key. Every answer must be a documented status, in the
documented content type and shape, and never a 5xx that the schema does not name."""

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.routing.conftest import MODEL

pytestmark = pytest.mark.django_db(transaction=True)

CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]


def test_v1_answers_as_its_schema_says(v1, engine, deploy, carol_key, settled, subtests):
    deploy(engine())
    base = v1.removesuffix("/v1")
    config = schemathesis.Config.from_dict({"cache": {"enabled": False}})
    schema = schemathesis.openapi.from_url(f"{base}/api/schema/?format=json", config=config)
    operations = [op for result in schema.get_all_operations()
                  if (op := result.ok()).path.startswith("/v1/")]
    assert len(operations) == 4
    headers = {"Authorization": f"Bearer {carol_key}"}
    known = {"/v1/models/{model}": {"model": MODEL}}
    for operation in operations:
        strategies = [operation.as_strategy(mode, headers=headers)
                      for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
        if operation.path in known:
            strategies.append(operation.as_strategy(
                GenerationMode.POSITIVE, headers=headers, path_parameters=known[operation.path]))
        if operation.method.upper() == "POST":  # a request that is served, not refused
            prompt = ({"messages": [{"role": "user", "content": "hi"}]}
                      if "chat" in operation.path else {"prompt": "hi"})
            strategies.append(operation.as_strategy(
                GenerationMode.POSITIVE, headers=headers, media_type="application/json",
                body={"model": MODEL, "max_tokens": 4, **prompt}))
        with subtests.test(operation=operation.label):
            @given(case=st.one_of(strategies))
            @settings(max_examples=12, derandomize=True, database=None, deadline=None,
                      phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            def call(case):
                response = case.call(base_url=base, timeout=30)
                case.validate_response(response, checks=CHECKS)
                assert response.status_code < 500 or response.status_code in (502, 503)
                if response.status_code >= 400:
                    assert set(response.json()["error"]) >= {"message", "type", "code"}

            call()
    settled()
