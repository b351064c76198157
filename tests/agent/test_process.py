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
