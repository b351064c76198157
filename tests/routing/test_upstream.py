"""routing.upstream.Transport over real sockets: servers started here with asyncio.start_server
write their answers byte by byte, so each test sets the exact wire behaviour; the fleetsim
engine (uvicorn) stands in for a real one. No mocks; each scenario runs under asyncio.run."""

import asyncio
import hashlib
import json
import random
import socket
import time
from dataclasses import dataclass

import httpx
import pytest

from fleetsim.profiles import get_profile
from routing import upstream

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def run(scenario) -> None:
    """Run one scenario coroutine; a hang fails the test instead of blocking the run."""

    async def guarded():
        async with asyncio.timeout(5):
            await scenario

    asyncio.run(guarded())


def client(transport: upstream.Transport, *, read: float = 2, write: float = 2):
    """The client as the proxy builds it, with short timeouts."""
    return httpx.AsyncClient(transport=transport, headers={"accept-encoding": "identity"},
                             timeout=httpx.Timeout(2, connect=1, read=read, write=write))


@dataclass
class Request:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k == name]
        assert len(values) <= 1, f"{name} sent {len(values)} times: {values}"
        return values[0] if values else None


class Conn:
    """The server's side of one accepted connection."""

    def __init__(self, server: "Server", reader, writer, index: int):
        self.server, self.reader, self.writer, self.index = server, reader, writer, index

    async def read_request(self) -> Request | None:
        """The next request on this connection, or None when the client closed it."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise
            return None
        lines = head[:-4].decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
        assert version == "HTTP/1.1"
        headers = []
        for line in lines[1:]:
            name, value = line.split(":", 1)
            headers.append((name.lower(), value.strip()))
        request = Request(method, target, headers, b"")
        request.body = await self.reader.readexactly(int(request.header("content-length") or 0))
        self.server.requests.append(request)
        return request

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def eof(self, timeout: float = 1.0) -> bool:
        """Whether the client closes its side within `timeout` (sending nothing more)."""
        try:
            async with asyncio.timeout(timeout):
                return await self.reader.read() == b""
        except TimeoutError:
            return False

    async def stall(self) -> None:
        await asyncio.sleep(3600)


class Server:
    """A TCP server on 127.0.0.1 that runs `handler(conn)` for each connection it accepts."""

    def __init__(self, handler):
        self.handler = handler
        self.accepted = 0
        self.requests: list[Request] = []
        self.errors: list[BaseException] = []
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> "Server":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def __aexit__(self, exc_type, *exc) -> None:
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()
        if exc_type is None and self.errors:
            raise self.errors[0]

    async def _serve(self, reader, writer) -> None:
        self.accepted += 1
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await self.handler(Conn(self, reader, writer, self.accepted))
        except ConnectionError:
            pass
        except Exception as exc:  # an assertion in a handler fails the test
            self.errors.append(exc)
        finally:
            self._tasks.discard(task)
            writer.close()


async def serve_ok(conn: Conn) -> None:
    """Answer every request on the connection with a kept-alive 200 "ok"."""
    while await conn.read_request() is not None:
        await conn.send(OK)


# --- requests and responses ------------------------------------------------------------------

def test_content_length_response_and_the_request_on_the_wire():
    async def handler(conn):
        while (request := await conn.read_request()) is not None:
            if request.method == "POST":
                await conn.send(b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
                                b"X-Engine: sim\r\nContent-Length: 11\r\n\r\n{\"ok\":true}")
            else:
                await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")

    async def scenario():
        body = b"\x00binary\xff\r\n\r\nbody"
        async with Server(handler) as server, client(upstream.Transport()) as http:
            resp = await http.post(server.url + "/v1/chat/completions?a=1&b=%20x", content=body)
            assert resp.status_code == 201
            assert resp.headers["content-type"] == "application/json"
            assert resp.headers["x-engine"] == "sim"
            assert resp.json() == {"ok": True}
            assert resp.http_version == "HTTP/1.1"

            streamed = await http.send(http.build_request("GET", server.url + "/health"),
                                       stream=True)
            assert streamed.status_code == 200
            assert await streamed.aread() == b"hello"

        post, get = server.requests
        assert (post.method, post.target) == ("POST", "/v1/chat/completions?a=1&b=%20x")
        assert post.header("host") == f"127.0.0.1:{server.port}"
        assert post.header("content-length") == str(len(body))
        assert post.header("transfer-encoding") is None
        assert post.header("accept-encoding") == "identity"
        assert post.body == body
        assert (get.method, get.target, get.body) == ("GET", "/health", b"")
        assert get.header("content-length") is None
        assert get.header("host") == f"127.0.0.1:{server.port}"

    run(scenario())


def test_large_request_body_arrives_whole():
    body = random.Random(1).randbytes(3 * 1024 * 1024 + 7)

    async def handler(conn):
        request = await conn.read_request()
        digest = hashlib.sha256(request.body).hexdigest().encode()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 64\r\n\r\n" + digest)

    async def scenario():
        async with Server(handler) as server, client(upstream.Transport()) as http:
            resp = await http.post(server.url + "/upload", content=body)
        assert resp.text == hashlib.sha256(body).hexdigest()
        assert server.requests[0].header("content-length") == str(len(body))

    run(scenario())


async def _read_all(resp: httpx.Response, how: str, got_first: asyncio.Event) -> bytes:
    """The body as the proxy's relay reads it (upstream.body_reader: b"" at the end) or as
    httpx's aiter_raw gives it; got_first is set once the first chunk is in hand."""
    received = b""
    if how == "aiter_raw":
        async for chunk in resp.aiter_raw():
            received += chunk
            got_first.set()
        return received
    reader = upstream.body_reader(resp)
    while data := await reader.read():
        received += data
        got_first.set()
    assert await reader.read() == b""  # still the end
    return received


