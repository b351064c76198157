"""The engine's answer as the client gets it: OpenAI's fields only, the same whichever engine
wrote it (pure, no I/O).

vLLM and llama.cpp each add fields of their own: llama.cpp its `timings` and a
`system_fingerprint` that names its build, vLLM `stop_reason`, `prompt_logprobs`,
`kv_transfer_params`, empty `tool_calls` and null `reasoning_content`. A client could tell the
engines apart by them, and code written against one engine's extras would break on the other.
So an answer keeps OpenAI's documented fields and drops the rest; the engine a request went to
is said once, in the X-Rigshare-Engine header."""

import re

# OpenAI's fields of a completion object, chunk, choice, message or delta, and usage.
_TOP = frozenset({"id", "object", "created", "model", "choices", "usage"})
_CHOICE = frozenset({"index", "message", "delta", "text", "logprobs", "finish_reason"})
_MESSAGE = frozenset({"role", "content", "refusal", "tool_calls", "function_call",
                      "annotations", "audio", "reasoning_content"})
_USAGE = frozenset({"prompt_tokens", "completion_tokens", "total_tokens",
                    "prompt_tokens_details", "completion_tokens_details"})

# An engine-specific field in a streamed event: only such events are parsed and rewritten, the
# others pass as bytes (a vLLM chat stream's token chunks carry none of them). One regex
# search (~1.3 µs a chunk) rather than a test per marker (~3.9 µs).
_ENGINE_FIELDS = re.compile(
    rb'"(?:system_fingerprint|stop_reason|timings|token_ids|prompt_logprobs|kv_transfer_params'
    rb'|service_tier)"|"(?:reasoning_content|content)": ?null|"tool_calls": ?\[\]')


def needs_normalizing(event: bytes) -> bool:
    return _ENGINE_FIELDS.search(event) is not None


def _message(message: dict, *, delta: bool) -> dict:
    out = {k: v for k, v in message.items() if k in _MESSAGE and v is not None and v != []}
    if delta and "role" in out and "content" not in out:
        out["content"] = ""  # a stream's opening chunk, as OpenAI sends it
    if not delta:
        out.setdefault("content", None)
    return out


def _choice(choice: dict) -> dict:
    out = {k: v for k, v in choice.items() if k in _CHOICE}
    for key in ("message", "delta"):
        if isinstance(out.get(key), dict):
            out[key] = _message(out[key], delta=key == "delta")
    out.setdefault("logprobs", None)
    out.setdefault("finish_reason", None)
    return out


def normalize(answer: dict) -> dict:
    """A completion, chat completion or one of their stream chunks, with OpenAI's fields
    only."""
    out = {k: v for k, v in answer.items() if k in _TOP}
    if isinstance(out.get("choices"), list):
        out["choices"] = [_choice(c) if isinstance(c, dict) else c for c in out["choices"]]
    usage = out.get("usage")
    if isinstance(usage, dict):
        out["usage"] = {k: v for k, v in usage.items() if k in _USAGE and v is not None}
    return out
