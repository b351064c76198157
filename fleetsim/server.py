"""One simulated machine's OpenAI-compatible engine server, as a raw ASGI app.

Shapes follow vLLM's OpenAI server or llama.cpp's llama-server, per the profile's engine, so a
platform-side load test, the proxy and the agent cannot tell them from the real thing:
same routes, same chunk layout, same usage chunk rules, same metric names.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import uvicorn

from fleetsim.engine import Engine, Request
from fleetsim.profiles import Profile
from fleetsim.tokenizer import chat_prompt_tokens, detokenize_piece, filler_tokens, tokenize
from marketplace import model_data, modelmath

DEFAULT_MAX_TOKENS = 256
MAX_BODY_BYTES = 32 * 1024 * 1024
# Both engines write compact JSON (pydantic, nlohmann); byte counts then match theirs.
_COMPACT = (",", ":")
# What `system_fingerprint` says on llama-server: its build number and commit.
LLAMACPP_BUILD = "b6500-fleetsim"
# Draft tokens a speculative step proposes (the multi-token-prediction head's three).
SPEC_DRAFT_TOKENS = 3


class BadRequest(Exception):
    """Answered as an OpenAI-style error body; never a 500."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _bearer_is(scope, key: str) -> bool:
    given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
    return hmac.compare_digest(given, f"Bearer {key}".encode())


class _ClientGone(Exception):
    """The client disconnected before we answered: there is no one to answer."""


