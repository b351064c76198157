"""The streaming proxy: key -> model -> eligible workers (placement) -> ranked (balancer) ->
reserve -> the engine -> relay (sse) -> journal and settle (billing.usage, metering).

Bytes pass through as the engine sent them, cut only at event boundaries; only the headers
tell which engine answered. Retries and the circuit breaker follow routing/retry.py.
"""

import asyncio
import http.cookiejar
import json
import logging
import random
import time
from dataclasses import dataclass

import httpx
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.utils import timezone

from billing import metering
from billing import usage as usage_journal
from billing.keys import api_key_authenticate, api_key_cached
from marketplace.models import node_ref
from routing import (
    answers,
    balancer,
    calls,
    errors,
    followups,
    metrics,
    openai,
    placement,
    requestlog,
    sse,
    upstream,
)
from routing.pool import INFLIGHT, POOL, PoolUnavailable
from routing.pool import in_flight as pool_in_flight
from routing.retry import BREAKER, POLICY

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 1024  # when the client sets no bound (the hold must have one)

_clients: dict = {}
_background: set = set()


def _client() -> httpx.AsyncClient:
    """One connection pool per event loop (uvicorn has one; tests start several)."""
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        client = httpx.AsyncClient(
            transport=upstream.Transport(), headers={"accept-encoding": "identity"},
            timeout=httpx.Timeout(POLICY.read_timeout_s, connect=POLICY.connect_timeout_s),
            cookies=_NoCookies())
        _clients[loop] = client
    return client


class _NoCookies(http.cookiejar.CookieJar):
    """The client is shared by every consumer's requests: a cookie an engine sets must not
    travel with the next consumer's request (and keeping none skips the jar's work)."""

    def extract_cookies(self, response, request) -> None:
        pass


_urls: dict[str, httpx.URL] = {}


def _url(worker: placement.Worker, path: str) -> httpx.URL:
    """Parsed once per worker and path (httpx parses a string URL in Python each time)."""
    text = worker.url + path
    url = _urls.get(text)
    if url is None:
        if len(_urls) > 10_000:  # workers come and go
            _urls.clear()
        url = _urls[text] = httpx.URL(text)
    return url


def _spawn(coro) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


@dataclass
class Outcome:
    """What happened to one request: the log row and the metrics come from it."""

    request_id: str
    endpoint: str
    started: float
    stream: bool = False
    user_id: int | None = None
    key_id: int | None = None
    model: str = ""
    worker: placement.Worker | None = None
    status: int = 200
    error_code: str = ""
    attempts: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    estimated: bool = False
    ttft_s: float | None = None
    affinity: str = balancer.NEW  # hit, spill or new (routing/balancer.py)
    # (affinity key, the deployment its next turn goes to unless told): a turn served by
    # another is recorded for the next (routing/followups.py).
    follow: tuple[bytes, int | None] | None = None
    # Requests in flight to its worker while it ran, itself included: the most seen at any
    # moment from when it was sent to when it ended (routing/traffic.py judges its speed at
    # this concurrency). Requests from other server processes count as far as the last load
    # exchange knows them.
    concurrency: int | None = None
    # When its stream ended (its last event, a failure or the client gone): the request's
    # latency, and its decode time, end there, not after the billing that follows it.
    ended: float | None = None

    def in_flight(self) -> None:
        if self.worker is not None:
            now = pool_in_flight(self.worker.deployment_id)
            self.concurrency = max(self.concurrency or 0, now)

    def finish(self) -> None:
        self.in_flight()
        if self.follow is not None and self.status == 200 and self.worker is not None \
                and self.worker.deployment_id != self.follow[1]:
            followups.served(self.follow[0], self.worker.deployment_id)
        latency = (self.ended or time.perf_counter()) - self.started
        metrics.observe(self, latency)
        requestlog.add(self, latency)


def error_response(exc: errors.ApiError) -> JsonResponse:
    """An error in OpenAI's shape; a 503 or 429 says when to come back (Retry-After)."""
    response = JsonResponse(exc.body(), status=exc.status)
    if exc.status == 503:
        response["Retry-After"] = str(RETRY_AFTER_S)
    elif isinstance(exc, errors.MethodNotAllowed):
        response["Allow"] = exc.allowed
    elif exc.status == 429:
        response["Retry-After"] = str(60 - int(time.time()) % 60)  # the next minute's window
    return response


