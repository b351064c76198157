"""The OpenAI request shape the /v1 endpoints accept: pure, no I/O. What they answer when
they refuse: routing/errors.py.

Requests are checked as far as routing and billing need (model, messages or prompt, token
bounds, streaming options); everything else passes through to the engine, which checks it
the way it always does, and its 4xx comes back to the client.
"""

import json
import math
from dataclasses import dataclass

from routing.errors import (
    MAX_BODY_BYTES,
    ApiError,
    ErrorCode,
    InvalidRequest,
    RequestTooLarge,
)

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# Sampling parameters and the ranges OpenAI accepts: outside them it answers 400, and so do we
# (an engine may take a temperature of 50 and stream noise that the client pays for).
SAMPLING_RANGES = {"temperature": (0, 2), "top_p": (0, 1), "presence_penalty": (-2, 2),
                   "frequency_penalty": (-2, 2)}


@dataclass(frozen=True)
class InferenceRequest:
    """A checked request: what routing and billing read, and the body to send upstream."""

    endpoint: str  # "chat" or "completions"
    model: str
    body: dict  # the client's body, as sent; max_tokens is filled in upstream when missing
    stream: bool
    include_usage: bool  # the client asked for the usage chunk
    max_tokens: int | None  # None: the client left it to us
    max_tokens_param: str  # where the client put it (max_completion_tokens or max_tokens)
    prompt_tokens: int  # an estimate from the text (the engine's count is billed)


def parse(raw: bytes, endpoint: str) -> InferenceRequest:
    if len(raw) > MAX_BODY_BYTES:
        raise RequestTooLarge()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest("The body must be a JSON object: we could not parse it as "
                             "JSON.") from None
    except RecursionError:  # the decoder gives up at the interpreter's depth, not at the end
        raise InvalidRequest("The body is nested too deeply to be a request.") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise InvalidRequest("You must provide a model parameter.", "model")
    if endpoint == "chat":
        prompt_bytes, parts = _messages(body.get("messages"))
    else:
        prompt_bytes, parts = _prompt(body.get("prompt"))
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean.", "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise InvalidRequest("'stream_options' is only allowed when 'stream' is true.",
                                 "stream_options")
        if not isinstance(options, dict):
            raise InvalidRequest("'stream_options' must be an object.", "stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise InvalidRequest("'stream_options.include_usage' must be a boolean.",
                                 "stream_options.include_usage")
    _sampling(body)
    n = body.get("n", 1)
    if n is not None and (not _is_int(n) or n != 1):
        raise InvalidRequest("Only n=1 is supported.", "n")
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = body.get(param)
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise InvalidRequest(f"'{param}' must be an integer of at least 1.", param)
    return InferenceRequest(endpoint, model, body, stream, include_usage, max_tokens, param,
                            prompt_tokens_estimate(prompt_bytes, parts))


def prompt_tokens_estimate(text_bytes: int, parts: int) -> int:
    """Generous on purpose (tokenizers average ~4 bytes of English per token): the estimate
    sizes the hold and picks workers whose context fits; the engine's count is what is billed.
    Each message adds its chat-template markers."""
    return math.ceil(text_bytes / 3) + 8 * parts + 8


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sampling(body: dict) -> None:
    for name, (low, high) in SAMPLING_RANGES.items():
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise InvalidRequest(f"Invalid type for '{name}': expected a number, but got "
                                 f"{type(value).__name__} instead.", name,
                                 code=ErrorCode.INVALID_TYPE)
        if value > high:
            raise InvalidRequest(f"Invalid '{name}': decimal above maximum value. Expected a "
                                 f"value <= {high}, but got {value} instead.", name,
                                 code=ErrorCode.DECIMAL_ABOVE_MAX_VALUE)
        if value < low:
            raise InvalidRequest(f"Invalid '{name}': decimal below minimum value. Expected a "
                                 f"value >= {low}, but got {value} instead.", name,
                                 code=ErrorCode.DECIMAL_BELOW_MIN_VALUE)


def _messages(messages) -> tuple[int, int]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array.", "messages")
    size = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object.", f"messages[{i}]")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}.",
                                 f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, str):
            size += len(content.encode())
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise InvalidRequest(f"messages[{i}].content[{j}] must be a text part "
                                         "({\"type\": \"text\", \"text\": ...}).",
                                         f"messages[{i}].content")
                size += len(part["text"].encode())
        elif content is None and role == "assistant" and message.get("tool_calls"):
            size += len(json.dumps(message["tool_calls"]).encode())
        else:
            raise InvalidRequest(f"messages[{i}].content must be a string or an array of text "
                                 "parts.", f"messages[{i}].content")
    return size, len(messages)


def _prompt(prompt) -> tuple[int, int]:
    if isinstance(prompt, str):
        return len(prompt.encode()), 1
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return len(prompt[0].encode()), 1
    if isinstance(prompt, list) and prompt:
        raise InvalidRequest("Only one prompt per request is supported.", "prompt")
    raise InvalidRequest("'prompt' must be a non-empty string.", "prompt")


def upstream_body(request: InferenceRequest, *, engine_model: str, max_tokens: int) -> bytes:
    """The body for the engine: its own model id, a completion bound (the hold covers exactly
    it), and the usage chunk asked for on every stream, since billing reads it."""
    body = dict(request.body)
    body["model"] = engine_model
    body.pop("max_completion_tokens", None)
    body["max_tokens"] = max_tokens
    if request.stream:
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return json.dumps(body, separators=(",", ":")).encode()


# What engines say when a prompt does not fit their context (vLLM, llama.cpp, llama-cpp-python).
CONTEXT_MARKERS = ("context length", "context_length", "maximum context", "exceed_context",
                   "exceeds the available context", "n_ctx", "context window")


def is_context_rejection(status: int, body: bytes) -> bool:
    if status not in (400, 413, 422):
        return False
    text = body[:4096].decode("utf-8", "replace").lower()
    return any(marker in text for marker in CONTEXT_MARKERS)


def engine_error(status: int, body: bytes) -> ApiError:
    """An engine's 4xx, in OpenAI's shape whatever shape it came in."""
    message = ""
    try:
        data = json.loads(body)
        err = data.get("error", data) if isinstance(data, dict) else {}
        if isinstance(err, dict):
            message = str(err.get("message") or err.get("detail") or "")
        elif isinstance(err, str):
            message = err
        if not message and isinstance(data, dict) and "detail" in data:
            message = json.dumps(data["detail"])[:1000]
    except ValueError:
        message = body[:500].decode("utf-8", "replace")
    return ApiError(message or f"The engine refused the request (HTTP {status}).",
                    code=ErrorCode.ENGINE_REJECTED, status=status if 400 <= status < 500 else 502)