class EngineServer:
    """ASGI app for one simulated machine.

    time_scale divides every delay (tests run 10-100x faster than the card); die_after_tokens
    drops each streamed response's connection after that many tokens, like a crashed worker;
    max_concurrency overrides the profile's (tests use it to queue with few requests);
    prompt_tokens_details is vLLM's --enable-prompt-tokens-details: a vLLM profile's usage then
    says how many prompt tokens came from its prefix cache (`cached_tokens`). api_key is vLLM's
    and llama-server's --api-key: every /v1 request must carry it (`Authorization: Bearer`),
    as the engine key the platform hands a node's engine (marketplace/engine_keys.py).
    """

    def __init__(self, profile: Profile, *, time_scale: float = 1.0,
                 die_after_tokens: int | None = None, max_concurrency: int | None = None,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS,
                 prompt_tokens_details: bool = False, api_key: str | None = None):
        self.profile = profile
        self.api_key = api_key
        if die_after_tokens is not None and die_after_tokens < 1:
            raise ValueError("die_after_tokens must be at least 1")
        self.engine = Engine(profile, time_scale=time_scale, max_concurrency=max_concurrency)
        self.die_after_tokens = die_after_tokens
        self.default_max_tokens = default_max_tokens
        self.started = int(time.time())
        self.is_vllm = profile.engine == "vllm"
        self.prompt_tokens_details = prompt_tokens_details
        if os.environ.get("HF_HUB_CACHE"):  # where the simulated machines keep their models
            write_checkpoint(profile, Path(os.environ["HF_HUB_CACHE"]))

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        try:
            await self._route(scope, receive, send)
        except BadRequest as exc:
            await _send_json(send, exc.status, exc.body())
        except _ClientGone:
            pass

    async def _route(self, scope, receive, send):
        method, path = scope["method"], scope["path"]
        routes = {
            "/v1/models": ("GET", self._models),
            "/health": ("GET", self._health),
            "/metrics": ("GET", self._metrics),
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/completions": ("POST", self._completions),
            "/fleetsim/speed": ("POST", self._speed),
        }
        if path not in routes:
            raise BadRequest(404, f"Not found: {path}", type_="not_found_error")
        want, handler = routes[path]
        if self.api_key and path.startswith("/v1/") and not _bearer_is(scope, self.api_key):
            await _send_json(send, 401, {"error": "Unauthorized"})  # vLLM's answer
            return
        if method != want:
            raise BadRequest(405, f"Method {method} not allowed on {path}")
        if method == "GET":
            await handler(send)
        else:
            await handler(await _read_json(receive), receive, send)

    # --- GET endpoints ---

    async def _models(self, send):
        p = self.profile
        entry: dict[str, Any] = {"id": p.model, "object": "model", "created": self.started}
        if self.is_vllm:
            entry |= {
                "owned_by": "vllm", "root": p.checkpoint, "parent": None,
                "max_model_len": p.context_length,
                "permission": [{
                    "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                    "created": self.started, "allow_create_engine": False,
                    "allow_sampling": True, "allow_logprobs": True,
                    "allow_search_indices": False, "allow_view": True,
                    "allow_fine_tuning": False, "organization": "*", "group": None,
                    "is_blocking": False,
                }],
            }
        else:
            # llama-server's extra `meta` block: per-slot and trained context, size of the
            # GGUF (27B at Q4_K_M).
            entry |= {"owned_by": "llamacpp", "aliases": [p.model], "tags": [],
                      "meta": {"vocab_type": 2, "n_ctx": p.context_length,
                               "ftype": p.quantization} | _gguf_meta(p)}
        await _send_json(send, 200, {"object": "list", "data": [entry]})

    async def _health(self, send):
        if self.is_vllm:  # vLLM answers an empty 200
            await _send(send, 200, b"", "text/plain; charset=utf-8")
        else:
            await _send_json(send, 200, {"status": "ok"})

    async def _metrics(self, send):
        text = _vllm_metrics(self) if self.is_vllm else _llamacpp_metrics(self)
        await _send(send, 200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    # --- generation ---

    async def _speed(self, body, receive, send):
        """The simulator's control, not an engine's: from now on serve at `factor` of the
        profile's speed (a machine that swaps in a slower engine after it was verified)."""
        factor = body.get("factor")
        if not isinstance(factor, int | float) or not 0 < factor <= 10:
            raise BadRequest(400, "factor must be a number in (0, 10]")
        self.engine.speed = float(factor)
        await _send_json(send, 200, {"speed": self.engine.speed})

    async def _chat(self, body, receive, send):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(_valid_message(m) for m in messages):
            raise BadRequest(400, "'messages' must be a non-empty list of {role, content} objects.",
                             param="messages")
        max_tokens = body.get("max_completion_tokens")  # the newer name wins, as on OpenAI
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        await self._generate(body, receive, send, chat_prompt_tokens(messages), max_tokens,
                             chat=True)

    async def _completions(self, body, receive, send):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            tokens = tokenize(prompt)
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            tokens = [f"<{t}>" for t in prompt]  # token ids: one token each
        else:
            raise BadRequest(400, "'prompt' must be a string or a list of token ids "
                             "(fleetsim serves one prompt per request).", param="prompt")
        if not tokens:
            raise BadRequest(400, "The prompt is empty.", param="prompt")
        await self._generate(body, receive, send, tokens, body.get("max_tokens"), chat=False)

    def _check(self, body: dict, prompt_tokens: list[str], max_tokens, chat: bool) -> int:
        p = self.profile
        model = body.get("model")
        # llama-server serves whatever it loaded and ignores the name; vLLM checks it.
        if self.is_vllm and model is not None and model != p.model:
            raise BadRequest(404, f"The model `{model}` does not exist.", param="model",
                             code="model_not_found")
        if body.get("n") not in (None, 1):
            raise BadRequest(400, "fleetsim serves n=1 only.", param="n")
        if not isinstance(body.get("stream", False), bool):
            raise BadRequest(400, "'stream' must be a boolean.", param="stream")
        options = body.get("stream_options")
        if options is not None:
            if not body.get("stream"):
                raise BadRequest(400, "Stream options can only be defined when `stream=True`.",
                                 param="stream_options")
            if not isinstance(options, dict):
                raise BadRequest(400, "'stream_options' must be an object.", param="stream_options")
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
            raise BadRequest(400, "'max_tokens' must be a positive integer.", param="max_tokens")
        n_prompt = len(prompt_tokens)
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, max(p.context_length - n_prompt, 1))
        if n_prompt + max_tokens > p.context_length:
            where = "messages" if chat else "prompt"
            if self.is_vllm:
                message = (
                    f"This model's maximum context length is {p.context_length} tokens. "
                    f"However, you requested {n_prompt + max_tokens} tokens ({n_prompt} in the "
                    f"{where}, {max_tokens} in the completion). Please reduce the length of the "
                    f"{where} or completion."
                )
            else:
                message = ("the request exceeds the available context size, try increasing it "
                           f"(n_prompt_tokens={n_prompt}, max_tokens={max_tokens}, "
                           f"n_ctx={p.context_length})")
            raise BadRequest(400, message, param=where, code="context_length_exceeded")
        return max_tokens

    async def _generate(self, body, receive, send, prompt_tokens, max_tokens, *, chat: bool):
        max_tokens = self._check(body, prompt_tokens, max_tokens, chat)
        req = Request(prompt_tokens=prompt_tokens, max_tokens=max_tokens)
        output = filler_tokens(max_tokens)
        reply = _Reply(self, req, chat)
        stream = body.get("stream", False)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        # A client that goes away must free its slot or queue place at once, as vLLM aborts
        # the request; uvicorn tells us through receive(), so watch it beside the generation.
        handler = asyncio.current_task()
        gone = False

        async def watch_disconnect():
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            handler.cancel()

        watcher = asyncio.create_task(watch_disconnect())
        try:
            async with contextlib.aclosing(self.engine.generate(req, output)) as batches:
                if stream:
                    await self._stream(send, batches, reply, include_usage)
                else:
                    async for _ in batches:
                        pass
                    await _send_json(send, 200, reply.full(output))
        except asyncio.CancelledError:
            if not gone:
                raise
        finally:
            watcher.cancel()

    async def _stream(self, send, batches, reply: _Reply, include_usage: bool):
        if self.is_vllm:
            # vLLM returns its StreamingResponse once the request is validated, so status and
            # headers leave before the request is scheduled or prefilled; the body (the role
            # chunk first) starts with the first token. A client can tell that a request at
            # the full context length was accepted without waiting out its prefill.
            await _start_event_stream(send)
        sent = 0
        async for batch in batches:
            if sent == 0:
                if not self.is_vllm:
                    # llama-server's stream is modelled as starting with its first result: a
                    # request waiting for a slot or in prefill has sent nothing yet.
                    await _start_event_stream(send)
                events = [reply.first_chunk()]
            else:
                events = []
            if self.die_after_tokens is not None and sent + len(batch) >= self.die_after_tokens:
                batch = batch[: self.die_after_tokens - sent]
                events += [reply.token_chunk(t, sent + i) for i, t in enumerate(batch)]
                await send({"type": "http.response.body", "body": _sse(events), "more_body": True})
                # Returning before the body is complete makes uvicorn close the connection
                # mid-stream: the client sees a truncated chunked response, as from a crash.
                return
            events += [reply.token_chunk(t, sent + i) for i, t in enumerate(batch)]
            sent += len(batch)
            await send({"type": "http.response.body", "body": _sse(events), "more_body": True})
        tail = reply.final_chunks(include_usage)
        await send({"type": "http.response.body", "body": _sse(tail) + b"data: [DONE]\n\n"})


