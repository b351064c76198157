"""The proxy's way to the engines: an httpx transport that speaks HTTP/1.1 over asyncio
connections, parsed with httptools, and keeps them alive per engine.

httpx's default transport (httpcore over anyio, parsed with h11) cost the proxy more than the
rest of the request path together (docs/benchmarks.md, "Inference proxy"): ~70 µs of CPU for
each streamed token it read (a cancel scope and two epoll changes per read), and a connection
pool whose bookkeeping, run ~4 times a request, is quadratic in its size and polls every idle
socket. Here a connection is an asyncio Protocol: the bytes an engine sends are parsed as they
arrive and queued for the reader, who waits only when the queue is empty; the pool is a stack
of idle connections per engine.

It serves what the proxy and the health checks send: requests whose body is in memory,
answered with a Content-Length, chunked, or closed-connection body; over plain HTTP, or over
TLS pinned to the engine's reported certificate (marketplace/engine_tls.py), which the request
carries in its extensions (engine_tls.extensions): an https:// request without one is refused,
never sent with a public CA's say-so or none. httpx keeps its
own part: the request and response objects, headers, decoding, timeouts as configured on the
client, and the exception types (ConnectError, ConnectTimeout, ReadTimeout, WriteTimeout,
RemoteProtocolError), which is what the proxy's retry and circuit breaker act on.
"""

import asyncio
import collections
import time

import httptools
import httpx

from marketplace import engine_tls

READ_BUFFER_LIMIT = 256 * 1024  # bytes queued for a slow reader before reading pauses


