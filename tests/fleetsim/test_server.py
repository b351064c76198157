"""The engine server's OpenAI surface, as vLLM and llama-server shape it."""

import pytest

from fleetsim.profiles import PLANTED_FLEET, get_profile
from fleetsim.tokenizer import chat_prompt_tokens, tokenize
from tests.fleetsim.sse import read_events, stream_text

MODEL = get_profile("h200").model
FAST = 200  # time_scale: a 64-token answer on an H200 takes ~2 ms


def chat(content="Hello there, how are you?", **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def test_models_vllm(engine, client):
    url, _ = engine("h200", time_scale=FAST)
    body = client.get(url + "/v1/models").json()
    assert body["object"] == "list"
    (entry,) = body["data"]
    assert entry["id"] == MODEL and entry["object"] == "model"
    assert entry["owned_by"] == "vllm"
    assert entry["max_model_len"] == get_profile("h200").context_length


def test_models_llamacpp(engine, client):
    url, _ = engine("m4-max-llamacpp", time_scale=FAST)
    (entry,) = client.get(url + "/v1/models").json()["data"]
    assert entry["owned_by"] == "llamacpp"
    assert entry["meta"]["n_ctx"] == get_profile("m4-max-llamacpp").context_length


def test_health(engine, client):
    for key in ("h200", "m4-max-llamacpp"):
        url, _ = engine(key, time_scale=FAST)
        assert client.get(url + "/health").status_code == 200


@pytest.mark.parametrize("key", ["h200", "m4-max-llamacpp"])
def test_chat_non_streamed(engine, client, key):
    url, _ = engine(key, time_scale=FAST)
    r = client.post(url + "/v1/chat/completions", json=chat(max_tokens=7))
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    text = choice["message"]["content"]
    assert len(tokenize(text)) == 7
    usage = body["usage"]
    assert usage["completion_tokens"] == 7
    # ChatML: <|im_start|> user, 7 tokens of content, <|im_end|>, <|im_start|> assistant.
    assert usage["prompt_tokens"] == 2 + 7 + 1 + 2
    assert usage["total_tokens"] == usage["prompt_tokens"] + 7


def test_completions_non_streamed(engine, client):
    url, _ = engine("h200", time_scale=FAST)
    r = client.post(url + "/v1/completions", json={"model": MODEL, "prompt": "One two three.",
                                                   "max_tokens": 5})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert len(tokenize(body["choices"][0]["text"])) == 5
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9,
                             "prompt_tokens_details": None}


def test_prompt_tokens_details_say_what_the_prefix_cache_held(engine, client):
    url, _ = engine("h200", time_scale=FAST, prompt_tokens_details=True)
    prompt = "Compare these cards for serving a long conversation. " * 20
    first = client.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                       "max_tokens": 2}).json()["usage"]
    again = client.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                       "max_tokens": 2}).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert again["prompt_tokens"] - 16 <= cached < again["prompt_tokens"]


def test_default_max_tokens(engine, client):
    url, _ = engine("h200", time_scale=FAST, default_max_tokens=9)
    body = client.post(url + "/v1/chat/completions", json=chat()).json()
    assert body["usage"]["completion_tokens"] == 9