def _error(exc: errors.ApiError, outcome: Outcome) -> JsonResponse:
    outcome.status, outcome.error_code = exc.status, exc.code or exc.type
    outcome.finish()
    response = error_response(exc)
    response["X-Request-Id"] = outcome.request_id
    return response


RETRY_AFTER_S = 1


def unavailable() -> errors.ApiError:
    return errors.ServiceUnavailable("The service is briefly unable to take this request (a "
                                     "database or cache restarting); retry in a moment.")


def _bearer(header: str) -> str | None:
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def authenticate(authorization: str):
    token = _bearer(authorization)
    if token is None:
        raise errors.AuthenticationFailed("You didn't provide an API key: send it as "
                                          "'Authorization: Bearer rs_...'.",
                                          code=errors.ErrorCode.MISSING_API_KEY)
    found, key = await api_key_cached(token)
    if not found:
        key = await calls.run(api_key_authenticate, token)
    if key is None:
        raise errors.AuthenticationFailed("Incorrect API key provided, or the key was "
                                          "revoked.")
    return key


async def handle(*, endpoint: str, raw: bytes, authorization: str,
                 session: str | None = None) -> HttpResponse:
    """One /v1 inference request. `session`: the client's X-Session-ID, an affinity key."""
    # 128 random bits from `random` (seeded from os.urandom, again in a forked child): unique
    # as a uuid4, without a getrandom system call per request.
    outcome = Outcome(request_id=f"req-{random.getrandbits(128):032x}", endpoint=endpoint,
                      started=time.perf_counter())
    try:
        return await _handle(endpoint, raw, authorization, session, outcome)
    except Exception:
        # Whatever failed (the database or Redis away, a bug): the client gets OpenAI's shape
        # and a time to come back, the log gets the request id and the traceback.
        log.exception("%s failed before its response", outcome.request_id)
        return _error(unavailable(), outcome)


async def _handle(endpoint: str, raw: bytes, authorization: str, session: str | None,
                  outcome: Outcome) -> HttpResponse:
    try:
        key = await authenticate(authorization)
        outcome.user_id, outcome.key_id = key.user_id, key.key_id
        request = openai.parse(raw, endpoint)
        outcome.stream, outcome.model = request.stream, request.model
        snap = await pool()
        model = snap.models.get(request.model)
        if model is None:
            raise errors.NotFound(f"The model '{request.model}' does not exist.", "model",
                                  code=errors.ErrorCode.MODEL_NOT_FOUND)
        now = timezone.now()
        price = model.price_at(now)
        if price is None:
            raise errors.NotFound(f"The model '{request.model}' has no price yet.", "model",
                                  code=errors.ErrorCode.MODEL_NOT_FOUND)
        room = model.context_length - request.prompt_tokens
        max_tokens = request.max_tokens or max(1, min(DEFAULT_MAX_TOKENS, room))
        fleet = snap.workers.get(model.name, ())
        found = placement.eligible(fleet, user_id=key.user_id,
                                   context_needed=request.prompt_tokens + max_tokens,
                                   model_context=model.context_length,
                                   open_ids=BREAKER.open_ids())
        if isinstance(found, errors.ApiError):
            raise found
        affinity = balancer.affinity(request.body, request.endpoint, session)
        holder = await followups.holder(affinity.key) if affinity.follow_up else None
        placed = balancer.place(found, affinity, snap.sent_since(), POLICY.attempts,
                                holder=holder)
        candidates, outcome.affinity = list(placed.workers), placed.affinity
        # Where some worker could not take it (its circuit open, its context too small), the
        # ranking here is not the next turn's: whoever serves this one is recorded.
        outcome.follow = (affinity.key,
                          placed.expected if len(found) == len(fleet) else None)
        if key.allowed_models and model.name not in key.allowed_models:
            raise errors.PermissionDenied(f"This API key may not use '{model.name}'.",
                                          code=errors.ErrorCode.MODEL_NOT_ALLOWED)
        reserving = None
        # A renter's own card is paid for by the second (marketplace rentals): its tokens are
        # not billed again. Everything else holds the worst case before the first byte.
        if candidates[0].renter_id != key.user_id:
            max_cost = metering.max_cost_micros(price, prompt_tokens=request.prompt_tokens,
                                                max_tokens=max_tokens)
            reserving = calls.start(
                metering.reserve, key=key, model=model.name, price=price, max_cost=max_cost,
                request_id=outcome.request_id, tokens=request.prompt_tokens + max_tokens,
                now=now)
    except errors.ApiError as exc:
        return _error(exc, outcome)
    return await _proxy(request, model.name, max_tokens, candidates, reserving, outcome,
                        snap.version)


