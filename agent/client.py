"""HTTP to the platform (enrol, heartbeat, job results) and to the local engine (its model
list)."""

import httpx

from agent import model_files

PLATFORM_TIMEOUT_S = 10.0
ENGINE_TIMEOUT_S = 5.0
MAX_STRING = 256  # the protocol's limit on every string
MAX_MODELS = 256
MAX_QUANTIZATION = 64  # the protocol's limit on a quantization name
# The protocol's bound on a context length: no engine serves more, so a larger figure is
# nonsense rather than a fact.
MAX_CONTEXT = 10_000_000
ENGINE_KINDS = ("vllm", "llama.cpp")


class Refused(Exception):
    """The platform said no (4xx other than a transient one): its message, one line."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Unavailable(Exception):
    """The platform could not be reached or failed (network error, 5xx): try again later."""


def enroll(client: httpx.Client, platform: str, body: dict) -> dict:
    reply = _post(client, f"{platform}/api/agent/enroll/", body, headers={})
    if not (isinstance(reply.get("credential"), str) and "node_id" in reply):
        raise Unavailable(f"unexpected enrolment reply: {str(reply)[:200]}")
    return reply


def heartbeat(client: httpx.Client, platform: str, credential: str, body: dict) -> dict:
    return _post(
        client,
        f"{platform}/api/agent/heartbeat/",
        body,
        headers={"Authorization": f"Bearer {credential}"},
    )


def post_job_result(client: httpx.Client, platform: str, credential: str, job_id,
                    body: dict) -> None:
    """POST /api/agent/jobs/<id>/result/; any 2xx means stored, whatever its body."""
    _post(
        client,
        f"{platform}/api/agent/jobs/{job_id}/result/",
        body,
        headers={"Authorization": f"Bearer {credential}"},
        want_object=False,
    )


def _post(client: httpx.Client, url: str, body: dict, headers: dict,
          want_object: bool = True) -> dict | None:
    try:
        response = client.post(url, json=body, headers=headers, timeout=PLATFORM_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise Unavailable(f"platform unreachable: {describe(exc)}") from None
    status = response.status_code
    if status >= 500 or status in (408, 429):
        raise Unavailable(f"platform answered HTTP {status}")
    if 300 <= status < 400:
        raise Refused(status, f"HTTP {status} redirect to {response.headers.get('location')}; "
                              "use that address as the platform URL")
    if status >= 400:
        raise Refused(status, platform_message(response))
    if not want_object:
        return None
    try:
        reply = response.json()
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        raise Unavailable(f"platform answered HTTP {status} without a JSON object")
    return reply


def platform_message(response: httpx.Response) -> str:
    """DRF's error body as one line: {"detail": "..."} or {"field": ["msg", ...], ...}."""
    try:
        body = response.json()
    except ValueError:
        body = response.text.strip()[:200] or f"HTTP {response.status_code}"
    if isinstance(body, dict) and isinstance(body.get("detail"), str):
        text = body["detail"]
    elif isinstance(body, dict):
        text = "; ".join(f"{field}: {_flatten(errors)}" for field, errors in body.items())
    else:
        text = str(body)
    return " ".join(text.split())


def _flatten(errors) -> str:
    if isinstance(errors, list):
        return " ".join(_flatten(e) for e in errors)
    if isinstance(errors, dict):  # nested serializers, e.g. {"gpus": {"0": {"uuid": [...]}}}
        return "; ".join(f"{key}: {_flatten(value)}" for key, value in errors.items())
    return str(errors)


def engine_status(client: httpx.Client, engine_url: str, *, engine_kind: str | None = None,
                  max_context: int | None = None, quantization: str | None = None,
                  headers: dict | None = None, model_paths: list[str] = ()) -> dict:
    """The heartbeat's engine part. Never raises: an engine that does not answer is reported
    (reachable false, error why), it does not stop the heartbeat.

    `engine_kind`, `max_context` and `quantization` are the provider's word (`run`'s flags)
    for what the engine leaves unsaid; what the engine itself says, once checked, wins.
    `headers`: the engine key, for an engine started with one. `model_paths`: the model files
    or directories the engine was started with (its argv), where its files are read first."""
    status = {"url": engine_url, "reachable": False, "models": [], "served": [], "error": None}
    try:
        response = client.get(f"{engine_url}/v1/models", timeout=ENGINE_TIMEOUT_S,
                              headers=headers)
    except httpx.HTTPError as exc:
        status["error"] = describe(exc)[:MAX_STRING]
        return status
    if response.status_code != 200:
        status["error"] = f"GET /v1/models answered HTTP {response.status_code}"
        return status
    try:
        data = response.json()["data"]
        ids = [entry["id"] for entry in data]
    except (ValueError, KeyError, TypeError):
        status["error"] = "GET /v1/models did not answer an OpenAI-style model list"
        return status
    served = {}
    for model_id, entry in zip(ids, data, strict=True):
        # An id the platform cannot store could never be routed to, and one listed twice
        # would make the platform refuse the whole heartbeat: skipping them keeps the rest.
        if _text(model_id, MAX_STRING) is None or model_id in served:
            continue
        served[model_id] = _served_model(model_id, entry, engine_kind=engine_kind,
                                         max_context=max_context, quantization=quantization)
        files = model_files.read(entry, paths=list(model_paths))
        if files:
            served[model_id]["files"] = files
        if len(served) == MAX_MODELS:
            break
    status["models"] = list(served)
    status["served"] = list(served.values())
    status["reachable"] = True
    return status


def _served_model(model_id: str, entry: dict, *, engine_kind: str | None,
                  max_context: int | None, quantization: str | None) -> dict:
    """One `served` item. Each engine answers /v1/models in its own shape (fleetsim/server.py
    imitates both): vLLM says its context (`max_model_len`) but never its quantization;
    llama-server says both in `meta` (`n_ctx` is the per-slot context a request must fit);
    llama-cpp-python's server (`owned_by` "me") and anything else say neither."""
    owned_by = entry.get("owned_by")
    meta = entry.get("meta") if isinstance(entry.get("meta"), dict) else {}
    if owned_by == "vllm":
        kind, context, quant = "vllm", entry.get("max_model_len"), None
    elif owned_by == "llamacpp":
        kind, context, quant = "llama.cpp", meta.get("n_ctx"), meta.get("ftype")
    else:
        kind = context = quant = None
    return {
        "id": model_id,
        "engine": kind or engine_kind or "",
        "max_context": valid_context(context) or max_context,
        "quantization": _text(quant, MAX_QUANTIZATION) or quantization or "",
    }


def valid_context(value) -> int | None:
    """`value` if it is a context length the protocol accepts, else None (unknown)."""
    if type(value) is int and 1 <= value <= MAX_CONTEXT:  # not bool, not "4096", not 4096.5
        return value
    return None


def _text(value, limit: int) -> str | None:
    """`value` if the platform would store it unchanged, else None: it refuses blank,
    overlong and NUL-bearing strings (PostgreSQL cannot hold a NUL) and trims the rest, so
    an untrimmed id would no longer name the engine's model."""
    if (isinstance(value, str) and value and value == value.strip() and len(value) <= limit
            and "\x00" not in value):
        return value
    return None


def describe(exc: Exception) -> str:
    detail = str(exc)
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