class _Reply:
    """Builds response bodies and chunks in the profile engine's dialect."""

    def __init__(self, server: EngineServer, req: Request, chat: bool):
        self.server, self.req, self.chat = server, req, chat
        self.vllm = server.is_vllm
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        base = {"id": self.id, "object": obj, "created": self.created,
                "model": self.server.profile.model}
        if not self.vllm:
            base["system_fingerprint"] = LLAMACPP_BUILD
        return base

    def usage(self) -> dict:
        n_prompt = len(self.req.prompt_tokens)
        usage = {"prompt_tokens": n_prompt, "total_tokens": n_prompt + self.req.emitted,
                 "completion_tokens": self.req.emitted}
        if self.vllm:
            usage["prompt_tokens_details"] = ({"cached_tokens": self.req.cached_tokens}
                                              if self.server.prompt_tokens_details else None)
        return usage

    def timings(self) -> dict:
        """llama-server's per-request timings, in the card's time (not the scaled time)."""
        r = self.req
        prompt_n = len(r.prompt_tokens) - r.cached_tokens
        prompt_ms = r.prefill_s * 1000
        loop_now = asyncio.get_running_loop().time()
        predicted_ms = (loop_now - r.decode_started) * self.server.engine.time_scale * 1000
        return {
            "cache_n": r.cached_tokens,
            "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / max(prompt_n, 1),
            "prompt_per_second": prompt_n / (prompt_ms / 1000) if prompt_ms else 0.0,
            "predicted_n": r.emitted, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / max(r.emitted, 1),
            "predicted_per_second": r.emitted / (predicted_ms / 1000) if predicted_ms else 0.0,
        }

    def full(self, output: list[str]) -> dict:
        text = "".join(detokenize_piece(t, i == 0) for i, t in enumerate(output))
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": "length"}
            if self.vllm:
                choice["message"] |= {"reasoning_content": None, "tool_calls": []}
                choice |= {"logprobs": None, "stop_reason": None}
            body = self._base("chat.completion") | {"choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
            if self.vllm:
                choice["stop_reason"] = None
            body = self._base("text_completion") | {"choices": [choice]}
        body["usage"] = self.usage()
        if not self.vllm:
            body["timings"] = self.timings()
        return body

    def _chunk(self, choice: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._base(obj) | {"choices": [choice]}

    def first_chunk(self) -> dict | None:
        """The role chunk that opens a chat stream (none for completions)."""
        if not self.chat:
            return None
        delta = {"role": "assistant", "content": "" if self.vllm else None}
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        if self.vllm:
            choice["logprobs"] = None
        return self._chunk(choice)

    def token_chunk(self, token: str, position: int) -> dict:
        piece = detokenize_piece(token, position == 0)
        # vLLM puts finish_reason on the last token's chunk; llama-server sends a separate
        # empty-delta chunk for it (see final_chunks).
        last = self.vllm and position == self.req.max_tokens - 1
        finish = "length" if last else None
        if self.chat:
            choice = {"index": 0, "delta": {"content": piece}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece, "finish_reason": finish}
        if self.vllm:
            choice["logprobs"] = None
            if not self.chat or last:
                choice["stop_reason"] = None
        return self._chunk(choice)

    def final_chunks(self, include_usage: bool) -> list[dict]:
        chunks = []
        if not self.vllm:
            if self.chat:
                choice = {"index": 0, "delta": {}, "finish_reason": "length"}
            else:
                choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
            chunks.append(self._chunk(choice))
        if include_usage:
            # Both engines end an include_usage stream with one chunk: empty choices, usage.
            obj = "chat.completion.chunk" if self.chat else "text_completion"
            usage_chunk = self._base(obj) | {"choices": [], "usage": self.usage()}
            if not self.vllm:
                usage_chunk["timings"] = self.timings()
            chunks.append(usage_chunk)
        return chunks


def _valid_message(m) -> bool:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return False
    content = m.get("content")
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(part, dict) and isinstance(part.get("type"), str) for part in content)


async def _start_event_stream(send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
    ]})