@pytest.mark.parametrize("how", ["aiter_raw", "body_reader"])
def test_chunked_response_is_streamed_as_it_arrives(how):
    got_first = asyncio.Event()

    async def handler(conn):
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n7\r\nchunk 1\r\n")
        # The second chunk leaves only once the client holds the first: a transport that
        # buffered the body until its end would wait here for ever (ReadTimeout).
        async with asyncio.timeout(2):
            await got_first.wait()
        await conn.send(b"7\r\nchunk 2\r\n3\r\n, 3\r\n0\r\n\r\n")
        await serve_ok(conn)

    async def scenario():
        transport = upstream.Transport()
        async with Server(handler) as server, client(transport, read=1) as http:
            resp = await http.send(http.build_request("GET", server.url + "/stream"),
                                   stream=True)
            assert resp.status_code == 200
            assert resp.headers["transfer-encoding"] == "chunked"
            assert await _read_all(resp, how, got_first) == b"chunk 1chunk 2, 3"
            await resp.aclose()
            # Read to its end, the connection went back to the pool.
            assert (await http.get(server.url + "/")).content == b"ok"
        assert server.accepted == 1 and transport.opened == 1

    run(scenario())


def test_interim_responses_are_skipped():
    async def handler(conn):
        if conn.index > 1:
            return await serve_ok(conn)
        await conn.read_request()
        await conn.send(b"HTTP/1.1 100 Continue\r\n\r\n"
                        b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"
                        b"HTTP/1.1 200 OK\r\nX-Final: yes\r\nContent-Length: 4\r\n\r\ndone")
        await serve_ok(conn)

    async def scenario():
        async with Server(handler) as server, client(upstream.Transport()) as http:
            resp = await http.post(server.url + "/", content=b"x")
            assert resp.status_code == 200
            assert resp.content == b"done"
            assert resp.headers["x-final"] == "yes"
            assert "link" not in resp.headers
            assert (await http.get(server.url + "/")).content == b"ok"
        assert server.accepted == 1

    run(scenario())


# --- keep-alive ------------------------------------------------------------------------------

def test_sequential_requests_share_one_connection():
    async def handler(conn):
        while (request := await conn.read_request()) is not None:
            if request.target == "/chunked":
                await conn.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                b"3\r\nabc\r\n0\r\n\r\n")
            else:
                await conn.send(OK)

    async def scenario():
        transport = upstream.Transport()
        async with Server(handler) as server, client(transport) as http:
            assert (await http.get(server.url + "/a")).content == b"ok"
            assert (await http.post(server.url + "/b", content=b"{}")).content == b"ok"
            resp = await http.send(http.build_request("GET", server.url + "/chunked"),
                                   stream=True)
            assert b"".join([c async for c in resp.aiter_raw()]) == b"abc"
            await resp.aclose()
            assert (await http.get(server.url + "/c")).content == b"ok"
        assert server.accepted == 1
        assert transport.opened == 1
        assert [r.target for r in server.requests] == ["/a", "/b", "/chunked", "/c"]

    run(scenario())


