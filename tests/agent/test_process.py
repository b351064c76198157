"""The agent as a provider runs it: a separate Python process."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Runs `python -m agent ARGS` and, at exit, prints every module that was imported.
WRAPPER = """
import atexit, json, runpy, sys
atexit.register(lambda: print("MODULES " + json.dumps(sorted(sys.modules)), file=sys.stderr))
sys.argv[0] = "agent"
runpy.run_module("agent", run_name="__main__", alter_sys=True)
"""


def agent_process(*args):
    return subprocess.Popen([sys.executable, "-c", WRAPPER, *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_agent_imports_no_django(platform, engine, credential_file):
    process = agent_process("run", "--once", "--engine-url", engine.url,
                            "--credential-file", str(credential_file))
    out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert len(platform.requests) == 1  # it really ran a heartbeat
    modules = json.loads(err.split("MODULES ", 1)[1])
    assert {"agent.cli", "agent.nvml", "httpx"} <= set(modules)  # the list is the real one
    forbidden = [m for m in modules
                 if m.split(".")[0] in ("django", "rest_framework", "celery")]
    assert forbidden == []


def test_sigterm_stops_the_loop_cleanly(platform, engine, credential_file):
    process = agent_process("run", "--interval", "0.05", "--engine-url", engine.url,
                            "--credential-file", str(credential_file))
    deadline = time.monotonic() + 20
    while not platform.requests and time.monotonic() < deadline:
        time.sleep(0.02)
    assert platform.requests, "the agent never sent a heartbeat"
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=10)
    assert process.returncode == 0, err
    assert "Stopped." in err and "Traceback" not in err


# An engine that takes its time to stop, as a real one does (it frees the GPU, flushes its logs).
SLOW_TO_STOP = ("import signal, sys, time; "
                "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.5), sys.exit(0))); "
                "time.sleep(600)")


def _running(pid) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError, TypeError):
        return False


def test_a_signal_while_stopping_does_not_leave_the_engine_behind(platform, credential_file,
                                                                    tmp_path):
    """Ctrl-C reaches every process of a terminal's group, and whatever runs the agent (a
    terminal script, systemd, a supervisor of its own) sends SIGTERM soon after: that second
    signal must not cut the agent's stop short and leave its engine running without it."""
    state = tmp_path / "engine-state"
    process = agent_process("run", "--interval", "0.05", "--credential-file", str(credential_file),
                            "--engine-url", "http://127.0.0.1:9/v1",
                            "--engine-command", f"{sys.executable} -c {json.dumps(SLOW_TO_STOP)}",
                            "--state-dir", str(state), "--stop-timeout", "10")
    deadline = time.monotonic() + 20
    pid = None
    while pid is None or not _running(pid):
        assert time.monotonic() < deadline and process.poll() is None, process.stderr.read()
        time.sleep(0.05)
        try:
            pid = json.loads((state / "engine.json").read_text()).get("engine_pid")
        except (OSError, ValueError):
            pass
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGINT):
        process.send_signal(sig)
        time.sleep(0.2)
    out, err = process.communicate(timeout=30)
    assert not _running(pid), "the agent exited before its engine"
    assert process.returncode == 0, err
    assert "Engine stopped." in err and "Traceback" not in err