def _sse(events: list[dict | None]) -> bytes:
    return b"".join(b"data: " + json.dumps(e, separators=_COMPACT).encode() + b"\n\n" for e in events if e is not None)


async def _read_json(receive) -> dict:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BadRequest(413, f"Request body larger than {MAX_BODY_BYTES} bytes.")
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    try:
        body = json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(400, f"Invalid JSON in request body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(400, "The request body must be a JSON object.")
    return body


async def _send(send, status: int, body: bytes, content_type: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _send_json(send, status: int, obj) -> None:
    await _send(send, status, json.dumps(obj, separators=_COMPACT).encode(), "application/json")


# --- /metrics -------------------------------------------------------------------------------

def _gguf_meta(p: Profile) -> dict:
    """llama-server's `meta` figures of the GGUF it loaded (none for a checkpoint fleetsim does
    not know)."""
    arch = model_data.architecture_for(p.checkpoint)
    weights = modelmath.weight_bytes(arch, p.quantization) if arch else None
    if arch is None or weights is None:
        return {}
    config = model_data.MODELS[model_data.canonical_name(p.checkpoint)]["config"]
    return {"n_vocab": config.get("vocab_size"), "n_ctx_train": arch.max_context,
            "n_embd": arch.hidden_size, "n_params": int(arch.params), "size": int(weights)}


def write_checkpoint(p: Profile, hub_cache: Path) -> Path | None:
    """The checkpoint the engine loaded, as a Hugging Face cache entry in `hub_cache`: its
    config.json and one weights file of its size (sparse: it takes no disk), where the node
    agent reads a model's size from (agent/model_files.py). None for a checkpoint fleetsim
    does not know, or a GGUF (llama-server says its size itself)."""
    name = model_data.canonical_name(p.checkpoint)
    arch = model_data.architecture_for(p.checkpoint)
    weights = modelmath.weight_bytes(arch, p.quantization) if arch else None
    if name is None or weights is None or "/" not in p.checkpoint or p.engine != "vllm":
        return None
    org, model = p.checkpoint.split("/", 1)
    snapshot = hub_cache / f"models--{org}--{model}" / "snapshots" / f"fleetsim-{p.quantization}"
    snapshot.mkdir(parents=True, exist_ok=True)
    config = dict(model_data.MODELS[name]["config"])
    (snapshot / "config.json").write_text(json.dumps(config))
    with open(snapshot / "model.safetensors", "ab") as f:
        f.truncate(int(weights))
    return snapshot


def _vllm_metrics(server: EngineServer) -> str:
    """vLLM v1 names (FACTS.md: kv_cache_usage_perc and prefix_cache_* replaced the gpu_*
    names). prometheus_client writes a counter `x` as `# TYPE x counter` plus a sample named
    `x_total`, so that is what appears here too."""
    e, c = server.engine, server.engine.counters
    labels = f'{{engine="0",model_name="{server.profile.model}"}}'
    gauges = [
        ("vllm:num_requests_running", "Number of requests in model execution batches.",
         len(e.running)),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
         len(e.waiting)),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kv_usage),
    ]
    counters = [
        ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
         c.prefix_queries),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
         c.prefix_hits),
        ("vllm:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens),
        ("vllm:generation_tokens", "Number of generation tokens processed.", c.generation_tokens),
    ]
    per_pass = server.profile.tokens_per_pass
    if per_pass:
        # Speculative decoding (vLLM's spec_decode_* counters): one draft a pass over the
        # weights, its accepted tokens the ones beyond the first.
        drafts = round(c.generation_tokens / per_pass)
        counters += [
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", drafts),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
             drafts * SPEC_DRAFT_TOKENS),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
             c.generation_tokens - drafts),
        ]
    lines = []
    for name, help_, value in gauges:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name}{labels} {float(value)}"]
    for name, help_, value in counters:
        lines += [f"# HELP {name}_total {help_}", f"# TYPE {name} counter",
                  f"{name}_total{labels} {float(value)}"]
    return "\n".join(lines) + "\n"


