"""/v1 through the official openai SDK and plain httpx, over fleetsim workers."""

import time

import httpx
import openai
import pytest

from billing.keys import api_key_revoke
from billing.models import Charge, Hold
from billing.pricing import token_cost_micros
from routing.models import RequestLog
from tests.routing.conftest import IN_PER_MTOK, MODEL, OUT_PER_MTOK

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = [{"role": "user", "content": "Say something about GPUs."}]


def sdk(v1: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=v1, api_key=key, max_retries=0, timeout=30)


def cost(prompt: int, completion: int) -> int:
    return token_cost_micros(input_per_mtok=IN_PER_MTOK, output_per_mtok=OUT_PER_MTOK,
                             prompt_tokens=prompt, completion_tokens=completion)


def test_models_lists_priced_models(v1, engine, deploy, carol_key):
    deploy(engine())
    listed = sdk(v1, carol_key).models.list()
    assert [m.id for m in listed.data] == [MODEL]
    assert listed.data[0].owned_by == "rigshare"


def test_a_model_is_retrieved_by_its_id(v1, engine, deploy, carol_key):
    deploy(engine(), max_context=40_960)
    client = sdk(v1, carol_key)
    found = client.models.retrieve(MODEL)
    # The context its verified worker holds (the model's own figure is 32,768).
    assert (found.id, found.owned_by, found.context_length) == (MODEL, "rigshare", 40_960)
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found"
    _error(httpx.get(f"{v1}/models/{MODEL}"), 401, "missing_api_key")
    _error(httpx.post(f"{v1}/models/{MODEL}", headers={"Authorization": f"Bearer {carol_key}"}),
           405, "method_not_allowed")


def test_chat_is_answered_billed_exactly_and_names_the_worker(v1, engine, deploy, carol_key,
                                                              carol, bob, settled):
    deployment = deploy(engine("rtx-pro-6000"), quantization="fp8")
    raw = sdk(v1, carol_key).chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=20)
    reply = raw.parse()
    assert reply.model == MODEL  # the engine's own id stays hidden
    assert reply.choices[0].message.content
    assert (reply.usage.completion_tokens, reply.choices[0].finish_reason) == (20, "length")
    assert raw.headers["x-rigshare-worker"] == f"deployment:{deployment.pk}"
    assert raw.headers["x-rigshare-engine"] == "vllm"
    assert raw.headers["x-rigshare-quantization"] == "fp8"
    settled()
    charge = Charge.objects.get()
    assert (charge.prompt_tokens, charge.completion_tokens, charge.estimated) == (
        reply.usage.prompt_tokens, 20, False)
    assert charge.cost_micros == cost(reply.usage.prompt_tokens, 20)
    assert (charge.user_id, charge.provider_id, charge.worker) == (
        carol.pk, bob.pk, f"node:{deployment.node_id}")
    assert charge.request_id == raw.headers["x-request-id"]
    assert Hold.objects.get().status == "settled"
    log = RequestLog.objects.get()
    assert (log.status, log.deployment_id, log.completion_tokens, log.stream) == (
        200, deployment.pk, 20, False)


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_passes_through_and_bills_the_engines_usage(v1, engine, deploy, carol_key,
                                                           include_usage, settled):
    deploy(engine())
    extra = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = list(sdk(v1, carol_key).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, stream=True, **extra))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert {c.model for c in chunks} == {MODEL}
    usage_chunks = [c for c in chunks if c.usage]
    # The proxy always asks the engine for usage; the client gets it only if it asked.
    assert len(usage_chunks) == (1 if include_usage else 0)
    settled()
    charge = Charge.objects.get()
    assert (charge.completion_tokens, charge.estimated) == (12, False)
    if include_usage:
        assert charge.prompt_tokens == usage_chunks[0].usage.prompt_tokens


def test_completions_streamed_and_not(v1, engine, deploy, carol_key, settled):
    deploy(engine("m4-max-llamacpp"))
    client = sdk(v1, carol_key)
    done = client.completions.create(model=MODEL, prompt="GPUs are", max_tokens=5)
    assert done.usage.completion_tokens == 5 and done.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="GPUs are", max_tokens=5, stream=True) if c.choices)
    assert streamed
    settled()
    assert sorted(Charge.objects.values_list("completion_tokens", flat=True)) == [5, 5]


# --- errors, in OpenAI's shape ---

