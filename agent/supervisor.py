"""The engine as the agent's child (docs/agent-protocol.md, section 4).

`python -m agent run --serve MODEL` runs the command the platform computes for this machine
(marketplace/engine_config.py, sent in the heartbeat reply); `--engine-command "..."` runs the
provider's own. Either way the Supervisor, in a thread of the agent:

- starts the engine through its keeper (agent/keeper.py: its own session and process group,
  output to `engine.log` in the state directory, dead with the agent);
- says in every heartbeat how it is: starting, loading (the process is up, its /health or
  /v1/models does not answer yet), ready, draining, crashed (exit code, the log's last lines),
  stopped; and the command it runs, with the engine key masked;
- restarts it when it dies, after 1, 2, 4 ... s up to a minute (a run that stayed ready for a
  minute starts the count again);
- drains it before a new configuration or a restart the provider asked for: it says
  `draining` (routing stops sending it work), waits until the platform has heard and its
  routers have had time to follow, then until no request is in flight, and only then restarts;
- serves the platform's yardstick while a verification run asks for it (the reply's
  `engine.yardstick`): the engine is drained and started with the yardstick's command, and the
  provider's own comes back, drained the same way, when the reply no longer carries it;
- stops it with the agent (SIGTERM to its process group, SIGKILL after the timeout);
- hands it over on an upgrade: a newer agent with the same state directory connects to the
  running engine's keeper instead of starting a second engine, and this one leaves.

Standard library and httpx only; nothing of the platform.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from agent import engine_tls, model_files

STARTING, LOADING, READY, DRAINING, CRASHED, STOPPED = (
    "starting", "loading", "ready", "draining", "crashed", "stopped")
STATES = (STARTING, LOADING, READY, DRAINING, CRASHED, STOPPED)

# What the platform's command carries where the node's engine key goes (marketplace/
# engine_config.py, ENGINE_KEY_PLACEHOLDER); the provider's command may carry it too.
KEY_PLACEHOLDER = "${RIGSHARE_ENGINE_KEY}"
KEY_ENV = "RIGSHARE_ENGINE_KEY"
KEY_FILE = "engine-key"  # in the state directory, the key alone (mode 0600)
# The key before the latest the platform handed over: the running engine may still have it.
PREVIOUS_KEY_FILE = "engine-key.previous"
SECRET_FLAGS = ("--api-key", "--api_key")
MASK = "***"

# The heartbeat's bounds (docs/agent-protocol.md): the platform refuses more.
MAX_ARGV = 256
MAX_ARG = 1024
LOG_LINES = 20
LOG_LINE_CHARS = 300
LOG_TAIL_BYTES = 16 * 1024
LOG_ROTATE_BYTES = 8 * 2**20  # engine.log moves to engine.log.1 past this, at an engine start

# A change reaches every router within 2 s of the heartbeat that reports it (routing/pool.py,
# REFRESH_S): requests routed before that may still be arriving.
ROUTING_SETTLE_S = 3.0
# An engine that says nothing of its requests, on a system where its connections cannot be
# counted: the drain waits this long after the platform heard of it.
UNKNOWN_IN_FLIGHT_WAIT_S = 15.0
KEEPER_START_S = 10.0  # for the keeper to listen: a Python start, well under a second
HTTP_TIMEOUT_S = 2.0
KEEPER = Path(__file__).with_name("keeper.py")

# Requests an engine is running or holding, as its Prometheus /metrics names them (vLLM v1;
# llama-server with --metrics). FACTS.md, "Routing lessons from public routers".
_QUEUE_METRICS = re.compile(
    r"^(?:vllm:num_requests_running|vllm:num_requests_waiting|llamacpp:requests_processing"
    r"|llamacpp:requests_deferred)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|[\x00-\x08\x0b-\x1f\x7f]")


class SupervisorError(Exception):
    """A supervisor that cannot work here (a state directory it cannot use): one line."""


@dataclass(frozen=True)
class Backoff:
    """Restart delays after a crash: first_s, doubled each time up to cap_s; a run that stayed
    ready for stable_s starts the count again."""

    first_s: float = 1.0
    factor: float = 2.0
    cap_s: float = 60.0
    stable_s: float = 60.0

    def delay(self, failures: int) -> float:
        return min(self.cap_s, self.first_s * self.factor ** max(0, failures - 1))


@dataclass(frozen=True)
class Launch:
    """What to run: the argv as the platform or the provider wrote it (placeholder kept)."""

    argv: tuple[str, ...]
    mode: str  # "platform" or "command"
    version: str | None = None  # the platform's configuration version
    # The engine key's fingerprint where the argv carries the key: a new key is a new
    # configuration, so the engine is drained and restarted with it.
    key_fingerprint: str | None = None
    yardstick: int | None = None  # the verification run whose yardstick this is

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(
            [self.mode, list(self.argv), self.key_fingerprint]).encode()).hexdigest()[:16]


@dataclass
class _Running:
    digest: str
    mode: str
    version: str | None
    argv: list[str]  # masked
    pid: int | None = None
    key_fingerprint: str | None = None  # of the key the engine was started with
    yardstick: int | None = None  # the verification run whose yardstick it serves


@dataclass
class _Drain:
    reason: str
    started: float
    acked: float | None = None
    zeros: int = 0
    stopping: bool = False


@dataclass
class _Status:
    state: str = STARTING
    error: str | None = None
    exit_code: int | None = None
    restarts: int = 0
    log_tail: list[str] = field(default_factory=list)


def argv_with_key(argv, key: str | None) -> list[str]:
    """The argv with the engine key in place of the placeholder; without a key, the flag that
    would carry it is left out (`--api-key ${RIGSHARE_ENGINE_KEY}` both words)."""
    out: list[str] = []
    for arg in argv:
        if KEY_PLACEHOLDER not in arg:
            out.append(arg)
        elif key:
            out.append(arg.replace(KEY_PLACEHOLDER, key))
        elif arg == KEY_PLACEHOLDER and out and out[-1].startswith("-"):
            out.pop()
    return out


def masked(argv, key: str | None = None) -> list[str]:
    """The argv as a heartbeat may show it: an API key's value, and the engine key wherever it
    appears, replaced by ***; bounded as the protocol says."""
    out, hide = [], False
    for arg in list(argv)[:MAX_ARGV]:
        if hide and arg != KEY_PLACEHOLDER:
            arg = MASK
        hide = arg in SECRET_FLAGS
        for flag in SECRET_FLAGS:
            if arg.startswith(flag + "=") and not arg.endswith(KEY_PLACEHOLDER):
                arg = f"{flag}={MASK}"
        if key:
            arg = arg.replace(key, MASK)
        out.append(arg[:MAX_ARG])
    return out


def with_model_file(argv, model_file: str | None) -> list[str]:
    """llama-server's `-m` pointed at the GGUF file this machine has (the platform names the
    file by the model; only the agent knows where it lies)."""
    argv = list(argv)
    if model_file:
        for i, arg in enumerate(argv[:-1]):
            if arg in ("-m", "--model"):
                argv[i + 1] = model_file
    return argv


def read_engine_key(state_dir: Path, name: str = KEY_FILE) -> str | None:
    key = os.environ.get(KEY_ENV, "").strip() if name == KEY_FILE else ""
    if key:
        return key
    with contextlib.suppress(OSError):
        return (state_dir / name).read_text().strip() or None
    return None


def key_fingerprint(key: str | None) -> str | None:
    """How the agent names a key to the platform (marketplace/engine_keys.py): never the key."""
    return hashlib.sha256(key.encode()).hexdigest()[:16] if key else None


def write_engine_key(state_dir: Path, key: str) -> bool:
    """Keep the key the platform handed over (mode 0600), the one before it beside it; False
    when it is the key held already."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    held = None
    with contextlib.suppress(OSError):
        held = (state_dir / KEY_FILE).read_text().strip() or None
    if held == key:
        return False
    for name, value in ((PREVIOUS_KEY_FILE, held), (KEY_FILE, key)):
        if not value:
            continue
        path = state_dir / name
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(value + "\n")
        os.replace(tmp, path)
    return True


