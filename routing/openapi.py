"""/v1 in the OpenAPI schema beside the REST API, so the docs' Authorize button offers the API
key and a client generator sees the inference endpoints.

/v1 is not DRF: its views are async functions reached through routing.asgi, so
drf-spectacular cannot read them. This postprocessing hook (SPECTACULAR_SETTINGS) writes their
operations from the same facts the views check: routing.openai's sampling ranges and roles,
routing.errors' codes."""

from routing.errors import ErrorCode
from routing.openai import ROLES, SAMPLING_RANGES

SCHEME = "apiKey"
TAG = "inference (OpenAI-compatible)"


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _error(description: str, *codes: ErrorCode) -> dict:
    listed = ", ".join(f"`{c.value}`" for c in codes)
    return {"description": f"{description} (`error.code`: {listed})" if codes else description,
            "content": {"application/json": {"schema": _ref("OpenAIError")}}}


ERRORS = {
    "400": _error("The request is malformed or a value is out of range",
                  ErrorCode.CONTEXT_LENGTH_EXCEEDED),
    "401": _error("No API key, or one that is unknown or revoked", ErrorCode.MISSING_API_KEY,
                  ErrorCode.INVALID_API_KEY),
    "402": _error("The balance cannot cover the request's worst case"),
    "403": _error("The key may not use this model", ErrorCode.MODEL_NOT_ALLOWED),
    "404": _error("No such model", ErrorCode.MODEL_NOT_FOUND),
    "413": _error("The body is larger than the API takes"),
    "429": _error("The key's rate limit or spend limit is reached",
                  ErrorCode.RATE_LIMIT_EXCEEDED, ErrorCode.KEY_LIMIT_REACHED),
    "502": _error("The worker failed before answering", ErrorCode.UPSTREAM_ERROR),
    "503": _error("No verified worker can take it now, or a service is away; see Retry-After",
                  ErrorCode.NO_CAPACITY, ErrorCode.SERVICE_UNAVAILABLE),
}

_SAMPLING = {name: {"type": "number", "minimum": low, "maximum": high}
             for name, (low, high) in SAMPLING_RANGES.items()}
_COMMON = {
    "model": {"type": "string", "description": "A model id from GET /v1/models."},
    "max_tokens": {"type": "integer", "minimum": 1},
    "stream": {"type": "boolean", "default": False},
    "stream_options": {"type": "object",
                       "properties": {"include_usage": {"type": "boolean"}}},
    "n": {"type": "integer", "enum": [1]},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "seed": {"type": "integer"},
    "user": {"type": "string", "description": "Also the affinity key: the follow-ups of one "
                                              "user go to the worker that holds their cache."},
    **_SAMPLING,
}

SCHEMAS = {
    "OpenAIError": {
        "type": "object", "required": ["error"],
        "properties": {"error": {
            "type": "object", "required": ["message", "type", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": "string", "nullable": True},
                           "code": {"type": "string", "nullable": True,
                                    "enum": [c.value for c in ErrorCode] + [None]}}}}},
    "Model": {
        "type": "object", "required": ["id", "object", "created", "owned_by"],
        "additionalProperties": True,
        "properties": {"id": {"type": "string"}, "object": {"type": "string", "enum": ["model"]},
                       "created": {"type": "integer"}, "owned_by": {"type": "string"},
                       "context_length": {"type": "integer"}}},
    "ModelList": {"type": "object", "required": ["object", "data"],
                  "properties": {"object": {"type": "string", "enum": ["list"]},
                                 "data": {"type": "array", "items": _ref("Model")}}},
    "ChatMessage": {
        "type": "object", "required": ["role"],
        "properties": {"role": {"type": "string", "enum": sorted(ROLES)},
                       "content": {"oneOf": [{"type": "string"},
                                             {"type": "array", "items": {"type": "object"}}],
                                   "nullable": True}}},
    "ChatCompletionRequest": {
        "type": "object", "required": ["model", "messages"],
        "properties": {"messages": {"type": "array", "minItems": 1,
                                    "items": _ref("ChatMessage")},
                       "max_completion_tokens": {"type": "integer", "minimum": 1},
                       **_COMMON}},
    "CompletionRequest": {
        "type": "object", "required": ["model", "prompt"],
        "properties": {"prompt": {"oneOf": [{"type": "string"},
                                            {"type": "array", "items": {"type": "string"}}]},
                       **_COMMON}},
    "Usage": {"type": "object",
              "properties": {"prompt_tokens": {"type": "integer"},
                             "completion_tokens": {"type": "integer"},
                             "total_tokens": {"type": "integer"}}},
    "Completion": {
        "type": "object", "required": ["id", "object", "model", "choices"],
        "additionalProperties": True,
        "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                       "created": {"type": "integer"}, "model": {"type": "string"},
                       "choices": {"type": "array", "items": {"type": "object"}},
                       "usage": _ref("Usage")}},
}