async def pool():
    try:
        return await POOL.current()
    except PoolUnavailable:
        raise errors.ServiceUnavailable("The service cannot read its worker pool right now; "
                                        "retry shortly.") from None


def _headers(response: HttpResponse, worker: placement.Worker, outcome: Outcome,
             version: str) -> HttpResponse:
    response["X-Request-Id"] = outcome.request_id
    response["X-Rigshare-Worker"] = worker.ref
    response["X-Rigshare-Engine"] = worker.engine or "unknown"
    response["X-Rigshare-Quantization"] = worker.quantization or "unknown"
    response["X-Rigshare-Pool-Version"] = version
    response["X-Rigshare-Affinity"] = outcome.affinity
    return response


class _Retry(Exception):
    """The worker failed before sending anything: the next one may try."""


class _Refused(Exception):
    """Metering refused the request (402, 429...): nothing may reach the client."""


async def _held(reserving) -> metering.HoldInfo | None:
    if reserving is None:
        return None
    try:
        # Shielded: a request cancelled here (the client left) must not cancel the reserve,
        # whose hold _settle_late then closes; the thread would make it all the same.
        return await asyncio.shield(reserving)
    except metering.MeteringError as exc:
        raise _Refused(errors.from_billing(exc)) from None


async def _proxy(request: openai.InferenceRequest, public_model: str, max_tokens: int,
                 candidates: list, reserving, outcome: Outcome, version: str) -> HttpResponse:
    """Reserve and the first upstream attempt run at once (the hold is known within a
    millisecond or two, the engine's first token takes longer): no byte reaches the client,
    and no usage is settled, before the hold exists. A refusal aborts the engine's request.

    A stream's request goes to the engine from this task, at once: as a task of its own it
    would wait for the event loop's next turn, behind a chunk of every stream being relayed.
    Its headers go to the client once the hold exists and the engine answered 200, as an
    engine sends its own before its first token: the client reads them while the engine
    reads the prompt, instead of after. That closes the retry window: connection errors, 5xx
    and context rejections come before an engine's 200 (and are retried on the next worker);
    an engine that dies after it is a stream cut before its first token. A request that is
    not streamed runs as a task beside the reserve, so that a refusal stops it early."""
    last_error = errors.NoCapacity("No worker could take this request; retry shortly.")
    path = "/v1/chat/completions" if request.endpoint == "chat" else "/v1/completions"
    hold = None
    for worker in candidates:
        outcome.attempts += 1
        outcome.worker = worker
        body = openai.upstream_body(request, engine_model=worker.engine_model,
                                    max_tokens=max_tokens)
        outcome.concurrency = None
        _slot_taken(worker, outcome)
        handed_over = False
        attempt = None  # what to stop if the request ends here: a task or an engine's stream
        try:
            if request.stream:
                attempt = await _open_stream(worker, path, body)
                if hold is None:
                    hold = await _held(reserving)
                state = sse.StreamState(request.include_usage,
                                        sse.model_patterns(worker.engine_model),
                                        sse.model_patterns(public_model))
                response = RelayResponse(_Relay(attempt, state, worker, hold, request,
                                                outcome))
                handed_over = True  # the relay gives the slot back when it closes
            else:
                attempt = asyncio.ensure_future(_fetch(worker, path, body))
                if hold is None:
                    hold = await _held(reserving)
                response = await _answer(await attempt, worker, public_model, hold, request,
                                         outcome)
            return _headers(response, worker, outcome, version)
        except _Retry as retry:
            last_error = retry.args[0]
        except _Refused as refused:
            await _abandon(attempt)
            return _error(refused.args[0], outcome)
        except errors.ApiError as exc:  # the engine refused the request itself (4xx)
            await _release(await _hold_once_known(hold, reserving, outcome.request_id))
            return _error(exc, outcome)
        except BaseException:
            # Cancelled (the client left) or a bug: nothing was delivered, but the engine
            # may have read the prompt; bill it, as a cut stream is.
            outcome.status, outcome.error_code = 499, "client_disconnected"
            _spawn(_abandon(attempt))
            _spawn(_settle_late(reserving, hold, request, worker, outcome))
            raise
        finally:
            if not handed_over:
                _slot_free(worker, outcome)
    await _release(await _hold_once_known(hold, reserving, outcome.request_id))
    return _error(last_error, outcome)


