"""The engine's keeper: a small process between the agent and the engine it runs.

The supervisor (agent/supervisor.py) starts `python agent/keeper.py` in a session of its own and
hands it the engine's command on stdin; the keeper starts the engine in another new session
(so that the engine and whatever it starts, vLLM's workers, form one process group the keeper
can signal whole), writes the engine's output to the log file, and answers on a Unix socket in
the agent's state directory. Standard library only, one thread.

Why a keeper rather than the engine as the agent's own child: an agent upgrade must leave
exactly one engine. A new agent connects to the keeper of the running engine instead of
starting a second one, the keeper tells the old agent it has been replaced, and the old agent
leaves without stopping the engine; the engine never had the old agent as its parent, so the
old agent's exit cannot take it down. The engine still dies with its agent:

- the engine gets PR_SET_PDEATHSIG (Linux): SIGKILL the moment its keeper dies, SIGKILL included;
- the keeper stops the engine (SIGTERM to its process group, SIGKILL after the timeout) as soon
  as no agent is connected: an agent that is SIGKILLed closes its socket all the same;
- it stops it when an agent asks (`stop`), and when the keeper itself gets SIGTERM.

Socket protocol: one JSON object per line, both ways.
  agent -> keeper  {"op": "hello", "pid": N}      become an owner; answered with a status event
                   {"op": "status"}               answered with a status event
                   {"op": "stop", "timeout": S}   stop the engine; answered with `exited`
  keeper -> agent  {"event": "status", "engine_pid", "pgid", "started_at", "meta"}
                   {"event": "replaced", "by": N} a newer agent (pid N) has taken over
                   {"event": "exited", "returncode": N or null, "requested": bool}
The keeper exits once the engine has exited and every owner has been told.

The record file (JSON, next to the socket) says which processes are the engine's, for an agent
that finds the keeper gone (a keeper killed on a system without PR_SET_PDEATHSIG).
"""

import ctypes
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
HELLO_WAIT_S = 15.0  # the agent that started the keeper connects well within this
LINE_LIMIT = 64 * 1024


def main() -> int:
    spec = json.loads(sys.stdin.read())
    sys.stdin.close()
    keeper = Keeper(spec)
    return keeper.run()


