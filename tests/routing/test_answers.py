"""Answers look the same whichever engine wrote them: OpenAI's fields only, streamed or not."""

import json

import httpx
import pytest

from routing.answers import normalize
from routing.models import Deployment
from routing.pool import POOL
from tests.routing.conftest import MODEL

pytestmark = pytest.mark.django_db(transaction=True)

ENGINES = ("rtx-pro-6000", "m4-max-llamacpp")  # vLLM, llama.cpp


def _shape(value):
    """The keys of an answer, all the way down; values stand as their JSON type."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_shape(v) for v in value[:1]]
    return type(value).__name__


def _paths(value, prefix=""):
    """Every key path in an answer: what a client's code may read."""
    if isinstance(value, dict):
        return {p for k, v in value.items() for p in {f"{prefix}.{k}"} | _paths(v, f"{prefix}.{k}")}
    if isinstance(value, list):
        return {p for v in value for p in _paths(v, prefix + "[]")}
    return set()


def _ask(v1, key, path, body):
    return httpx.post(f"{v1}{path}", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=30)


def _events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: {")]


@pytest.mark.parametrize("path,body", [
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/completions", {"prompt": "Once upon a time"}),
])
def test_both_engines_answer_in_one_shape(v1, engine, deploy, carol_key, settled, path, body):
    workers = {key: deploy(engine(key), key, capacity=100) for key in ENGINES}
    shapes, streams = {}, {}
    for key, worker in workers.items():
        # Only this engine may take the prompt now: the other's context cannot hold it.
        others = [w.pk for k, w in workers.items() if k != key]
        Deployment.objects.filter(pk__in=others).update(max_context=1)
        POOL.invalidate()
        answer = _ask(v1, carol_key, path, {"model": MODEL, "max_tokens": 3, **body})
        assert answer.headers["x-rigshare-worker"] == worker.worker_ref, key
        shapes[key] = _shape(answer.json())
        stream = _ask(v1, carol_key, path, {"model": MODEL, "max_tokens": 3, "stream": True,
                                            "stream_options": {"include_usage": True}, **body})
        assert stream.text.rstrip().endswith("data: [DONE]")
        streams[key] = set().union(*(_paths(e) for e in _events(stream)))
        Deployment.objects.filter(pk__in=others).update(max_context=32_768)
    vllm, llamacpp = ENGINES
    assert shapes[vllm] == shapes[llamacpp]
    assert "timings" not in shapes[llamacpp] and "system_fingerprint" not in shapes[llamacpp]
    # Streamed, the same fields: the engines differ only in whether the finish reason rides on
    # the last token's chunk (vLLM) or a chunk of its own (llama.cpp, and OpenAI).
    assert streams[vllm] == streams[llamacpp]
    assert not {p for p in streams[llamacpp] if "timings" in p or "fingerprint" in p}
    settled()


def test_normalize_keeps_openais_fields_and_drops_the_engines_own():
    llamacpp = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
                "system_fingerprint": "b6100-abc", "timings": {"prompt_n": 3},
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "Hi"}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    vllm = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "prompt_logprobs": None, "kv_transfer_params": None, "service_tier": None,
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                         "stop_reason": None,
                         "message": {"role": "assistant", "content": "Hi",
                                     "reasoning_content": None, "tool_calls": []}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                      "prompt_tokens_details": None}}
    assert normalize(llamacpp) == normalize(vllm) == {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                     "message": {"role": "assistant", "content": "Hi"}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    # What a model says in reasoning or tool calls is kept, from either engine.
    called = {"choices": [{"index": 0, "message": {
        "role": "assistant", "content": None, "reasoning_content": "think",
        "tool_calls": [{"id": "t", "type": "function"}]}}]}
    assert normalize(called)["choices"][0]["message"] == {
        "role": "assistant", "content": None, "reasoning_content": "think",
        "tool_calls": [{"id": "t", "type": "function"}]}
    # A stream's opening chunk: llama.cpp says content null, vLLM and OpenAI say "".
    opening = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}
    assert normalize(opening)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