async def _hold_once_known(hold, reserving, request_id: str) -> metering.HoldInfo | None:
    """The hold to give back when no worker answered: the reserve may still be running."""
    if hold is not None or reserving is None:
        return hold
    try:
        return await asyncio.shield(reserving)  # as in _held
    except metering.MeteringError:  # refused: nothing is held
        return None
    except Exception:  # the database went away: a hold may exist all the same
        await calls.journal(usage_journal.release_later, request_id)
        raise


async def _abandon(attempt) -> None:
    """Stop an upstream attempt nobody will read: its connection is closed, the engine aborts."""
    if isinstance(attempt, asyncio.Future):
        if not attempt.done():
            attempt.cancel()
        try:
            attempt = await attempt
        except BaseException:  # cancelled, or it failed: nothing to close
            return
    if attempt is not None:
        await attempt.aclose()  # its connection is dropped


async def _settle_late(reserving, hold, request, worker, outcome) -> None:
    if hold is None and reserving is not None:
        try:
            hold = await reserving
        except metering.MeteringError:  # refused: nothing was held, nothing to bill
            outcome.finish()
            return
        except Exception:  # the database went away: a hold may exist all the same
            await calls.journal(usage_journal.release_later, outcome.request_id)
            outcome.finish()
            return
    await _settle(hold, metering.Usage(request.prompt_tokens, 0, estimated=True), worker,
                  outcome, finish=True)


# The requests this process has in flight per deployment: each one's concurrency rises to
# the most in flight while it runs, so that a stream sent first and ended last, alone at both
# ends, is still judged at the concurrency it decoded at.
RUNNING: dict[int, dict[int, Outcome]] = {}


def _slot_taken(worker: placement.Worker, outcome: Outcome) -> None:
    deployment = worker.deployment_id
    INFLIGHT[deployment] += 1
    running = RUNNING.setdefault(deployment, {})
    running[id(outcome)] = outcome
    now = pool_in_flight(deployment)
    for other in running.values():
        if (other.concurrency or 0) < now:
            other.concurrency = now


def _slot_free(worker: placement.Worker, outcome: Outcome) -> None:
    deployment = worker.deployment_id
    INFLIGHT[deployment] -= 1
    if INFLIGHT[deployment] <= 0:
        del INFLIGHT[deployment]
    running = RUNNING.get(deployment)
    if running is not None:
        running.pop(id(outcome), None)
        if not running:
            del RUNNING[deployment]


def _upstream_failed(worker: placement.Worker, message: str) -> _Retry:
    BREAKER.failure(worker.deployment_id)
    return _Retry(errors.UpstreamError(message))


async def _fetch(worker, path, body) -> httpx.Response:
    try:
        resp = await _client().post(_url(worker, path), content=body,
                                    headers={"content-type": "application/json",
                                             **worker.engine_headers},
                                    extensions=worker.tls_extensions)
    except httpx.HTTPError as exc:
        raise _upstream_failed(worker, f"The worker could not be reached "
                               f"({type(exc).__name__}).") from None
    _check_status(worker, resp.status_code, resp.content)
    return resp


async def _answer(resp, worker, public_model, hold, request, outcome) -> HttpResponse:
    BREAKER.success(worker.deployment_id)
    outcome.ttft_s = time.perf_counter() - outcome.started
    try:
        data = resp.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        await _settle(hold, metering.Usage(request.prompt_tokens, 0, estimated=True), worker,
                      outcome)
        raise errors.UpstreamError("The worker answered with a body that is not JSON.")
    data = answers.normalize(data)
    data["model"] = public_model
    usage = data.get("usage")
    try:
        billed = metering.Usage(int(usage["prompt_tokens"]), int(usage["completion_tokens"]))
    except (KeyError, TypeError, ValueError):
        # An answer without usage numbers: the prompt as estimated, marked estimated.
        billed = metering.Usage(request.prompt_tokens, 0, estimated=True)
    await _settle(hold, billed, worker, outcome)
    outcome.finish()
    return JsonResponse(data)


# An engine's answers that say something about the engine, not the request: 401 and 403 (it
# does not take the engine key the platform sent), 404 and 405 (it does not serve the model or
# the route the platform placed there).
WORKERS_OWN = frozenset({401, 403, 404, 405})