@pytest.mark.parametrize("key", ["h200", "m4-max-llamacpp"])
@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_stream(engine, client, key, include_usage):
    url, _ = engine(key, time_scale=FAST)
    payload = chat(max_tokens=6, stream=True)
    if include_usage:
        payload["stream_options"] = {"include_usage": True}
    with client.stream("POST", url + "/v1/chat/completions", json=payload) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events, done = read_events(r)
    assert done
    assert {e["id"] for e in events} == {events[0]["id"]}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    with_choices = [e for e in events if e["choices"]]
    finishes = [e["choices"][0]["finish_reason"] for e in with_choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    emitted = len(tokenize(stream_text(events)))
    assert emitted == 6
    usage_chunks = [e for e in events if "usage" in e and e["usage"]]
    if include_usage:
        # One final chunk with empty choices carries the usage, as vLLM sends it.
        assert events[-1]["choices"] == [] and usage_chunks == [events[-1]]
        usage = events[-1]["usage"]
        assert usage["completion_tokens"] == emitted
        assert usage["total_tokens"] == usage["prompt_tokens"] + emitted
    else:
        assert usage_chunks == [] and all(e["choices"] for e in events)


@pytest.mark.parametrize("key", ["h200", "m4-max-llamacpp"])
def test_completions_stream(engine, client, key):
    url, _ = engine(key, time_scale=FAST)
    payload = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "stream": True,
               "stream_options": {"include_usage": True}}
    with client.stream("POST", url + "/v1/completions", json=payload) as r:
        events, done = read_events(r)
    assert done
    assert all(e["object"] == "text_completion" for e in events)
    assert len(tokenize(stream_text(events))) == 5
    assert events[-1]["usage"] == events[-1]["usage"] | {"prompt_tokens": 4,
                                                         "completion_tokens": 5}


def test_follow_up_turn_reproduces_the_answer_tokens(engine, client):
    """The reply, sent back in the next turn, tokenizes to what the engine emitted, so the
    second prompt starts with the first prompt plus the answer (the prefix cache relies on it)."""
    url, _ = engine("h200", time_scale=FAST)
    first = client.post(url + "/v1/chat/completions", json=chat(max_tokens=20)).json()
    answer = first["choices"][0]["message"]["content"]
    messages = [{"role": "user", "content": "Hello there, how are you?"},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "More."}]
    second = client.post(url + "/v1/chat/completions",
                         json={"model": MODEL, "messages": messages, "max_tokens": 1}).json()
    first_turn = chat_prompt_tokens(messages[:1]) + tokenize(answer)
    assert len(first_turn) == first["usage"]["total_tokens"]
    assert chat_prompt_tokens(messages)[: len(first_turn)] == first_turn
    # ... then <|im_end|>, <|im_start|> user More . <|im_end|>, <|im_start|> assistant.
    assert second["usage"]["prompt_tokens"] == len(first_turn) + 8


# --- errors ------------------------------------------------------------------------------------

def assert_openai_error(r, status, param=None, code=None):
    assert r.status_code == status
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def test_context_length_exceeded(engine, client):
    url, _ = engine("2x-rtx-4090", time_scale=5000)  # 65,536 tokens; 65k to prefill
    prompt = "word " * 65_000
    r = client.post(url + "/v1/chat/completions", json=chat(prompt, max_tokens=1000))
    error = assert_openai_error(r, 400, "messages", "context_length_exceeded")
    assert error["type"] == "invalid_request_error"
    assert "maximum context length is 65536 tokens" in error["message"]
    # Just inside the limit is served.
    r = client.post(url + "/v1/completions",
                    json={"model": MODEL, "prompt": "word " * 65_000, "max_tokens": 536})
    assert r.status_code == 200
    r = client.post(url + "/v1/completions",
                    json={"model": MODEL, "prompt": "word " * 65_000, "max_tokens": 537})
    assert_openai_error(r, 400, "prompt", "context_length_exceeded")


def test_context_length_exceeded_llamacpp(engine, client):
    url, _ = engine("m4-max-llamacpp", time_scale=FAST)
    r = client.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 40_000})
    assert_openai_error(r, 400, "prompt", "context_length_exceeded")