class _Connection(asyncio.Protocol):
    """One TCP connection to an engine, carrying one request at a time."""

    def __init__(self, origin):
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = None
        self.lost = False
        self.idle_since = 0.0
        self._error: Exception | None = None
        self._waiter: asyncio.Future | None = None
        self._writable: asyncio.Future | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._wait_started = 0.0
        self._reset()

    def _reset(self):
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received_any = False
        self.body = collections.deque()
        self.buffered = 0
        self.paused = False

    # asyncio.Protocol
    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        if self.parser is None:  # bytes nobody asked for: the connection is not reusable
            self.transport.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._error = httpx.RemoteProtocolError(f"invalid HTTP response: {exc}")
            self.transport.close()
        self._wake()

    def eof_received(self):
        return False  # close our side too

    def connection_lost(self, exc):
        self.lost = True
        if self.parser is not None and self.headers_done and not self.complete \
                and self._reads_to_close():
            self.complete = True  # a body delimited by the connection's end
        elif self._error is None and not self.complete:
            self._error = httpx.RemoteProtocolError(
                "the engine closed the connection before the response was complete")
        self._wake()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self):
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self):
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if 100 <= self.status < 200:  # an interim answer: the real one follows
            self.headers = []
            return
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > READ_BUFFER_LIMIT and not self.paused and not self.lost:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.headers_done:
            self.complete = True
            # Asked now: once feed_data returns, the parser has moved on to the next message.
            self.keep_alive = self.parser.should_keep_alive()

    # used by the transport and the response stream
    def _reads_to_close(self) -> bool:
        names = {name.lower() for name, _ in self.headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    def _wake(self):
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self, timeout: float | None, error) -> None:
        """Until the parser made progress (or the connection ended), at most `timeout`."""
        if self._error is not None:
            raise self._error
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        if timeout is not None:
            # One timer per connection, moved along lazily, rather than one per read: a
            # stream waits once per token.
            self._wait_started = loop.time()
            if self._watchdog is None:
                self._watchdog = loop.call_at(self._wait_started + timeout, self._watch,
                                              timeout, error)
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    def _watch(self, timeout: float, error) -> None:
        self._watchdog = None
        if self._waiter is None or self._waiter.done():
            return  # not waiting now: the next wait sets a new timer
        loop = asyncio.get_running_loop()
        due = self._wait_started + timeout
        if loop.time() >= due:
            self._waiter.set_exception(error(f"the engine sent nothing for {timeout:.1f} s"))
        else:
            self._watchdog = loop.call_at(due, self._watch, timeout, error)

    def _stop_watch(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    async def drain(self, timeout: float | None) -> None:
        if self._writable is None:
            return
        try:
            async with asyncio.timeout(timeout):
                await self._writable
        except TimeoutError:
            raise httpx.WriteTimeout("the engine did not take the request in time") from None

    def take_body(self) -> bytes:
        data = b"".join(self.body) if len(self.body) > 1 else self.body.popleft()
        self.body.clear()
        self.buffered = 0
        if self.paused and not self.lost:
            self.paused = False
            self.transport.resume_reading()
        return data

    def start(self) -> None:
        self._reset()
        self._error = None
        self.parser = httptools.HttpResponseParser(self)

    def reusable(self) -> bool:
        return (self.complete and not self.lost and self._error is None
                and not self.body and self.keep_alive)

    def close(self) -> None:
        self._stop_watch()
        self.parser = None
        if self.transport is not None:
            self.transport.close()


class _Body(httpx.AsyncByteStream):
    """A response's body as the engine sends it; the connection goes back to the pool when
    the body was read to its end, and is closed (the engine sees the client leave) when the
    reader stops before that."""

    def __init__(self, transport: "Transport", conn: _Connection, read_timeout):
        self.transport, self.conn, self.read_timeout = transport, conn, read_timeout
        self.closed = False

    async def read(self) -> bytes:
        """Whatever the engine sent since the last read (waiting for something if nothing);
        b"" once the body is complete, and the connection is back in the pool."""
        conn = self.conn
        while not conn.body:
            if conn.complete:
                await self.aclose()
                return b""
            await conn.wait(self.read_timeout, httpx.ReadTimeout)
        return conn.take_body()

    async def __aiter__(self):
        while data := await self.read():
            yield data

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.transport._put_back(self.conn)


_BODY = "rigshare.body"


def body_reader(response: httpx.Response):
    """`await read()` on the returned object gives a response's body as it comes, b"" at its
    end: what `aiter_raw()` yields, without the three async generators around it (httpx's
    and ours), which a stream passes through once per token."""
    return response.extensions[_BODY]


class Transport(httpx.AsyncBaseTransport):
    """Connections kept alive per (host, port), reused newest first, at most `max_idle` idle
    ones per engine and none idle longer than `keepalive_s`: 4 s, under the 5 s after which
    uvicorn (vLLM, llama-cpp-python) and llama.cpp's own server close an idle connection. A
    request that meets a connection closing anyway goes once more on a new one."""

    def __init__(self, max_idle: int = 256, keepalive_s: float = 4.0):
        self.max_idle, self.keepalive_s = max_idle, keepalive_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self.opened = 0  # connections made, for tests and metrics

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme == "http":
            origin = (url.host, url.port or 80, "")
        elif url.scheme == "https":
            pin = request.extensions.get(engine_tls.PIN)
            if not pin:
                raise httpx.ConnectError(f"{url.host}:{url.port or 443}: no certificate to "
                                         "pin the engine's TLS to")
            origin = (url.host, url.port or 443, pin)  # a new certificate: new connections
        else:
            raise httpx.UnsupportedProtocol(f"this transport speaks HTTP and HTTPS, not "
                                            f"{url.scheme!r}")
        if request.method == "HEAD":
            raise httpx.UnsupportedProtocol("this transport does not send HEAD requests")
        timeouts = request.extensions.get("timeout", {})
        body = await request.aread()
        head = _head(request, len(body))
        conn = self._take(origin)
        if conn is not None:
            try:
                return await self._exchange(conn, request, head, body, timeouts)
            except httpx.RemoteProtocolError:
                if conn.received_any:
                    raise
                # The engine closed a kept-alive connection as we sent on it (it read nothing
                # of this request): once more on a new one.
        conn = await self._connect(origin, timeouts.get("connect"))
        return await self._exchange(conn, request, head, body, timeouts)

    async def _exchange(self, conn, request, head, body, timeouts) -> httpx.Response:
        conn.start()
        try:
            conn.transport.write(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                conn.transport.write(body)
            await conn.drain(timeouts.get("write"))
            while not conn.headers_done:
                await conn.wait(timeouts.get("read"), httpx.ReadTimeout)
        except BaseException:
            conn.close()
            raise
        body = _Body(self, conn, timeouts.get("read"))
        return httpx.Response(conn.status, headers=conn.headers, stream=body,
                              extensions={"http_version": b"HTTP/1.1", _BODY: body},
                              request=request)

    async def _connect(self, origin, timeout) -> _Connection:
        loop = asyncio.get_running_loop()
        host, port, pin = origin
        tls = {"ssl": engine_tls.context(pin), "server_hostname": host} if pin else {}
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(lambda: _Connection(origin), host, port,
                                                       **tls)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {origin[0]}:{origin[1]} within "
                                       f"{timeout} s") from None
        except OSError as exc:
            raise httpx.ConnectError(f"{origin[0]}:{origin[1]}: {exc}") from None
        self.opened += 1
        return conn

    def _take(self, origin) -> _Connection | None:
        idle = self._idle.get(origin)
        oldest = time.monotonic() - self.keepalive_s
        while idle:
            conn = idle.pop()
            if not conn.lost and conn.idle_since >= oldest:
                return conn
            conn.close()
        return None

    def _put_back(self, conn: _Connection) -> None:
        if not conn.reusable():
            conn.close()
            return
        conn.parser = None
        conn._stop_watch()
        idle = self._idle.setdefault(conn.origin, [])
        if len(idle) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


def _head(request: httpx.Request, length: int) -> bytes:
    lines = [b"%s %s HTTP/1.1" % (request.method.encode(), request.url.raw_path)]
    has_length = False
    for name, value in request.headers.raw:
        lowered = name.lower()
        if lowered == b"transfer-encoding":
            continue  # the body is in memory: it is sent with its length
        if lowered == b"content-length":
            has_length = True
            value = str(length).encode()
        lines.append(name + b": " + value)
    if not has_length and (length or request.method in ("POST", "PUT", "PATCH")):
        lines.append(b"Content-Length: %d" % length)
    return b"\r\n".join(lines) + b"\r\n\r\n"