def _check_status(worker, status: int, content: bytes) -> None:
    if status == 200:
        return
    if status >= 500 or status == 429:
        raise _upstream_failed(worker, f"The worker answered HTTP {status}.")
    if status in WORKERS_OWN:
        # The engine refused the platform (its engine key) or has no such model or route:
        # the worker's fault, never the client's, whose key and request were good.
        raise _upstream_failed(worker, f"The worker refused the platform's request "
                               f"(HTTP {status}).")
    if openai.is_context_rejection(status, content):
        # Our estimate fitted, the engine's count did not: another worker may hold it.
        raise _Retry(errors.ContextLengthExceeded(openai.engine_error(status, content).message))
    raise openai.engine_error(status, content)


async def _open_stream(worker, path, body) -> httpx.Response:
    """The engine's stream once it answered 200 (its headers): until then a retry is
    possible."""
    client = _client()
    upstream = client.build_request("POST", _url(worker, path), content=body,
                                    headers={"content-type": "application/json",
                                             "accept": "text/event-stream",
                                             **worker.engine_headers},
                                    extensions=worker.tls_extensions)
    try:
        resp = await client.send(upstream, stream=True)
    except httpx.HTTPError as exc:
        raise _upstream_failed(worker, f"The worker could not be reached "
                               f"({type(exc).__name__}).") from None
    try:
        if resp.status_code != 200:
            try:
                content = await resp.aread()
            except httpx.HTTPError as exc:
                raise _upstream_failed(worker, f"The worker failed before answering "
                                       f"({type(exc).__name__}).") from None
            _check_status(worker, resp.status_code, content)
    except BaseException:
        await resp.aclose()
        raise
    return resp


