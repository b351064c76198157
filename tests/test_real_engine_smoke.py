"""Ground truth from a real engine: llama-cpp-python 0.3.36's server with SmolLM2-135M-Instruct.

What the routing proxy relies on (usage, streaming shape, context-length rejections) is
asserted here against the real thing, so a fake engine in other tests can copy it faithfully.
The engine is not optional: `make test` installs it, and a missing engine fails these tests.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.engine import ALIAS, ENGINE_AVAILABLE, NOT_INSTALLED, gguf_path, llama_server_fixture

pytestmark = pytest.mark.real_engine

N_CTX = 512
engine = llama_server_fixture(n_ctx=N_CTX)

QUESTION = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "seed": 42, "max_tokens": 16}
CONTEXT_MESSAGE = re.compile(
    r"This model's maximum context length is (\d+) tokens\. However, you requested (\d+) "
    r"tokens \((\d+) in the messages, (\d+) in the completion\)\. Please reduce the length "
    r"of the messages or completion\."
)


def words(n: int) -> list[dict]:
    """A user turn of n words; with the chat template's default system turn, n + 31 tokens."""
    return [{"role": "user", "content": "word " * n}]


@pytest.fixture
def client(engine):
    # One connection pool per test: the server drops the connection after a failed stream.
    with httpx.Client(base_url=engine, timeout=60) as client:
        yield client


def chat(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/chat/completions", json=body)


def sse_data(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an event stream, in order."""
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_engine_is_installed():
    assert ENGINE_AVAILABLE, NOT_INSTALLED
    assert gguf_path().stat().st_size > 50_000_000


def test_models_lists_the_alias(client):
    response = client.get("/v1/models")
    assert response.status_code == 200
    assert response.json() == {
        "object": "list",
        "data": [{"id": ALIAS, "object": "model", "owned_by": "me", "permissions": []}],
    }


def test_chat_completion_reports_usage(client):
    response = chat(client, model=ALIAS, messages=QUESTION, **GREEDY)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == ALIAS
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    # 34 = the template's default system turn (~30 tokens) + the question.
    assert body["usage"] == {"prompt_tokens": 34, "completion_tokens": 16, "total_tokens": 50}


def test_model_name_is_not_checked(client):
    # One model per server: any name is served and echoed back; without one, the GGUF path.
    named = chat(client, model="no-such-model", messages=QUESTION, max_tokens=1)
    assert named.status_code == 200 and named.json()["model"] == "no-such-model"
    unnamed = chat(client, messages=QUESTION, max_tokens=1)
    assert unnamed.status_code == 200 and unnamed.json()["model"] == str(gguf_path())


def test_stream_has_no_usage_chunk_and_one_token_per_chunk(client):
    plain = chat(client, model=ALIAS, messages=QUESTION, **GREEDY).json()
    body = {"model": ALIAS, "messages": QUESTION, **GREEDY, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_data(response)

    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    # 0.3.36 ignores stream_options: no usage chunk, no `usage` key anywhere; count tokens.
    assert not any("usage" in c for c in chunks)
    # First a role-only chunk, last an empty delta carrying finish_reason, content between.
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    content = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert all(content) and all(c["choices"][0]["finish_reason"] is None for c in chunks[1:-1])
    # One token per content chunk (for plain ASCII text): chunks == completion_tokens.
    assert len(content) == plain["usage"]["completion_tokens"] == 16
    assert "".join(content) == plain["choices"][0]["message"]["content"]


def test_prompt_filling_the_context_is_rejected_with_400(client):
    response = chat(client, model=ALIAS, messages=words(600), max_tokens=16)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "messages"
    assert error["code"] == "context_length_exceeded"
    match = CONTEXT_MESSAGE.fullmatch(error["message"])
    assert match, error["message"]
    window, requested, prompt, completion = map(int, match.groups())
    assert (window, prompt, completion) == (N_CTX, 631, 16)
    assert requested == prompt + completion


def test_only_the_prompt_counts_against_the_context(client):
    # Rejected when prompt_tokens >= n_ctx, whatever max_tokens is.
    fits = chat(client, model=ALIAS, messages=words(N_CTX - 32), max_tokens=4)
    assert fits.status_code == 200
    assert fits.json()["usage"]["prompt_tokens"] == N_CTX - 1
    full = chat(client, model=ALIAS, messages=words(N_CTX - 31), max_tokens=4)
    assert full.status_code == 400
    assert "(512 in the messages, 4 in the completion)" in full.json()["error"]["message"]


def test_prompt_plus_max_tokens_over_the_context_is_clipped_not_rejected(client):
    # max_tokens is silently cut to n_ctx - prompt_tokens (min_tokens keeps EOS away).
    response = chat(client, model=ALIAS, messages=words(420), max_tokens=100, min_tokens=100,
                    temperature=0, seed=42)
    assert response.status_code == 200
    body = response.json()
    assert body["usage"]["prompt_tokens"] == 451
    assert body["usage"]["completion_tokens"] == N_CTX - 451
    assert body["usage"]["total_tokens"] == N_CTX
    assert body["choices"][0]["finish_reason"] == "length"


def test_streamed_prompt_over_the_context_is_an_empty_200(client):
    # The streamed rejection happens after the headers: HTTP 200, an event stream with no
    # event at all (no error, no [DONE]), and the server closes the connection.
    body = {"model": ALIAS, "messages": words(600), "max_tokens": 16, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.read() == b""