_STREAM = {"text/event-stream": {"schema": {
    "type": "string", "description": "Server-sent events, each `data:` a chunk object, the "
                                     "last `data: [DONE]`."}}}


def _operation(operation_id: str, summary: str, description: str, *,
               request: str | None = None, response: str, errors: tuple[str, ...],
               stream: bool = False) -> dict:
    responses = {"200": {"description": "OK", "content": {
        "application/json": {"schema": _ref(response)}, **(_STREAM if stream else {})}}}
    responses.update({status: ERRORS[status] for status in errors})
    operation = {"operationId": operation_id, "tags": [TAG], "summary": summary,
                 "description": description,
                 "security": [{SCHEME: []}], "responses": responses}
    if request:
        operation["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": _ref(request)}}}
    return operation


_INFERENCE_ERRORS = ("400", "401", "402", "403", "404", "413", "429", "502", "503")
_ROUTED = ("Routed to a verified worker by measured capacity, to the worker that holds the "
           "conversation's cache where it can take it, never to one whose context cannot hold "
           "the prompt. The response says which: X-Rigshare-Worker, X-Rigshare-Affinity.")

PATHS = {
    "/v1/models": {"get": _operation(
        "v1_models_list", "List models", "The models the fleet serves, with their prices.",
        response="ModelList", errors=("401", "503"))},
    "/v1/models/{model}": {"get": {
        **_operation("v1_models_retrieve", "Retrieve a model", "One model as GET /v1/models lists it.",
                     response="Model", errors=("401", "404", "503")),
        "parameters": [{"name": "model", "in": "path", "required": True,
                        "schema": {"type": "string"}}]}},
    "/v1/chat/completions": {"post": _operation(
        "v1_chat_completions_create", "Create a chat completion", _ROUTED, request="ChatCompletionRequest",
        response="Completion", errors=_INFERENCE_ERRORS, stream=True)},
    "/v1/completions": {"post": _operation(
        "v1_completions_create", "Create a completion", _ROUTED, request="CompletionRequest", response="Completion",
        errors=_INFERENCE_ERRORS, stream=True)},
}


def add_v1(result, generator, request, public):
    """drf-spectacular postprocessing hook: /v1's operations, schemas and API-key scheme."""
    result.setdefault("paths", {}).update(PATHS)
    components = result.setdefault("components", {})
    components.setdefault("schemas", {}).update(SCHEMAS)
    components.setdefault("securitySchemes", {})[SCHEME] = {
        "type": "http", "scheme": "bearer", "bearerFormat": "rs_<id>_<secret>",
        "description": "An API key from Billing → API keys; it spends the account's credit."}
    tags = result.setdefault("tags", [])
    if not any(t.get("name") == TAG for t in tags):
        tags.append({"name": TAG, "description": "The OpenAI-compatible API at /v1: any "
                                                 "OpenAI SDK works with base_url=<site>/v1."})
    return result