def test_idle_connection_closed_by_the_server_is_replaced():
    async def handler(conn):
        await conn.read_request()
        await conn.send(OK)  # kept alive as far as the client knows, then closed

    async def scenario():
        transport = upstream.Transport()
        async with Server(handler) as server, client(transport) as http:
            assert (await http.get(server.url + "/1")).content == b"ok"
            await asyncio.sleep(0.05)  # the server's FIN arrives
            assert (await http.get(server.url + "/2")).content == b"ok"
        assert server.accepted == 2
        assert transport.opened == 2

    run(scenario())


def test_reused_connection_closed_without_an_answer_is_retried_once_on_a_new_one():
    async def handler(conn):
        if conn.index == 1:
            await conn.read_request()
            await conn.send(OK)
            await conn.read_request()  # the second request: read, then closed unanswered
            return
        await serve_ok(conn)

    async def scenario():
        transport = upstream.Transport()
        async with Server(handler) as server, client(transport) as http:
            assert (await http.get(server.url + "/1")).content == b"ok"
            resp = await http.post(server.url + "/2", content=b"payload")
            assert resp.status_code == 200 and resp.content == b"ok"
        assert server.accepted == 2
        assert transport.opened == 2
        assert [(r.target, r.body) for r in server.requests] == [
            ("/1", b""), ("/2", b"payload"), ("/2", b"payload")]

    run(scenario())


def test_reused_connection_that_answered_in_part_is_not_retried():
    async def handler(conn):
        await conn.read_request()
        await conn.send(OK)
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Le")  # then closed

    async def scenario():
        transport = upstream.Transport()
        async with Server(handler) as server, client(transport) as http:
            assert (await http.get(server.url + "/1")).content == b"ok"
            with pytest.raises(httpx.RemoteProtocolError):
                await http.get(server.url + "/2")
        assert server.accepted == 1
        assert transport.opened == 1

    run(scenario())


def test_new_connection_closed_without_an_answer_is_an_error():
    async def handler(conn):
        await conn.read_request()

    async def scenario():
        transport = upstream.Transport()
        async with Server(handler) as server, client(transport) as http:
            with pytest.raises(httpx.RemoteProtocolError):
                await http.get(server.url + "/")
        assert server.accepted == 1
        assert transport.opened == 1

    run(scenario())


def test_idle_connections_older_than_keepalive_are_not_reused():
    first_closed = asyncio.Event()

    async def handler(conn):
        if conn.index == 1:
            for _ in range(2):
                await conn.read_request()
                await conn.send(OK)
            if await conn.eof():
                first_closed.set()
            return
        await serve_ok(conn)

    async def scenario():
        transport = upstream.Transport(keepalive_s=0.1)
        async with Server(handler) as server, client(transport) as http:
            assert (await http.get(server.url + "/1")).content == b"ok"
            assert (await http.get(server.url + "/2")).content == b"ok"
            assert transport.opened == 1  # within keepalive_s: reused
            await asyncio.sleep(0.2)
            assert (await http.get(server.url + "/3")).content == b"ok"
            async with asyncio.timeout(1):
                await first_closed.wait()  # the stale connection was closed, not leaked
        assert server.accepted == 2
        assert transport.opened == 2

    run(scenario())


# --- failures --------------------------------------------------------------------------------

def test_connection_refused_is_a_connect_error():
    async def scenario():
        with socket.socket() as sock:  # bound, not listening: connections are refused
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            transport = upstream.Transport()
            async with client(transport) as http:
                with pytest.raises(httpx.ConnectError):
                    await http.get(f"http://127.0.0.1:{port}/health")
        assert transport.opened == 0

    run(scenario())


def test_https_without_a_pinned_certificate_is_never_sent():
    """Over TLS the transport trusts only the engine's reported certificate
    (test_engine_tls.py); without one it connects nowhere, rather than unchecked."""
    async def scenario():
        async with Server(serve_ok) as server:
            transport = upstream.Transport()
            async with client(transport) as http:
                with pytest.raises(httpx.ConnectError, match="no certificate to pin"):
                    await http.get(f"https://127.0.0.1:{server.port}/")
                with pytest.raises(httpx.UnsupportedProtocol):
                    await http.get(f"ftp://127.0.0.1:{server.port}/")
            await asyncio.sleep(0.01)
        assert server.accepted == 0
        assert transport.opened == 0

    run(scenario())