@pytest.mark.parametrize(("path", "content"), [
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", b"\xff\xfe"),
    ("/v1/chat/completions", b"[1, 2]"),
    ("/v1/completions", b""),
])
def test_bad_json_is_an_openai_400(engine, client, path, content):
    url, _ = engine("h200", time_scale=FAST)
    r = client.post(url + path, content=content, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


@pytest.mark.parametrize("payload", [
    {"model": MODEL},
    {"model": MODEL, "messages": []},
    {"model": MODEL, "messages": "hello"},
    {"model": MODEL, "messages": [{"content": "no role"}]},
    {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
])
def test_bad_messages(engine, client, payload):
    url, _ = engine("h200", time_scale=FAST)
    assert_openai_error(client.post(url + "/v1/chat/completions", json=payload), 400, "messages")


@pytest.mark.parametrize(("payload", "param"), [
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_tokens="ten"), "max_tokens"),
    (chat(stream_options={"include_usage": True}), "stream_options"),
    (chat(n=2), "n"),
])
def test_bad_parameters(engine, client, payload, param):
    url, _ = engine("h200", time_scale=FAST)
    assert_openai_error(client.post(url + "/v1/chat/completions", json=payload), 400, param)


def test_bad_prompt(engine, client):
    url, _ = engine("h200", time_scale=FAST)
    for prompt in (None, 5, ["a", "b"], []):
        r = client.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt})
        assert_openai_error(r, 400, "prompt")


def test_token_id_prompt(engine, client):
    url, _ = engine("h200", time_scale=FAST)
    r = client.post(url + "/v1/completions",
                    json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
    assert r.json()["usage"]["prompt_tokens"] == 3


def test_wrong_model_is_404_on_vllm(engine, client):
    url, _ = engine("h200", time_scale=FAST)
    r = client.post(url + "/v1/chat/completions", json=chat() | {"model": "gpt-4"})
    assert_openai_error(r, 404, "model", "model_not_found")


def test_llamacpp_serves_whatever_model_name(engine, client):
    """llama-server ignores the requested name and answers with the model it loaded."""
    url, _ = engine("m4-max-llamacpp", time_scale=FAST)
    r = client.post(url + "/v1/chat/completions", json=chat(max_tokens=1) | {"model": "gpt-4"})
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_unknown_route_and_method(engine, client):
    url, _ = engine("h200", time_scale=FAST)
    assert_openai_error(client.get(url + "/v1/embeddings"), 404)
    assert_openai_error(client.get(url + "/v1/chat/completions"), 405)


# --- metrics -------------------------------------------------------------------------------

def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


def test_vllm_metrics(engine, client):
    url, _ = engine("h200", time_scale=FAST)
    client.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 4})
    text = client.get(url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        assert f"# TYPE {name} gauge" in text
        assert f'{name}{{engine="0",model_name="{MODEL}"}}' in text
    for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens",
                 "vllm:generation_tokens"):
        assert f"# TYPE {name} counter" in text
    assert metric(text, "vllm:prompt_tokens_total") == 3
    assert metric(text, "vllm:generation_tokens_total") == 4
    assert metric(text, "vllm:prefix_cache_queries_total") == 3
    assert metric(text, "vllm:num_requests_running") == 0


def test_llamacpp_metrics(engine, client):
    url, _ = engine("m4-max-llamacpp", time_scale=FAST)
    client.post(url + "/v1/completions", json={"prompt": "a b c", "max_tokens": 4})
    text = client.get(url + "/metrics").text
    for name in ("requests_processing", "requests_deferred", "kv_cache_tokens",
                 "prompt_tokens_total", "tokens_predicted_total"):
        assert f"\nllamacpp:{name} " in text
    assert "model_name" not in text  # llama-server's samples carry no labels
    assert metric(text, "llamacpp:prompt_tokens_total") == 3
    assert metric(text, "llamacpp:tokens_predicted_total") == 4


@pytest.mark.parametrize("key", PLANTED_FLEET)
def test_every_planted_machine_serves_its_profile(engine, client, key):
    p = get_profile(key)
    url, app = engine(key, time_scale=FAST)
    assert app.engine.max_concurrency == p.max_concurrency
    (entry,) = client.get(url + "/v1/models").json()["data"]
    assert entry["id"] == p.model
    if p.engine == "vllm":
        assert entry["max_model_len"] == p.context_length
    r = client.post(url + "/v1/completions", json={"model": p.model, "prompt": "a b", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