def engine_keys(state_dir: Path) -> list[str]:
    """The keys an engine of this state directory may run with, newest first."""
    keys = [read_engine_key(state_dir), read_engine_key(state_dir, PREVIOUS_KEY_FILE)]
    return [k for i, k in enumerate(keys) if k and k not in keys[:i]]


def log_tail(path: Path, lines: int = LOG_LINES) -> list[str]:
    """The log's last lines, each without terminal escapes or control characters, cut to
    LOG_LINE_CHARS."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            size = log.tell()
            log.seek(max(0, size - LOG_TAIL_BYTES))
            data = log.read()
    except OSError:
        return []
    text = data.decode("utf-8", errors="replace").replace("\r", "\n")
    found = [_CONTROL.sub("", line).strip() for line in text.split("\n")]
    return [line[:LOG_LINE_CHARS] for line in found if line][-lines:]


def queue_from_metrics(text: str) -> int | None:
    """Requests running or waiting, from an engine's Prometheus text; None when it names none."""
    values = [float(v) for v in _QUEUE_METRICS.findall(text)]
    return int(sum(values)) if values else None


def established_connections(port: int) -> int | None:
    """TCP connections open to this local port now (Linux, /proc/net/tcp and tcp6); None
    where that cannot be read. An engine that says nothing of its requests (llama-cpp-python's
    server) is idle when none is open: the server closes an idle keep-alive connection after
    5 s (uvicorn's default)."""
    found, readable = 0, False
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as table:
                rows = table.read().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for row in rows:
            parts = row.split()
            if len(parts) > 3 and parts[3] == "01":  # ESTABLISHED
                local_port = int(parts[1].rsplit(":", 1)[1], 16)
                found += local_port == port
    return found if readable else None