def test_no_answer_is_a_read_timeout():
    closed = asyncio.Event()

    async def handler(conn):
        await conn.read_request()
        if await conn.eof(2):
            closed.set()

    async def scenario():
        async with Server(handler) as server, \
                client(upstream.Transport(), read=0.3) as http:
            started = time.monotonic()
            with pytest.raises(httpx.ReadTimeout):
                await http.get(server.url + "/")
            assert 0.25 < time.monotonic() - started < 1.0
            async with asyncio.timeout(1):
                await closed.wait()  # the client gave up the connection

    run(scenario())


def test_stall_mid_body_is_a_read_timeout():
    closed = asyncio.Event()

    async def handler(conn):
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello")
        if await conn.eof(2):
            closed.set()

    async def scenario():
        transport = upstream.Transport()
        async with Server(handler) as server, client(transport, read=0.3) as http:
            resp = await http.send(http.build_request("GET", server.url + "/"), stream=True)
            assert resp.status_code == 200
            received = b""
            started = time.monotonic()
            with pytest.raises(httpx.ReadTimeout):
                async for chunk in resp.aiter_raw():
                    received += chunk
            assert 0.25 < time.monotonic() - started < 1.0
            assert received == b"hello"
            await resp.aclose()
            async with asyncio.timeout(1):
                await closed.wait()
        assert transport.opened == 1

    run(scenario())


def test_stall_mid_body_with_a_buffered_read_is_a_read_timeout():
    async def handler(conn):
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await conn.stall()

    async def scenario():
        async with Server(handler) as server, \
                client(upstream.Transport(), read=0.3) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.get(server.url + "/")

    run(scenario())


def test_write_timeout_when_the_server_does_not_read():
    async def handler(conn):
        await conn.stall()  # never reads: the socket buffers fill up

    async def scenario():
        async with Server(handler) as server, \
                client(upstream.Transport(), write=0.3) as http:
            with pytest.raises(httpx.WriteTimeout):
                await http.post(server.url + "/", content=b"x" * (32 * 1024 * 1024))

    run(scenario())


@pytest.mark.parametrize("partial", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\na\r\n0123456789\r\n",
], ids=["content-length", "chunked"])
def test_server_closing_mid_body_is_a_protocol_error(partial):
    async def handler(conn):
        if conn.index <= 2:
            await conn.read_request()
            await conn.send(partial)
            return  # closes the connection
        await serve_ok(conn)

    async def scenario():
        transport = upstream.Transport()
        async with Server(handler) as server, client(transport) as http:
            resp = await http.send(http.build_request("GET", server.url + "/"), stream=True)
            received = b""
            with pytest.raises(httpx.RemoteProtocolError):
                async for chunk in resp.aiter_raw():
                    received += chunk
            assert received == b"0123456789"
            await resp.aclose()

            with pytest.raises(httpx.RemoteProtocolError):  # read whole, as client.get does
                await http.get(server.url + "/")
            assert (await http.get(server.url + "/")).content == b"ok"
        assert server.accepted == 3  # neither broken connection was used again
        assert transport.opened == 3

    run(scenario())


@pytest.mark.parametrize("wire", [
    b"HTTP/1.1 abc\r\n\r\n",
    b"garbage\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: twelve\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
], ids=["status", "garbage", "content-length", "chunk-size"])
def test_malformed_response_is_a_protocol_error(wire):
    closed = asyncio.Event()

    async def handler(conn):
        await conn.read_request()
        await conn.send(wire)  # and the connection stays open: the parser must object
        if await conn.eof(2):
            closed.set()

    async def scenario():
        transport = upstream.Transport()
        async with Server(handler) as server, client(transport) as http:
            with pytest.raises(httpx.RemoteProtocolError):
                await http.get(server.url + "/")
            async with asyncio.timeout(1):
                await closed.wait()
        assert transport.opened == 1

    run(scenario())


def test_closing_a_streamed_response_early_closes_the_connection():
    closed = asyncio.Event()

    async def handler(conn):
        if conn.index == 1:
            await conn.read_request()
            await conn.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                            b"5\r\nfirst\r\n")
            if await conn.eof(2):
                closed.set()
            return
        await serve_ok(conn)

    async def scenario():
        transport = upstream.Transport()
        async with Server(handler) as server, client(transport) as http:
            resp = await http.send(http.build_request("GET", server.url + "/"), stream=True)
            assert await resp.aiter_raw().__anext__() == b"first"
            await resp.aclose()
            async with asyncio.timeout(0.5):
                await closed.wait()  # the engine sees the client leave
            assert (await http.get(server.url + "/")).content == b"ok"
        assert server.accepted == 2
        assert transport.opened == 2

    run(scenario())


