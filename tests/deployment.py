"""A production-like deployment for the tests that must see one: uvicorn with several worker
processes and a Celery worker with beat, as subprocesses, on the test database, with a
redis-server of the test's own and a gate in front of PostgreSQL. The gate can cut every
connection and refuse new ones, as a database that stops, then open again. Connection pools,
Redis clients and event loops fail only in such a deployment, never in the in-process test
client."""

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


class PrivateRedis:
    """A redis-server of the test's own, to kill and start again on the same port. With
    `persist`, it keeps an append-only file, fsynced on every write, as production's must."""

    def __init__(self, directory: Path | None = None):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.directory = directory
        self.process = None

    def start(self):
        persistence = (["--appendonly", "yes", "--appendfsync", "always", "--dir",
                        str(self.directory)] if self.directory else ["--appendonly", "no"])
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             *persistence], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port)

    def kill(self):
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.kill()


class PgGate:
    """A TCP gate in front of PostgreSQL. `cut()` drops every connection and stops listening
    (clients get 'connection refused', as from a stopped server); `open()` listens again on
    the same port. `peak` is the most connections that were open through it at once."""

    def __init__(self, upstream: tuple[str, int] = ("127.0.0.1", 5432)):
        self.upstream = upstream
        self.port = free_port()
        self.peak = 0
        self._pairs: set[tuple[socket.socket, socket.socket]] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._stop = threading.Event()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._pairs)

    def open(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(256)
        listener.settimeout(0.1)
        self._listener, self._stop = listener, threading.Event()
        threading.Thread(target=self._accept, args=(listener, self._stop), daemon=True).start()

    def cut(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            pairs, self._pairs = list(self._pairs), set()
        for pair in pairs:
            for sock in pair:
                _drop(sock)

    def _accept(self, listener: socket.socket, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _drop(client)
                continue
            client.settimeout(None)
            server.settimeout(None)
            pair = (client, server)
            with self._lock:
                self._pairs.add(pair)
                self.peak = max(self.peak, len(self._pairs))
            threading.Thread(target=self._pump, args=(pair,), daemon=True).start()

    def _pump(self, pair: tuple[socket.socket, socket.socket]) -> None:
        client, server = pair
        try:
            while True:
                ready, _, _ = select.select([client, server], [], [], 1.0)
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    (server if sock is client else client).sendall(data)
        except (OSError, ValueError):
            return
        finally:
            with self._lock:
                self._pairs.discard(pair)
            _drop(client)
            _drop(server)


def _drop(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class Deployment:
    """uvicorn (`workers` processes) serving config.asgi, and optionally a Celery worker with
    beat, all reaching PostgreSQL through `gate` and Redis at `redis_url`."""

    def __init__(self, *, database: str, gate: PgGate, redis_url: str, directory: Path,
                 workers: int = 2, celery: bool = False, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.directory = directory
        self.env = os.environ | {
            "DJANGO_SETTINGS_MODULE": "config.settings",
            "DATABASE_URL": f"postgres://postgres@127.0.0.1:{gate.port}/{database}",
            "REDIS_URL": redis_url,
            "RIGSHARE_USAGE_SPOOL_DIR": str(directory / "usage-spool"),
            "PYTHONUNBUFFERED": "1",
        } | (env or {})
        self.workers, self.celery = workers, celery
        self.processes: list[subprocess.Popen] = []

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.directory / f"{name}.log", "w")  # noqa: SIM115 (the process owns it)
        self.processes.append(subprocess.Popen(
            argv, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True))

    def start(self) -> "Deployment":
        self._spawn("uvicorn", [sys.executable, "-m", "uvicorn", "config.asgi:application",
                                "--host", "127.0.0.1", "--port", str(self.port), "--workers",
                                str(self.workers), "--no-access-log", "--log-level", "warning"])
        if self.celery:
            self._spawn("celery", [sys.executable, "-m", "celery", "-A", "config", "worker",
                                   "-B", "-s", str(self.directory / "beat-schedule"),
                                   "--pool", "threads", "-c", "4", "-l", "warning"])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if any(p.poll() is not None for p in self.processes):
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the deployment did not start:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text()[-4000:]}"
                         for path in sorted(self.directory.glob("*.log")))

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)
        self.processes.clear()
