"""The ASGI front: /v1's async views are called straight from the ASGI server, everything else
goes through Django's ASGI handler.

Django's handler costs a /v1 request 1-2.6 ms before the view runs (bench/proxy.py, docs/
benchmarks.md): `request_started` and `request_finished` are sent through sync_to_async (two
thread hops for signal receivers that manage the database connections of a thread that has
none: /v1 reaches the database only through routing.calls), WhiteNoise is sync-only middleware
(another hop), and sessions, CSRF, auth and messages have nothing to do for a bearer-key API.
So the three /v1 views get the request as Django builds it (ASGIRequest) and their responses
are sent here, with the same disconnect handling as Django's: the view's task is cancelled
when the client goes away, which is how the proxy learns to stop the engine.
"""

import asyncio
import io

from django.core.handlers.asgi import ASGIRequest

from routing import errors, proxy, views
from routing.proxy import error_response

ROUTES = {f"/{path}": view for path, view in views.V1.items()}


class Application:
    def __init__(self, django_app):
        self.django_app = django_app

    async def __call__(self, scope, receive, send):
        # A trailing slash names the same endpoint (`/v1/chat/completions/`).
        view = ROUTES.get(scope["path"].rstrip("/")) if scope["type"] == "http" else None
        if view is None:
            return await self.django_app(scope, receive, send)
        body = await _read_body(receive)
        if body is None:  # the client left while sending it
            return
        if body is _TOO_LARGE:
            return await _send(error_response(errors.RequestTooLarge()), send)
        request = ASGIRequest(scope, io.BytesIO(body))
        # The view runs in this task: as a task of its own it would wait for the event loop's
        # next turn, behind a chunk of every stream being relayed. A watcher cancels it when
        # the client leaves, as Django's handler cancels its view's task.
        serving = asyncio.current_task()
        left = False

        def client_left(watcher: asyncio.Task) -> None:
            nonlocal left
            if not watcher.cancelled():
                left = True
                serving.cancel()

        gone = asyncio.ensure_future(_disconnected(receive))
        gone.add_done_callback(client_left)
        try:
            await _send(await view(request), send)
        except asyncio.CancelledError:
            if not left or serving.uncancel():  # cancelled by the server, not by the client
                raise
        finally:
            gone.remove_done_callback(client_left)
            gone.cancel()


_TOO_LARGE = object()


async def _read_body(receive):
    """The body; _TOO_LARGE past errors.MAX_BODY_BYTES (read on, kept no more); None if the
    client left while sending it."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size <= errors.MAX_BODY_BYTES:
            chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks) if size <= errors.MAX_BODY_BYTES else _TOO_LARGE


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send(response, send) -> None:
    headers = [(name.encode("latin-1"), value.encode("latin-1"))
               for name, value in response.items()]
    if not response.streaming:
        headers.append((b"content-length", str(len(response.content)).encode()))
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": headers})
    if not response.streaming:
        await send({"type": "http.response.body", "body": response.content})
        return
    relay = response.relay if isinstance(response, proxy.RelayResponse) else None
    try:
        async for chunk in relay or response.streaming_content:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    finally:
        # However it ended (done, cancelled, failed): the relay settles on aclose().
        if relay is not None:
            await relay.aclose()