def _llamacpp_metrics(server: EngineServer) -> str:
    """llama-server's /metrics (served with --metrics): unlabelled samples."""
    e, c = server.engine, server.engine.counters
    metrics = [
        ("counter", "prompt_tokens_total", "Number of prompt tokens processed.", c.prompt_tokens),
        ("counter", "prompt_seconds_total", "Prompt process time", c.prompt_seconds),
        ("counter", "tokens_predicted_total", "Number of generation tokens processed.",
         c.generation_tokens),
        ("counter", "tokens_predicted_seconds_total", "Predict process time", c.decode_seconds),
        ("gauge", "kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.", e.kv_usage),
        ("gauge", "kv_cache_tokens", "KV-cache tokens.", e.kv_tokens_in_use),
        ("gauge", "requests_processing", "Number of requests processing.", len(e.running)),
        ("gauge", "requests_deferred", "Number of requests deferred.", len(e.waiting)),
    ]
    lines = []
    for kind, name, help_, value in metrics:
        lines += [f"# HELP llamacpp:{name} {help_}", f"# TYPE llamacpp:{name} {kind}",
                  f"llamacpp:{name} {value:g}" if isinstance(value, float) else f"llamacpp:{name} {value}"]
    return "\n".join(lines) + "\n"


# --- running servers --------------------------------------------------------------------------

class ServerThread:
    """Runs an ASGI app under uvicorn on a background thread; for tests and benchmarks.

        with ServerThread(EngineServer(get_profile("h200"), time_scale=50)) as srv:
            httpx.get(srv.url + "/v1/models")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.app = app
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = ""

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("fleetsim engine server did not start")
            time.sleep(0.005)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