def _error(response: httpx.Response, status: int, code: str | None, param=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["message"]
    if param:
        assert error["param"] == param
    return error


def post(v1, key, body, path="/chat/completions", **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(v1 + path, json=body, headers=headers, timeout=30, **kwargs)


def test_bad_requests_are_400_and_cost_nothing(v1, engine, deploy, carol_key, settled):
    deploy(engine())
    cases = [
        ({"messages": CHAT}, "model"),
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
         "messages[0].role"),
        ({"model": MODEL, "messages": CHAT, "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "messages": CHAT, "max_tokens": "ten"}, "max_tokens"),
        ({"model": MODEL, "messages": CHAT, "n": 2}, "n"),
        ({"model": MODEL, "messages": CHAT, "stream": "yes"}, "stream"),
        ({"model": MODEL, "messages": CHAT, "stream_options": {"include_usage": True}},
         "stream_options"),
        # OpenAI's ranges: an engine would take a temperature of 3 and stream noise, billed
        ({"model": MODEL, "messages": CHAT, "temperature": 2.5}, "temperature",
         "decimal_above_max_value"),
        ({"model": MODEL, "messages": CHAT, "temperature": -0.1}, "temperature",
         "decimal_below_min_value"),
        ({"model": MODEL, "messages": CHAT, "temperature": "hot"}, "temperature", "invalid_type"),
        ({"model": MODEL, "messages": CHAT, "top_p": 1.5}, "top_p", "decimal_above_max_value"),
        ({"model": MODEL, "messages": CHAT, "presence_penalty": -3}, "presence_penalty",
         "decimal_below_min_value"),
        ({"model": MODEL, "messages": CHAT, "frequency_penalty": 2.01}, "frequency_penalty",
         "decimal_above_max_value"),
    ]
    for body, param, *code in cases:
        _error(post(v1, carol_key, body), 400, code[0] if code else None, param)
    not_json = httpx.post(v1 + "/chat/completions", content=b"{nope",
                          headers={"Authorization": f"Bearer {carol_key}"})
    _error(not_json, 400, None)
    deep = b'{"model": "%s", "messages": ' % MODEL.encode() + b"[" * 50_000 + b"]" * 50_000 \
        + b"}"
    _error(httpx.post(v1 + "/chat/completions", content=deep,
                      headers={"Authorization": f"Bearer {carol_key}"}), 400, None)
    _error(post(v1, carol_key, {"model": MODEL, "prompt": ["a", "b"]}, "/completions"), 400,
           None, "prompt")
    settled()
    assert not Hold.objects.exists() and not Charge.objects.exists()
    # The ends of every range are fine.
    fine = post(v1, carol_key, {"model": MODEL, "messages": CHAT, "max_tokens": 5,
                                "temperature": 2, "top_p": 0, "presence_penalty": -2})
    assert fine.status_code == 200, fine.text
    settled()


def test_keys_are_checked_first(v1, engine, deploy, carol, carol_key):
    deploy(engine())
    _error(post(v1, None, {"model": MODEL, "messages": CHAT}), 401, "missing_api_key")
    _error(post(v1, "rs_abc_def", {"model": MODEL, "messages": CHAT}), 401, "invalid_api_key")
    # An unknown model is not revealed before the key is checked.
    _error(post(v1, "rs_abc_def", {"model": "nope", "messages": CHAT}), 401, "invalid_api_key")
    _error(httpx.get(v1 + "/models"), 401, "missing_api_key")
    from billing.models import ApiKey

    api_key_revoke(user=carol, key_id=ApiKey.objects.get(user=carol).pk)
    _error(post(v1, carol_key, {"model": MODEL, "messages": CHAT}), 401, "invalid_api_key")


def test_unknown_model_is_404_and_wrong_paths_and_methods_are_json(v1, engine, deploy,
                                                                   carol_key):
    deploy(engine())
    _error(post(v1, carol_key, {"model": "gpt-9", "messages": CHAT}), 404, "model_not_found",
           "model")
    _error(httpx.get(v1 + "/chat/completions", headers={"Authorization": f"Bearer {carol_key}"}),
           405, "method_not_allowed")
    _error(httpx.get(v1 + "/embeddings"), 404, "unknown_url")


@pytest.mark.parametrize("method", ["POST", "GET", "PUT", "PATCH", "DELETE", "OPTIONS"])
def test_every_v1_path_answers_openai_json_even_to_a_browser_session(v1, method, carol):
    """A logged-in browser (a session cookie, no CSRF token) and the SDK alike: no HTML, no
    CSRF page, whatever the path or method."""
    from django.test import Client

    browser = Client()
    browser.force_login(carol)
    cookies = {k: v.value for k, v in browser.cookies.items()}
    for path in ("/embeddings", "/responses", "/audio/speech", "/images/generations",
                 "/chat/completions/x", "/", ""):
        response = httpx.request(method, v1 + path, json={"input": "x"}, cookies=cookies)
        assert response.headers["content-type"].startswith("application/json"), (path, method)
        if method != "OPTIONS":
            assert set(response.json()["error"]) >= {"message", "type", "code"}, (path, method)


def test_a_trailing_slash_names_the_same_endpoint(v1, engine, deploy, carol_key):
    deploy(engine())
    response = post(v1, carol_key, {"model": MODEL, "messages": CHAT, "max_tokens": 4},
                    path="/chat/completions/")
    assert response.status_code == 200 and response.json()["choices"]
    listed = httpx.get(v1 + "/models/", headers={"Authorization": f"Bearer {carol_key}"})
    assert [m["id"] for m in listed.json()["data"]] == [MODEL]


def test_no_credit_is_402_and_the_started_attempt_is_abandoned(v1, engine, deploy, mallory,
                                                                settled):
    """The reserve runs while the first upstream request is sent: a refusal closes it, so the
    engine stops at once and the client gets the 402, never a token."""
    from billing.keys import api_key_create
    from tests.routing.test_failures import _running

    url = engine("rtx-pro-6000", time_scale=1)  # 2,000 tokens would take ~20 s
    deploy(url)
    _, key = api_key_create(user=mallory, name="broke", spend_limit_micros=10**12,
                            by_operator=True)
    for stream in (False, True):
        started = time.monotonic()
        _error(post(v1, key, {"model": MODEL, "messages": CHAT, "max_tokens": 2000,
                              "stream": stream}), 402, "insufficient_quota")
        assert time.monotonic() - started < 5
    settled()
    deadline = time.monotonic() + 5
    while _running(httpx.get(url + "/metrics").text) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(httpx.get(url + "/metrics").text) == 0
    assert not Charge.objects.exists() and not Hold.objects.exists()


def test_a_nul_in_a_model_name_costs_no_log_row_its_own_or_anothers(v1, engine, deploy,
                                                                      carol_key, settled):
    deploy(engine())
    bad = post(v1, carol_key, {"model": "qwen\u0000evil", "messages": CHAT})
    assert bad.status_code == 404
    assert post(v1, carol_key, {"model": MODEL, "messages": CHAT, "max_tokens": 5}
                ).status_code == 200
    settled()
    assert sorted(RequestLog.objects.values_list("model", flat=True)) == [
        MODEL, "qwen\ufffdevil"]


def test_a_row_the_database_refuses_costs_the_others_nothing():
    from django.utils import timezone

    from routing import requestlog

    row = dict(created_at=timezone.now(), endpoint="chat", model=MODEL, status=200, attempts=1,
               latency_ms=12.5)
    requestlog.write([dict(row, request_id="good-1"), dict(row, request_id="bad", error_code="x"
                      * 500), dict(row, request_id="good-2")])
    assert sorted(RequestLog.objects.values_list("request_id", flat=True)) == ["good-1",
                                                                               "good-2"]


def test_other_paths_still_go_through_django(v1):
    base = v1.removesuffix("/v1")
    assert httpx.get(base + "/healthz").json() == {"status": "ok"}
    assert httpx.get(base + "/").status_code == 200  # the catalog page, with its middleware


def test_no_worker_is_503_and_a_prompt_too_long_for_every_worker_is_400(v1, engine, deploy,
                                                                        carol_key):
    _error(post(v1, carol_key, {"model": MODEL, "messages": CHAT}), 503, "no_capacity")
    deploy(engine("rtx-4090"), max_context=4096)
    from routing.pool import POOL

    POOL.invalidate()
    long = [{"role": "user", "content": "word " * 4000}]
    _error(post(v1, carol_key, {"model": MODEL, "messages": long, "max_tokens": 100}), 400,
           "context_length_exceeded")
    assert post(v1, carol_key, {"model": MODEL, "messages": CHAT, "max_tokens": 5}
                ).status_code == 200


def test_a_body_too_large_is_413_in_openais_shape(v1, carol_key):
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]}
    _error(post(v1, carol_key, huge), 413, "request_too_large")


def test_key_limits_are_429_and_403_in_openais_shape(v1, engine, deploy, carol, fund):
    from billing.keys import api_key_create

    deploy(engine())
    fund(carol, 10_000_000)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 5}
    _, one_a_minute = api_key_create(user=carol, name="slow", requests_per_minute=1)
    assert post(v1, one_a_minute, body).status_code == 200
    _error(post(v1, one_a_minute, body), 429, "rate_limit_exceeded")
    _, capped = api_key_create(user=carol, name="capped", spend_limit_micros=1,
                               spend_period="daily")
    _error(post(v1, capped, body), 429, "key_limit_reached")
    _, other_model = api_key_create(user=carol, name="other", allowed_models=["gpt-x"])
    _error(post(v1, other_model, body), 403, "model_not_allowed")
