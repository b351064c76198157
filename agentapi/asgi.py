"""The heartbeat fast path: a repeated report answered at the ASGI front, before Django.

A full heartbeat (agentapi.views.AgentHeartbeat) costs ~10 statements and ~15x a repeat's CPU;
most heartbeats repeat the node's previous report word for word and get the same answer.
So a POST to the heartbeat path is answered here from the entry the node's last full heartbeat
left in Redis (marketplace.heartbeat_fast) when all of these hold:

- the body is JSON (and Django would take it: content type, size, host, scheme);
- an entry exists for the credential's prefix, and the credential matches the HMAC stored
  with it (constant time);
- the report, parsed and with its keys sorted, is the one that full heartbeat stored;
- that full heartbeat is younger than heartbeat_fast.FULL_EVERY_S.

Then the heartbeat is counted in Redis (the node's latest time, its hour's count: one script
call) and the stored answer is sent.

Otherwise the full path answers. A JSON report that Django's middleware would let through (an
allowed host, HTTPS where required) goes straight to the heartbeat view, in a thread as
Django runs it, with the request signals Django sends around it (they hand the database
connection back to the pool): the middleware has nothing to do for an agent's bearer request
(no session, cookie, CSRF or static file), and it and Django's handler cost more than half of
a full heartbeat's server CPU (docs/benchmarks.md, "Heartbeats"). Anything else goes to
Django's handler with the body already read replayed to it.
"""

import hmac
import io
import json
import logging
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core import signals
from django.core.handlers.asgi import ASGIRequest
from django.core.handlers.exception import convert_exception_to_response
from django.http.request import split_domain_port, validate_host

from accounts.secrets import secret_digest, secret_prefix
from config.client_ip import from_trusted_proxy
from config.redis import REDIS_ERRORS, async_redis_client
from marketplace import heartbeat_fast
from marketplace.serializers import MAX_HEARTBEAT_BYTES

log = logging.getLogger(__name__)

PATH = "/api/agent/heartbeat/"


class HeartbeatFront:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope["path"] != PATH or scope["method"] != "POST"
                or not heartbeat_fast.enabled()):
            return await self.app(scope, receive, send)
        headers = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, value)
        try:
            length = int(headers.get(b"content-length", b"0"))
        except ValueError:
            length = -1
        if not 0 < length <= MAX_HEARTBEAT_BYTES:  # Django says what is wrong with it
            return await self.app(scope, receive, send)
        messages, body = await _read(receive)
        if messages is None:  # the client left while sending it
            return
        answer = await _answer(scope, headers, body) if body is not None else None
        if answer is None:
            if body is not None and _json(headers) and _django_would_serve(scope, headers):
                return await _full(scope, body, send)
            return await self.app(scope, _replay(messages, receive), send)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})


async def _read(receive):
    """(the messages received, the body): the body is None past MAX_HEARTBEAT_BYTES, where
    reading stops and Django reads on; (None, None) if the client left."""
    messages, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None, None
        messages.append(message)
        size += len(message.get("body", b""))
        if size > MAX_HEARTBEAT_BYTES:
            return messages, None
        if not message.get("more_body"):
            return messages, b"".join(m.get("body", b"") for m in messages)


def _replay(messages, receive):
    """A receive that gives the messages read here first, then the client's own."""
    pending = list(messages)

    async def replayed():
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


def _json(headers: dict) -> bool:
    content_type = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
    return content_type == b"application/json"


async def _full(scope, body: bytes, send) -> None:
    """The full path's answer from the view itself (the module's docstring says why)."""
    response = await sync_to_async(_view_answer, thread_sensitive=True)(scope, body)
    headers = [(name.encode("latin-1"), value.encode("latin-1"))
               for name, value in response.items()]
    headers.append((b"content-length", str(len(response.content)).encode()))
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": headers})
    await send({"type": "http.response.body", "body": response.content})


def _view_answer(scope, body: bytes):
    from agentapi.views import AgentHeartbeat

    global _VIEW
    if _VIEW is None:
        _VIEW = convert_exception_to_response(AgentHeartbeat.as_view())
    signals.request_started.send(sender=HeartbeatFront, scope=scope)
    try:
        request = ASGIRequest(scope, io.BytesIO(body))
        response = _VIEW(request)
        if hasattr(response, "render"):
            response.render()
        return response
    finally:
        signals.request_finished.send(sender=HeartbeatFront)


_VIEW = None


async def _answer(scope, headers: dict, body: bytes) -> bytes | None:
    """The stored answer when the fast path may give it, else None."""
    if not _json(headers) or not _django_would_serve(scope, headers):
        return None
    scheme, _, credential = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    credential = credential.strip()
    prefix = secret_prefix(credential, "rsn") if scheme == "Bearer" else None
    if prefix is None:
        return None
    try:
        client, record = _redis()
        raw = await client.get(heartbeat_fast.entry_key(prefix))
        if raw is None:
            return None
        entry = json.loads(raw)
        now = time.time()
        if (not hmac.compare_digest(secret_digest(credential), entry["digest"])
                or not 0 <= now - entry["at"] < heartbeat_fast.FULL_EVERY_S
                or not _same_report(body, entry)):
            return None
        node_id, answer = int(entry["node"]), entry["body"].encode()
        await record(keys=[heartbeat_fast.LIVE, heartbeat_fast.BEATS],
                     args=[node_id, repr(now), heartbeat_fast.beat_field(node_id, now)])
    except REDIS_ERRORS:
        return None
    except (KeyError, TypeError, ValueError, AttributeError):  # an entry it cannot read
        log.warning("heartbeat fast path: unreadable entry for credential %s", prefix)
        return None
    return answer


def _same_report(body: bytes, entry: dict) -> bool:
    # The agent sends the same bytes again as a rule: their hash spares parsing the JSON.
    return (heartbeat_fast.body_digest(body) == entry.get("raw")
            or heartbeat_fast.report_digest(body) == entry["report"])


def _django_would_serve(scope, headers: dict) -> bool:
    """What Django's middleware checks before a view answers: an allowed host, and HTTPS where
    it redirects plain HTTP (production)."""
    host = headers.get(b"host", b"").decode("latin-1")
    domain, _ = split_domain_port(host)
    allowed = settings.ALLOWED_HOSTS or ([".localhost", "127.0.0.1", "[::1]"]
                                         if settings.DEBUG else [])
    if not domain or not validate_host(domain, allowed):
        return False
    if getattr(settings, "SECURE_SSL_REDIRECT", False) and scope.get("scheme") != "https":
        proxied = getattr(settings, "SECURE_PROXY_SSL_HEADER", None)
        peer = (scope.get("client") or (None,))[0]
        if not proxied or not from_trusted_proxy(peer):  # config/client_ip.py
            return False
        header = proxied[0].removeprefix("HTTP_").lower().replace("_", "-").encode()
        if headers.get(header, b"").decode("latin-1").split(",")[0].strip() != proxied[1]:
            return False
    return True


_scripts: dict = {}


def _redis():
    """(this event loop's client, the RECORD script on it)."""
    client = async_redis_client()
    script = _scripts.get(id(client))
    if script is None or script.registered_client is not client:
        script = _scripts[id(client)] = client.register_script(heartbeat_fast.RECORD)
    return client, script