@pytest.mark.parametrize("connection", [b"Connection: close\r\n", b""],
                         ids=["connection-close", "no-header"])
def test_body_delimited_by_the_connection_end(connection):
    async def handler(conn):
        if conn.index == 1:
            await conn.read_request()
            await conn.send(b"HTTP/1.1 200 OK\r\n" + connection + b"X-A: b\r\n\r\npart one, ")
            await asyncio.sleep(0.02)
            await conn.send(b"part two")
            return  # the close ends the body
        await serve_ok(conn)

    async def scenario():
        transport = upstream.Transport()
        async with Server(handler) as server, client(transport) as http:
            resp = await http.get(server.url + "/")
            assert resp.status_code == 200
            assert resp.content == b"part one, part two"
            assert resp.headers["x-a"] == "b"
            assert (await http.get(server.url + "/")).content == b"ok"
        assert transport.opened == 2

    run(scenario())


# --- flow control ----------------------------------------------------------------------------

@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_slow_reader_gets_a_large_body_intact(framing):
    body = random.Random(2).randbytes(4 * 1024 * 1024)
    piece = 64 * 1024

    async def handler(conn):
        if conn.index > 1:
            return await serve_ok(conn)
        await conn.read_request()
        if framing == "chunked":
            await conn.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for i in range(0, len(body), piece):
                await conn.send(b"%x\r\n%s\r\n" % (piece, body[i:i + piece]))
            await conn.send(b"0\r\n\r\n")
        else:
            await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
            for i in range(0, len(body), piece):
                await conn.send(body[i:i + piece])
        await serve_ok(conn)

    async def scenario():
        transport = upstream.Transport()
        async with Server(handler) as server, client(transport, read=1) as http:
            resp = await http.send(http.build_request("GET", server.url + "/big"), stream=True)
            digest, sizes = hashlib.sha256(), []
            async for chunk in resp.aiter_raw():
                digest.update(chunk)
                sizes.append(len(chunk))
                await asyncio.sleep(0.005)  # meanwhile the engine could send megabytes
            await resp.aclose()
            assert sum(sizes) == len(body)
            assert digest.hexdigest() == hashlib.sha256(body).hexdigest()
            # Reading paused at the buffer limit: no chunk holds much more than that (a
            # transport that kept reading would hand over megabytes at a time).
            assert max(sizes) <= 2 * upstream.READ_BUFFER_LIMIT, max(sizes)
            assert (await http.get(server.url + "/")).content == b"ok"
        assert transport.opened == 1

    run(scenario())


# --- a fleetsim engine (uvicorn) -------------------------------------------------------------

def _chat(max_tokens: int, stream: bool) -> dict:
    return {"model": get_profile("rtx-pro-6000").model, "stream": stream,
            "max_tokens": max_tokens, "messages": [{"role": "user", "content": "Hi there"}]}


def test_fleetsim_engine_over_one_kept_alive_connection(engine):
    url = engine("rtx-pro-6000")

    async def scenario():
        transport = upstream.Transport()
        async with client(transport) as http:
            assert (await http.get(url + "/health")).status_code == 200

            request = http.build_request("POST", url + "/v1/chat/completions",
                                         json=_chat(6, stream=True))
            resp = await http.send(request, stream=True)
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            raw = b"".join([chunk async for chunk in resp.aiter_raw()])
            await resp.aclose()
            events = [line.removeprefix(b"data: ") for line in raw.split(b"\n\n") if line]
            assert events[-1] == b"[DONE]"
            text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                           for e in events[:-1] if json.loads(e)["choices"])
            assert text

            resp = await http.post(url + "/v1/chat/completions", json=_chat(5, stream=False))
            assert resp.status_code == 200
            assert resp.json()["usage"]["completion_tokens"] == 5
        assert transport.opened == 1

    run(scenario())


def test_fleetsim_engine_dying_mid_stream(engine):
    url = engine("rtx-pro-6000", die_after_tokens=3)

    async def scenario():
        transport = upstream.Transport()
        async with client(transport) as http:
            request = http.build_request("POST", url + "/v1/chat/completions",
                                         json=_chat(20, stream=True))
            resp = await http.send(request, stream=True)
            assert resp.status_code == 200
            received = b""
            with pytest.raises(httpx.RemoteProtocolError):
                async for chunk in resp.aiter_raw():
                    received += chunk
            await resp.aclose()
            assert received.startswith(b"data: ") and b"[DONE]" not in received
            assert (await http.get(url + "/health")).status_code == 200
        assert transport.opened == 2

    run(scenario())
