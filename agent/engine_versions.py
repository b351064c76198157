"""The heartbeat's `engine_versions`: the engines installed beside the agent and their versions,
as their own packages or programs say (docs/agent-protocol.md). The platform computes the
engine's command for the vLLM it reads here: a flag an older release lacks would stop it.

- vLLM: the program the agent runs the engine with, where that is `vllm` or `python -m
  vllm...`; else the agent's own Python's `vllm` package; else the `vllm` on PATH.
- llama.cpp's llama-server: `llama-server --version` ("version: 6500 (abc1234)", on stderr),
  the agent's engine program where that is llama-server, else the one on PATH.
- llama-cpp-python: the Python that runs `-m llama_cpp.server` for the agent, else the agent's.

A program is asked with a timeout and in its own process group, killed whole when it does not
answer in time. What cannot be read is left out, never guessed; nothing here may stop a
heartbeat. Reading costs a process start or two, so the agent keeps the result (`Reader`).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import shlex
import shutil
import signal
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

VERSION_TIMEOUT_S = 5.0
# The platform refuses a longer version (marketplace.serializers.HeartbeatSerializer).
MAX_VERSION = 64
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]*")
# `vllm --version` prints the version alone on a line (log lines may come first).
_VERSION_LINE = re.compile(r"^\s*v?(\d+\.\d+[0-9A-Za-z.+_-]*)\s*$", re.M)
_LLAMA_SERVER = re.compile(r"version:\s*(\d+)\s*\(")
# Asks a Python for a distribution's version; the distribution's name is its argument.
_ASK_PYTHON = ("import sys, importlib.metadata as m\n"
               "print(m.version(sys.argv[1]))")


def installed(argv: Sequence[str] | None = None, *,
              timeout_s: float = VERSION_TIMEOUT_S) -> dict[str, str]:
    """{"vllm": "0.30.1", "llama-server": "6500", "llama-cpp-python": "0.3.16"}, only the
    engines found. `argv`: the command the agent runs the engine with, if any."""
    argv = [str(word) for word in argv or ()]
    name = Path(argv[0]).name if argv else ""
    module = argv[2] if len(argv) > 2 and argv[1] == "-m" else ""
    found = {}
    if name == "vllm":
        found["vllm"] = program_version(argv[0], "vllm", timeout_s)
    elif module.split(".")[0] == "vllm":
        found["vllm"] = python_version(argv[0], "vllm", timeout_s)
    else:
        found["vllm"] = package_version("vllm") or program_version("vllm", "vllm", timeout_s)
    found["llama-server"] = llama_server_version(
        argv[0] if name == "llama-server" else "llama-server", timeout_s)
    if module.split(".")[0] == "llama_cpp":
        found["llama-cpp-python"] = python_version(argv[0], "llama_cpp_python", timeout_s)
    else:
        found["llama-cpp-python"] = package_version("llama_cpp_python")
    return {kind: version for kind, version in found.items() if version}


class Reader:
    """The versions, read at the agent's first heartbeat and again when the engine it runs is
    started anew (an upgraded engine is restarted to take effect). An engine the provider runs
    is read once per agent run."""

    def __init__(self, read: Callable[..., dict[str, str]] = installed):
        self._read = read
        self._key: tuple | None = None
        self._versions: dict[str, str] = {}

    def get(self, argv: Sequence[str] | None = None, pid: int | None = None) -> dict[str, str]:
        key = (tuple(argv or ())[:3], pid)
        if self._key is None or (key != self._key and pid is not None):
            with contextlib.suppress(Exception):  # never the heartbeat's end
                self._versions = self._read(argv)
            self._key = key
        return dict(self._versions)


def package_version(distribution: str) -> str | None:
    """The distribution's version in the agent's own Python."""
    try:
        return _clean(importlib.metadata.version(distribution))
    except (importlib.metadata.PackageNotFoundError, ValueError, OSError):
        return None


def program_version(program: str, distribution: str,
                    timeout_s: float = VERSION_TIMEOUT_S) -> str | None:
    """A Python program's version: asked of the Python its script names (a start of well
    under a second), or `program --version` where it is no Python script (vLLM's imports
    torch first, which may take longer than the timeout)."""
    path = shutil.which(program)
    if path is None:
        return None
    python = _script_python(path)
    if python:
        return python_version(python, distribution, timeout_s)
    output = _output([path, "--version"], timeout_s)
    match = _VERSION_LINE.findall(output or "")
    return _clean(match[-1]) if match else None


def python_version(python: str, distribution: str,
                   timeout_s: float = VERSION_TIMEOUT_S) -> str | None:
    """The distribution's version as the Python `python` (a path, a name on PATH, or a
    shebang's words) finds it."""
    words = shlex.split(python) if " " in python else [python]
    output = _output([*words, "-c", _ASK_PYTHON, distribution], timeout_s)
    lines = (output or "").strip().splitlines()
    return _clean(lines[-1]) if lines else None


def llama_server_version(program: str = "llama-server",
                         timeout_s: float = VERSION_TIMEOUT_S) -> str | None:
    """llama.cpp's build number ("6500" of "version: 6500 (abc1234)")."""
    path = shutil.which(program)
    if path is None:
        return None
    match = _LLAMA_SERVER.search(_output([path, "--version"], timeout_s) or "")
    return match.group(1) if match else None


def _script_python(path: str) -> str | None:
    """The interpreter a pip-installed script names on its `#!` line, if it is a Python."""
    try:
        with open(path, "rb") as script:
            first = script.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    line = first[2:].decode(errors="replace").strip()
    return line if "python" in line else None


def _output(argv: list[str], timeout_s: float) -> str | None:
    """stdout and stderr together, or None when it cannot run or does not end in time."""
    try:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    except OSError:
        return None
    with process:
        try:
            output, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)  # its children too
            process.communicate()
            return None
    return output.decode(errors="replace") if process.returncode == 0 else None


def _clean(version: str) -> str | None:
    version = (version or "").strip()
    return version if len(version) <= MAX_VERSION and _VERSION.fullmatch(version) else None