def process_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) runs nothing.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _signal_group(pgid: int | None, sig: int) -> None:
    if pgid:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


class _KeeperLink:
    """The agent's end of a keeper's socket: JSON lines."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buffer = b""

    @classmethod
    def connect(cls, path: str) -> _KeeperLink | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            return None
        return cls(sock)

    def send(self, message: dict) -> bool:
        try:
            self.sock.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            return False
        return True

    def events(self, timeout: float) -> list[dict] | None:
        """The events that arrive within `timeout`; None once the keeper has closed."""
        try:
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                return []
            data = self.sock.recv(65536)
        except OSError:
            return None
        if not data:
            return None
        self.buffer += data
        events = []
        while b"\n" in self.buffer:
            line, _, self.buffer = self.buffer.partition(b"\n")
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    events.append(event)
        return events

    def wait_for(self, name: str, timeout: float) -> tuple[dict | None, list[dict], bool]:
        """(the first `name` event or None, the other events meanwhile, whether it closed)."""
        deadline = time.monotonic() + timeout
        others = []
        while (left := deadline - time.monotonic()) > 0:
            events = self.events(left)
            if events is None:
                return None, others, True
            for i, event in enumerate(events):
                if event.get("event") == name:
                    return event, others + events[i + 1:], False
                others.append(event)
        return None, others, False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class Supervisor:
    """Runs one engine for the agent. `command`: the provider's argv; `serve`: the model whose
    platform-computed command to run (argv from `on_reply`). Call start(), report() for each
    heartbeat, on_reply() with each heartbeat answer, and stop() when the agent stops."""

    def __init__(self, *, state_dir: Path, engine_url: str, command: list[str] | None = None,
                 serve: str | None = None, quantization: str | None = None,
                 model_file: str | None = None, backoff: Backoff = Backoff(),
                 stop_timeout_s: float = 30.0, drain_timeout_s: float = 300.0,
                 log: Callable[[str], None] = print, poll_s: float = 0.25,
                 engine_argv: Callable[[list[str]], list[str]] | None = None):
        if (command is None) == (serve is None):
            raise ValueError("give the provider's command or the model to serve, not both")
        self.state_dir = Path(state_dir)
        self._engine_url = engine_url.rstrip("/")
        self.port = urlsplit(self._engine_url).port
        self.command = tuple(command) if command is not None else None
        self.serve = serve
        self.quantization = quantization
        self.model_file = model_file
        self.backoff = backoff
        self.stop_timeout_s = stop_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.log = log
        self.poll_s = poll_s
        self.mode = "command" if command is not None else "platform"
        # What runs the platform's yardstick command on this machine (a simulated machine runs
        # its simulated engine in place of vLLM or llama-server); None: the command as it is.
        self.engine_argv = engine_argv
        self.changed = threading.Event()  # something a heartbeat should say at once
        self.replaced_by: int | None = None  # a newer agent took the engine over

        self._lock = threading.RLock()
        self._status = _Status()
        self._config: dict | None = None  # the platform's latest engine configuration
        self._yardstick: dict | None = None  # {"run", "config"} while a run asks for it
        self._restart_seen: int | None = None
        self._restart_wanted = False
        self._running: _Running | None = None
        self._tls = False  # the latest engine started serves HTTPS with the agent's certificate
        self._link: _KeeperLink | None = None
        self._keeper: subprocess.Popen | None = None
        self._pgid: int | None = None
        self._expect_exit = False
        self._drain: _Drain | None = None
        self._failures = 0
        self._next_start = 0.0
        self._ready_at: float | None = None
        self._metrics_known: bool | None = None  # does this run's engine have /metrics?
        self._started = False  # an engine was started or taken over: the next is a restart
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        # Its own engine, on this machine: over TLS, the certificate is the agent's own to
        # report (engine_tls.py), not one to check here.
        self._http = httpx.Client(timeout=HTTP_TIMEOUT_S, verify=False,
                                  limits=httpx.Limits(max_keepalive_connections=0))

    @property
    def engine_url(self) -> str:
        """Where the engine answers: https:// once it was started with the agent's certificate,
        and still while the agent starts the next one (a restart, the yardstick): the address
        the platform calls must not flap to plain HTTP between two engines."""
        return engine_tls.https(self._engine_url) if self._tls else self._engine_url

    # --- paths ---

    @property
    def log_path(self) -> Path:
        return self.state_dir / "engine.log"

    @property
    def record_path(self) -> Path:
        return self.state_dir / "engine.json"

    @property
    def socket_path(self) -> str:
        path = str(self.state_dir / "keeper.sock")
        if len(path.encode()) < 100:  # sun_path holds 104-108 bytes
            return path
        digest = hashlib.sha256(str(self.state_dir.resolve()).encode()).hexdigest()[:16]
        return str(Path(tempfile.gettempdir()) / f"rigshare-keeper-{digest}.sock")

    # --- what the agent calls ---

    def start(self) -> None:
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise SupervisorError(f"Cannot use the state directory {self.state_dir}: "
                                  f"{exc.strerror or exc}.") from None
        self._restart_seen = self._load_state().get("restart_seen")
        self._thread = threading.Thread(target=self._run, name="engine-supervisor", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the engine (not when a newer agent has taken it over) and the thread."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout if timeout is not None else self.stop_timeout_s + 15)
        self._http.close()

    def running_key(self) -> str | None:
        """The key the running engine was started with (the newest one when none runs)."""
        with self._lock:
            wanted = self._running.key_fingerprint if self._running else None
        keys = engine_keys(self.state_dir)
        if wanted is None:
            return keys[0] if keys else None
        return next((k for k in keys if key_fingerprint(k) == wanted), None)

    def headers(self) -> dict:
        key = self.running_key()
        return {"Authorization": f"Bearer {key}"} if key else {}

    def key_in_use(self) -> str | None:
        """The fingerprint of the key the running engine has: what the platform should send.
        None while no engine runs, or one runs without the key."""
        with self._lock:
            return self._running.key_fingerprint if self._running else None

    def report(self) -> dict:
        """The heartbeat's `engine.supervisor`."""
        with self._lock:
            status, running = self._status, self._running
            live = status.state in (STARTING, LOADING, DRAINING)
            tail = self._tail() if live else list(status.log_tail)
            wanted = self._wanted()
            argv = running.argv if running else (
                masked(self._argv_for(wanted), read_engine_key(self.state_dir)) if wanted else [])
            return {
                "state": status.state,
                "mode": self.mode,
                "model": self.serve,
                "quantization": self.quantization if self.serve else None,
                "argv": argv,
                "config_version": running.version if running else None,
                "pid": running.pid if running else None,
                "exit_code": status.exit_code,
                "restarts": status.restarts,
                "log_tail": tail,
                "error": status.error[:256] if status.error else None,
                "restart_seen": self._restart_seen or 0,
                "tls": True,  # it puts its certificate where the command asks (engine_tls)
                "yardstick": ({"run": running.yardstick, "version": running.version}
                              if running and running.yardstick else None),
            }

    def on_reply(self, engine: dict | None, *, sent_state: str | None = None) -> None:
        """A heartbeat answer: its `engine` part (the configuration, the restart count), and
        the state the heartbeat said (the platform has now heard of a drain)."""
        with self._lock:
            if sent_state == DRAINING and self._drain is not None and self._drain.acked is None:
                self._drain.acked = time.monotonic()
            if not isinstance(engine, dict):
                return
            config = engine.get("config")
            if self.mode == "platform" and (config is None or isinstance(config, dict)):
                self._config = config
            yardstick = engine.get("yardstick")
            self._yardstick = yardstick if _runnable_yardstick(yardstick) else None
            restart = engine.get("restart")
            if type(restart) is int and restart >= 0:
                if self._restart_seen is None:
                    self._restart_seen = restart  # asked before this agent ran: done by starting
                    self._save_state()
                elif restart > self._restart_seen:
                    self._restart_seen = restart
                    self._restart_wanted = True
                    self._save_state()
                    self.log("The platform asks for an engine restart.")

    # --- the loop ---

    def _run(self) -> None:
        try:
            self._adopt()
            while not self._stopping.is_set():
                self._pump(self.poll_s)
                if self.replaced_by is not None:
                    return
                self._step()
            self._shutdown()
        except Exception as exc:  # the agent goes on heartbeating; the keeper holds the engine
            self.log(f"The engine supervisor failed: {type(exc).__name__}: {exc}")
            self._set(CRASHED, error=f"the supervisor failed: {exc}"[:256])

    def _set(self, state: str, **fields) -> None:
        with self._lock:
            before = (self._status.state, self._status.error, self._status.exit_code)
            self._status.state = state
            for name, value in fields.items():
                setattr(self._status, name, value)
            if state in (READY, CRASHED, STOPPED) and "log_tail" not in fields:
                self._status.log_tail = self._tail()
            if before != (self._status.state, self._status.error, self._status.exit_code):
                self.changed.set()

    def _tail(self) -> list[str]:
        """The log's last lines, the engine key masked: vLLM logs its arguments at start."""
        lines = log_tail(self.log_path)
        for key in engine_keys(self.state_dir):
            lines = [line.replace(key, MASK) for line in lines]
        return lines

    def _wanted(self) -> Launch | None:
        """What should run now, or None (and why, in the status) when nothing can."""
        key = key_fingerprint(read_engine_key(self.state_dir))
        if self._yardstick is not None:
            config = self._yardstick["config"]
            argv = tuple(str(a) for a in config["argv"])
            return Launch(argv, self.mode, str(config.get("version") or "") or None,
                          key_fingerprint=_keyed(argv, key), yardstick=self._yardstick["run"])
        if self.command is not None:
            return Launch(self.command, "command", key_fingerprint=_keyed(self.command, key))
        config = self._config
        if config is None:
            return None
        if not config.get("runnable") or not config.get("argv"):
            return None
        argv = tuple(str(a) for a in config["argv"])
        return Launch(argv, "platform", str(config.get("version") or "") or None,
                      key_fingerprint=_keyed(argv, key))

    def _why_nothing(self) -> str:
        if self._config is None:
            return "waiting for the platform's engine configuration"
        problems = self._config.get("problems") or ["no command"]
        return "the platform cannot configure the engine: " + " ".join(map(str, problems))

    def _argv_for(self, launch: Launch) -> list[str]:
        argv = engine_tls.argv_with_tls(argv_with_key(launch.argv, read_engine_key(self.state_dir)),
                                        self.state_dir)
        if launch.yardstick is not None:
            return self.engine_argv(argv) if self.engine_argv else argv
        return with_model_file(argv, self.model_file) if launch.mode == "platform" else argv

    def model_paths(self) -> list[str]:
        """The model files or directories the running engine was started with."""
        with self._lock:
            return model_files.paths_in(self._running.argv) if self._running else []

    def _step(self) -> None:
        now = time.monotonic()
        with self._lock:
            wanted = self._wanted()
            restart = self._restart_wanted
        if self._link is None:
            if wanted is None:
                state = STARTING if self._config is None else STOPPED
                self._set(state, error=self._why_nothing())
            elif restart or now >= self._next_start:
                self._restart_wanted = False
                self._spawn(wanted)
            return
        new = wanted is not None and wanted.digest != self._running.digest
        state = self._status.state
        if state in (STARTING, LOADING):
            if restart or new:  # it serves nothing yet: no drain
                self._restart_wanted = False
                self._request_stop("a new configuration" if new else "a restart")
            elif self._ready():
                self._ready_at = time.monotonic()
                self._set(READY, error=None)
                self.log(f"Engine ready (pid {self._running.pid}).")
        elif state == READY and (restart or new):
            self._restart_wanted = False
            reason = ("a restart was asked" if not new else
                      "the platform asks for its yardstick" if wanted.yardstick else
                      "the yardstick is done" if self._running.yardstick else
                      "the platform's configuration changed")
            with self._lock:
                self._drain = _Drain(reason=reason, started=now)
            self._set(DRAINING)
            self.log(f"Draining the engine: {reason}.")
        elif state == DRAINING:
            self._drain_step(now)

    def _drain_step(self, now: float) -> None:
        drain = self._drain
        if drain is None or drain.stopping:
            return
        if now - drain.started >= self.drain_timeout_s:
            running = self._in_flight()
            self.log(f"Drain timed out after {self.drain_timeout_s:g} s "
                     f"({running if running is not None else 'unknown'} request(s) in flight).")
            return self._request_stop(drain.reason)
        if drain.acked is None or now - drain.acked < ROUTING_SETTLE_S:
            return
        count = self._in_flight()
        if count is None:
            if now - drain.acked >= UNKNOWN_IN_FLIGHT_WAIT_S:
                self._request_stop(drain.reason)
            return
        drain.zeros = drain.zeros + 1 if count == 0 else 0
        if drain.zeros >= 2:  # twice in a row, a poll apart
            self._request_stop(drain.reason)

    def _request_stop(self, reason: str) -> None:
        if self._drain is not None:
            self._drain.stopping = True
        self._expect_exit = True
        self.log(f"Stopping the engine for {reason}.")
        if not self._link.send({"op": "stop", "timeout": self.stop_timeout_s}):
            self._keeper_gone()

    def _pump(self, timeout: float) -> None:
        """Take the keeper's events (or wait `timeout` when there is no engine)."""
        if self._link is None:
            self._stopping.wait(timeout)
            return
        events = self._link.events(timeout)
        if events is None:
            return self._keeper_gone()
        for event in events:
            kind = event.get("event")
            if kind == "exited":
                self._exited(event.get("returncode"))
                return
            if kind == "replaced":
                self.replaced_by = event.get("by")
                self.log(f"A newer agent (pid {self.replaced_by}) has taken the engine over.")
                self._link.close()
                self._link = None
                self.changed.set()
                return

    def _keeper_gone(self) -> None:
        """The keeper's socket closed with no word: it was killed, and the engine with it
        (PR_SET_PDEATHSIG); where that does not exist, the engine is stopped here."""
        record = self._read_record()
        if process_alive(record.get("engine_pid")):
            _signal_group(record.get("engine_pid"), signal.SIGKILL)
        self._exited(record.get("returncode"), keeper_died=True)

    def _exited(self, returncode, *, keeper_died: bool = False) -> None:
        if self._link is not None:
            self._link.close()
        self._link = None
        if self._keeper is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._keeper.wait(timeout=5)
        self._keeper = None
        now = time.monotonic()
        expected, self._expect_exit = self._expect_exit, False
        with self._lock:
            self._drain = None
            self._running = None
        if expected:  # a restart or the agent's stop: no crash, no delay
            self._next_start, self._ready_at = now, None
            if self._stopping.is_set():
                self._set(STOPPED, exit_code=returncode, error=None)
            else:
                self._set(STARTING, error=None)
            return
        if self._ready_at is not None and now - self._ready_at >= self.backoff.stable_s:
            self._failures = 0
        self._failures += 1
        self._ready_at = None
        delay = self.backoff.delay(self._failures)
        self._next_start = now + delay
        why = "its keeper died" if keeper_died else f"exit code {returncode}"
        self._set(CRASHED, exit_code=returncode, error=f"the engine exited ({why})")
        self.log(f"The engine exited ({why}); restarting in {delay:g} s.")

    # --- starting, adopting, stopping ---

    @contextlib.contextmanager
    def _spawn_lock(self):
        """One agent at a time looks for a keeper and starts one: two agents started at once
        on one state directory must not start two engines."""
        import fcntl  # POSIX: the agent runs the engine on Linux (WSL2 included) and macOS

        with open(self.state_dir / "spawn.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _adopt(self) -> None:
        """Take over the engine an older agent of this state directory runs, if any."""
        with self._spawn_lock():
            link = _KeeperLink.connect(self.socket_path)
            if link is None:
                self._kill_orphan()
                return
            if not self._hello(link):
                return
        self._started = True
        self.log(f"Took over the running engine (pid {self._running.pid}) from the previous "
                 "agent.")
        self._set(READY if self._ready() else LOADING, error=None)
        if self._status.state == READY:
            self._ready_at = time.monotonic()

    def _hello(self, link: _KeeperLink) -> bool:
        link.send({"op": "hello", "pid": os.getpid()})
        status, others, closed = link.wait_for("status", KEEPER_START_S)
        if status is None:
            link.close()
            # An engine that exits at once can be gone before its keeper reads the hello: the
            # keeper says so and closes without a status. That is the engine's exit, with its
            # code, not the keeper's death.
            exited = next((e for e in others if e.get("event") == "exited"), None)
            if exited is not None:
                self._exited(exited.get("returncode"))
            return False
        meta = status.get("meta") or {}
        self._link, self._pgid = link, status.get("pgid")
        with self._lock:
            self._running = _Running(digest=str(meta.get("digest", "")),
                                     mode=str(meta.get("mode", "")),
                                     version=meta.get("version"),
                                     argv=list(meta.get("argv") or []),
                                     pid=status.get("engine_pid"),
                                     key_fingerprint=meta.get("key_fingerprint"),
                                     yardstick=meta.get("yardstick"))
            cert = str(engine_tls.cert_path(self.state_dir))
            self._tls = any(cert in arg for arg in self._running.argv)
        self._metrics_known = None
        for event in others:
            if event.get("event") == "exited":
                self._exited(event.get("returncode"))
                return False
        return True

    def _spawn(self, launch: Launch) -> None:
        key = read_engine_key(self.state_dir)
        # The key read now is the one the engine gets: its fingerprint is what is recorded.
        launch = replace(launch, key_fingerprint=_keyed(launch.argv, key_fingerprint(key)))
        argv = self._argv_for(launch)
        shown = masked(argv, key)
        self._set(STARTING, error=None)
        with self._spawn_lock():
            link = _KeeperLink.connect(self.socket_path)
            if link is not None:  # another agent started one meanwhile: never a second engine
                if self._hello(link):
                    self._set(LOADING)
                return
            self._kill_orphan()
            self._rotate_log()
            spec = {"argv": argv, "log": str(self.log_path), "socket": self.socket_path,
                    "record": str(self.record_path), "stop_timeout_s": self.stop_timeout_s,
                    "meta": {"digest": launch.digest, "mode": launch.mode,
                             "version": launch.version, "argv": shown,
                             "key_fingerprint": launch.key_fingerprint,
                             "yardstick": launch.yardstick}}
            with open(self.log_path, "ab") as out:
                # -I: the keeper imports the standard library only, never a module beside it.
                self._keeper = subprocess.Popen(
                    [sys.executable, "-I", str(KEEPER)], stdin=subprocess.PIPE, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
            self._keeper.stdin.write(json.dumps(spec).encode())
            self._keeper.stdin.close()
            link = self._await_keeper()
            if link is None or not self._hello(link):
                if self._link is None and self._status.state != CRASHED:
                    self._exited(None, keeper_died=True)
                return
        if self._started:
            self._status.restarts += 1
        self._started = True
        self.log(f"Engine started (pid {self._running.pid}): {shlex.join(shown)}")
        self._set(LOADING)

    def _await_keeper(self) -> _KeeperLink | None:
        deadline = time.monotonic() + KEEPER_START_S
        while time.monotonic() < deadline:
            link = _KeeperLink.connect(self.socket_path)
            if link is not None:
                return link
            if self._keeper.poll() is not None:
                return None
            time.sleep(0.02)
        with contextlib.suppress(ProcessLookupError):
            self._keeper.kill()
        return None

    def _shutdown(self) -> None:
        """The agent stops: the engine with it (not one a newer agent took over)."""
        if self._link is None:
            self._set(STOPPED, error=None)
            return
        self._expect_exit = True
        self.log("Stopping the engine.")
        sent = self._link.send({"op": "stop", "timeout": self.stop_timeout_s})
        event, _, _ = (self._link.wait_for("exited", self.stop_timeout_s + 10) if sent
                       else (None, [], True))
        if event is None:  # a keeper that does not answer: the engine's group goes anyway
            _signal_group(self._pgid, signal.SIGKILL)
            if self._keeper is not None:
                with contextlib.suppress(ProcessLookupError):
                    self._keeper.kill()
        self._exited(event.get("returncode") if event else None)
        self.log("Engine stopped.")

    def _kill_orphan(self) -> None:
        """An engine whose keeper is gone (a keeper killed where PR_SET_PDEATHSIG does not
        exist) is stopped before another starts: never two engines. Its pid is checked to
        still run the recorded program, so a reused pid is left alone."""
        record = self._read_record()
        pid = record.get("engine_pid")
        if not process_alive(pid) or record.get("returncode") is not None:
            return
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if os.path.basename(cmdline[0].decode(errors="replace")) != os.path.basename(
                    str(record.get("argv0", ""))):
                return
        self.log(f"Stopping an engine left running (pid {pid}).")
        _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        _signal_group(pid, signal.SIGKILL)

    def _rotate_log(self) -> None:
        with contextlib.suppress(OSError):
            if self.log_path.stat().st_size > LOG_ROTATE_BYTES:
                os.replace(self.log_path, self.log_path.with_suffix(".log.1"))

    def _read_record(self) -> dict:
        try:
            record = json.loads(self.record_path.read_text())
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def _load_state(self) -> dict:
        try:
            state = json.loads((self.state_dir / "supervisor.json").read_text())
        except (OSError, ValueError):
            return {}
        return state if isinstance(state, dict) else {}

    def _save_state(self) -> None:
        path = self.state_dir / "supervisor.json"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps({"restart_seen": self._restart_seen}))
            os.replace(tmp, path)

    # --- asking the engine ---

    def _ready(self) -> bool:
        """The engine answers: /health 200 (vLLM, llama-server), or /v1/models 200 where there
        is no /health (llama-cpp-python's server)."""
        try:
            response = self._http.get(f"{self.engine_url}/health", headers=self.headers())
            if response.status_code == 404:
                response = self._http.get(f"{self.engine_url}/v1/models",
                                          headers=self.headers())
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def _in_flight(self) -> int | None:
        """Requests the engine is running or holding: its /metrics where it has them, else the
        connections open to its port, else None (cannot tell)."""
        if self._metrics_known is not False:
            try:
                response = self._http.get(f"{self.engine_url}/metrics", headers=self.headers())
                count = (queue_from_metrics(response.text) if response.status_code == 200
                         else None)
            except httpx.HTTPError:
                count = None
            if count is not None:
                self._metrics_known = True
                return count
            self._metrics_known = False
        return established_connections(self.port) if self.port else None


def _keyed(argv, fingerprint: str | None) -> str | None:
    """`fingerprint` where the argv carries the engine key, else None (it runs without)."""
    return fingerprint if any(KEY_PLACEHOLDER in arg for arg in argv) else None


def _runnable_yardstick(yardstick) -> bool:
    """A reply's `engine.yardstick` the agent can run: its run, and a command."""
    if not isinstance(yardstick, dict) or type(yardstick.get("run")) is not int:
        return False
    config = yardstick.get("config")
    return (isinstance(config, dict) and bool(config.get("runnable"))
            and isinstance(config.get("argv"), list) and bool(config["argv"]))


def parse_command(text: str) -> list[str]:
    """The provider's `--engine-command` as an argv (shell words, no shell)."""
    argv = shlex.split(text)
    if not argv:
        raise ValueError("the engine command is empty")
    return argv