class RelayResponse(StreamingHttpResponse):
    """A stream the proxy relays. routing.asgi iterates `relay` itself and closes it however the
    response ends: the close is what frees the worker's slot and bills the request."""

    def __init__(self, relay: "_Relay"):
        super().__init__(relay, content_type="text/event-stream; charset=utf-8",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.relay = relay


class _Relay:
    """The client's side of a stream: the engine's events as they come, then, once, the
    settle. An iterator class rather than a generator so that its end is certain: `aclose()`
    (routing.asgi calls it when the response is over, however it ended) settles even a stream
    whose first chunk was never asked for, as when the client leaves right after the headers."""

    def __init__(self, resp, state: sse.StreamState, worker, hold, request, outcome):
        self.body, self.resp, self.state = upstream.body_reader(resp), resp, state
        self.worker, self.hold, self.request, self.outcome = worker, hold, request, outcome
        self.ended = False  # no more events to send
        self.closed = False
        self.checkpoint_at = -usage_journal.CHECKPOINT_S  # when usage was last recorded
        self.checkpoint = None  # that record's write, while it runs
        self.recorded = None  # the final usage, once the journal holds it

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        while not self.ended:
            try:
                data = await self.body.read()
                if not data:
                    self.ended = True
                    if not self.state.done:
                        return await self._failed(httpx.RemoteProtocolError(
                            "the stream ended without [DONE]"))
                    break
            except httpx.HTTPError as exc:
                self.ended = True
                return await self._failed(exc)
            except BaseException:
                await self.aclose()  # cancelled: the client left
                raise
            out = self.state.feed(data)
            if out:
                if self.outcome.ttft_s is None:
                    self.outcome.ttft_s = time.perf_counter() - self.outcome.started
                    BREAKER.success(self.worker.deployment_id)
                if self.state.done:  # the last event: its usage is kept before it leaves
                    self.outcome.ended = time.perf_counter()
                    await self._record_final()
                elif self.state.delivered:
                    self._checkpoint()
                return out
        await self.aclose()
        raise StopAsyncIteration

    def _checkpoint(self) -> None:
        """Record the usage so far, at most every CHECKPOINT_S, without waiting for it: a
        server that dies mid-stream leaves what it had delivered to bill."""
        now = time.monotonic()
        if self.hold is None or now - self.checkpoint_at < usage_journal.CHECKPOINT_S or (
                self.checkpoint is not None and not self.checkpoint.done()):
            return
        self.checkpoint_at = now
        self.checkpoint = calls.journal(
            usage_journal.record, hold=self.hold,
            usage=_stream_usage(self.state, self.request, self.outcome, estimated=True),
            worker=_metered(self.worker), final=False)

    async def _record_final(self) -> None:
        if self.hold is None or self.recorded is not None:
            return
        usage = _stream_usage(self.state, self.request, self.outcome)
        if self.checkpoint is not None:  # a checkpoint must not land after the final record
            await asyncio.wait([self.checkpoint])
        await asyncio.shield(calls.journal(usage_journal.record, hold=self.hold, usage=usage,
                                           worker=_metered(self.worker), final=True))
        self.recorded = usage

    async def _failed(self, exc: Exception) -> bytes:
        """After the first byte there is no retry: tell the client, bill what it got."""
        BREAKER.failure(self.worker.deployment_id)
        self.outcome.status = 502
        self.outcome.error_code = errors.ErrorCode.UPSTREAM_DISCONNECTED
        log.warning("worker %s failed mid-stream: %s", self.worker.ref, exc)
        await self._record_final()
        error = errors.UpstreamError(
            f"The worker stopped mid-stream ({type(exc).__name__}); you are billed only for "
            "the tokens delivered.", code=errors.ErrorCode.UPSTREAM_DISCONNECTED)
        return b"data: " + json.dumps(error.body()).encode() + b"\n\ndata: [DONE]\n\n"

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.outcome.ended is None:
            self.outcome.ended = time.perf_counter()
        # Closing the engine's response drops its connection: the engine stops generating.
        _slot_free(self.worker, self.outcome)
        _spawn(_finish_stream(self))


def _stream_usage(state: sse.StreamState, request, outcome: Outcome,
                  estimated: bool = False) -> metering.Usage:
    if state.usage and outcome.status == 200 and not estimated:
        return metering.Usage(int(state.usage.get("prompt_tokens") or 0),
                              int(state.usage.get("completion_tokens") or 0))
    # No usage numbers (the engine sends none, the stream was cut, or it still runs): the
    # prompt as estimated and the content chunks delivered, marked estimated. Never 0.
    prompt = int((state.usage or {}).get("prompt_tokens") or request.prompt_tokens)
    return metering.Usage(prompt, state.delivered, estimated=True)


async def _finish_stream(relay: _Relay) -> None:
    try:
        await relay.resp.aclose()
    except Exception:  # whatever closing the engine's side did, the stream is billed
        log.exception("closing %s's stream failed", relay.worker.ref)
    outcome = relay.outcome
    usage = relay.recorded or _stream_usage(relay.state, relay.request, outcome)
    if outcome.status == 200 and not relay.state.done:
        outcome.status, outcome.error_code = 499, "client_disconnected"
    if relay.checkpoint is not None:
        await asyncio.wait([relay.checkpoint])
    await _settle(relay.hold, usage, relay.worker, outcome, finish=True,
                  recorded=relay.recorded is not None)


def _metered(worker: placement.Worker) -> metering.Worker:
    # The charge names the machine that earned it; the deployment stays in the request log.
    return metering.Worker(worker.provider_id, node_ref(worker.node_id))


async def _settle(hold, usage: metering.Usage, worker: placement.Worker, outcome: Outcome,
                  finish: bool = False, recorded: bool = False):
    """Bill the request. Its usage is in the journal first (billing/usage.py): if the
    database cannot take the settle now, the journal's drain settles it when it can."""
    outcome.prompt_tokens, outcome.completion_tokens = usage.prompt_tokens, \
        usage.completion_tokens
    outcome.estimated = usage.estimated
    if hold is not None:  # None: the renter's own card, paid for by the rental
        if not recorded:
            await calls.journal(usage_journal.record, hold=hold, usage=usage,
                                worker=_metered(worker), final=True)
        try:
            await calls.run(metering.settle, hold=hold, usage=usage, worker=_metered(worker))
            await calls.journal(usage_journal.forget, hold.request_id)
        except metering.MeteringError:
            log.exception("settle refused for %s", hold.request_id)
            await calls.journal(usage_journal.forget, hold.request_id)
        except Exception:
            log.warning("settle of %s failed: its usage is in the journal, billed once the "
                        "database answers", hold.request_id, exc_info=True)
    if finish:
        outcome.finish()


async def _release(hold) -> None:
    if hold is None:
        return
    try:
        await calls.run(metering.release, request_id=hold.request_id)
    except Exception:
        log.warning("release of %s failed: given back when the database answers",
                    hold.request_id, exc_info=True)
        await calls.journal(usage_journal.release_later, hold.request_id)