class Keeper:
    def __init__(self, spec: dict):
        self.spec = spec
        self.stop_timeout = float(spec.get("stop_timeout_s", 30))
        self.selector = selectors.DefaultSelector()
        self.owners: dict[socket.socket, bytearray] = {}
        self.owner_pids: dict[socket.socket, int | None] = {}
        self.had_owner = False
        self.terminate = False
        self.proc: subprocess.Popen | None = None
        self.started_at = time.time()

    # --- the engine ---

    def start_engine(self) -> str | None:
        """Start the engine; an error message when it cannot be started at all."""
        argv = self.spec["argv"]
        env = {**os.environ, **self.spec.get("env", {})}
        log = open(self.spec["log"], "ab", buffering=0)  # noqa: SIM115 (the engine's stdout)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write(f"--- {stamp} rigshare: starting the engine ---\n".encode())
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=_die_with(os.getpid()))
        except OSError as exc:
            message = f"rigshare: cannot start {argv[0]!r}: {exc.strerror or exc}"
            log.write(f"{message}\n".encode())
            return message
        finally:
            log.close()
        return None

    def stop_engine(self) -> int | None:
        """SIGTERM to the engine's process group, SIGKILL after the timeout; its returncode."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        # What the engine started and left behind (a worker that outlived its parent) goes too.
        _signal_group(proc.pid, signal.SIGKILL)
        return proc.returncode

    # --- the socket ---

    def status(self) -> dict:
        return {"event": "status", "engine_pid": self.proc.pid if self.proc else None,
                "pgid": self.proc.pid if self.proc else None, "started_at": self.started_at,
                "meta": self.spec.get("meta", {})}

    def send(self, conn: socket.socket, message: dict) -> None:
        try:
            conn.setblocking(True)
            conn.settimeout(2.0)
            conn.sendall(json.dumps(message).encode() + b"\n")
            conn.setblocking(False)
        except OSError:
            self.drop(conn)

    def broadcast(self, message: dict) -> None:
        for conn in list(self.owners):
            self.send(conn, message)

    def drop(self, conn: socket.socket) -> None:
        if conn in self.owners:
            self.selector.unregister(conn)
            del self.owners[conn]
            self.owner_pids.pop(conn, None)
        conn.close()

    def handle(self, conn: socket.socket, message: dict) -> bool:
        """Act on one message; True once the engine has been stopped on request."""
        op = message.get("op")
        if op == "hello":
            earlier = [c for c in self.owners if c is not conn and self.owner_pids.get(c)]
            self.owner_pids[conn] = message.get("pid")
            self.had_owner = True
            self.send(conn, self.status())
            for other in earlier:
                self.send(other, {"event": "replaced", "by": message.get("pid")})
        elif op == "status":
            self.send(conn, self.status())
        elif op == "stop":
            if "timeout" in message:
                self.stop_timeout = float(message["timeout"])
            self.finish(self.stop_engine(), requested=True)
            return True
        return False

    def finish(self, returncode: int | None, *, requested: bool) -> None:
        why = "stopped" if requested else "exited"
        try:
            with open(self.spec["log"], "ab") as log:
                log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} rigshare: the engine "
                          f"{why} (exit code {returncode}) ---\n".encode())
        except OSError:
            pass
        self.record(returncode=returncode)
        self.broadcast({"event": "exited", "returncode": returncode, "requested": requested})

    def record(self, **extra) -> None:
        data = {"keeper_pid": os.getpid(), "engine_pid": self.proc.pid if self.proc else None,
                "started_at": self.started_at, "argv0": self.spec["argv"][0],
                "meta": self.spec.get("meta", {}), **extra}
        path = self.spec["record"]
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as out:
            json.dump(data, out)
        os.replace(tmp, path)

    # --- the loop ---

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the agent's to handle
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        path = self.spec["socket"]
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is the owner's alone
        try:
            if os.path.exists(path):
                os.unlink(path)  # a dead keeper's: the supervisor checked nobody answers there
            listener.bind(path)
        finally:
            os.umask(old_umask)
        listener.listen(8)
        self.selector.register(listener, selectors.EVENT_READ)
        error = self.start_engine()
        self.record()
        hello_by = time.monotonic() + HELLO_WAIT_S
        try:
            if error is not None:
                return self._failed_start(listener, hello_by)
            while True:
                for key, _ in self.selector.select(timeout=0.2):
                    if key.fileobj is listener:
                        conn, _ = listener.accept()
                        conn.setblocking(False)
                        self.owners[conn] = bytearray()
                        self.owner_pids[conn] = None
                        self.selector.register(conn, selectors.EVENT_READ)
                    elif self._read(key.fileobj):
                        return 0
                returncode = self.proc.poll()
                if returncode is not None:
                    _signal_group(self.proc.pid, signal.SIGKILL)  # its leftovers
                    self.finish(returncode, requested=False)
                    return 0
                if self.terminate or (not self.owners and (
                        self.had_owner or time.monotonic() > hello_by)):
                    # SIGTERM, or no agent left to supervise the engine (its agent died). Not
                    # the agent's request: one still connected restarts the engine.
                    self.finish(self.stop_engine(), requested=False)
                    return 0
        finally:
            for conn in list(self.owners):
                self.drop(conn)
            listener.close()
            try:
                os.unlink(path)
            except OSError:
                pass

    def _failed_start(self, listener, hello_by: float) -> int:
        """The engine could not start: tell the agent that connects (it reads why in the log)."""
        self.record(returncode=127)
        while time.monotonic() < hello_by:
            for key, _ in self.selector.select(timeout=0.2):
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    self.owners[conn] = bytearray()
                    self.selector.register(conn, selectors.EVENT_READ)
                    self.send(conn, self.status())
                    self.send(conn, {"event": "exited", "returncode": 127, "requested": False})
                    return 1
        return 1

    def _read(self, conn: socket.socket) -> bool:
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self.drop(conn)
            return False
        buffer = self.owners[conn]
        buffer += data
        if len(buffer) > LINE_LIMIT:
            self.drop(conn)
            return False
        while b"\n" in buffer:
            line, _, rest = bytes(buffer).partition(b"\n")
            buffer[:] = rest
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict) and self.handle(conn, message):
                return True
            if conn not in self.owners:
                return False
        return False

    def _on_sigterm(self, signum, frame):
        self.terminate = True


def _die_with(keeper_pid: int):
    """The engine's pre-exec step: die with the keeper (Linux: PR_SET_PDEATHSIG), and not be
    left running if the keeper died between fork and this call."""
    prctl = None
    if sys.platform.startswith("linux"):
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
        except (OSError, AttributeError):
            prctl = None

    def preexec():
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != keeper_pid:
            os._exit(1)

    return preexec


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":
    sys.exit(main())
