"""agent/engine_versions.py: the engines installed beside the agent, read from fake programs
on PATH and fake Python packages; a program that is missing, says nothing useful or hangs is
left out, in time."""

import os
import sys
import time
from pathlib import Path

import pytest

from agent import engine_versions
from tests.agent.test_cli import heartbeats, run_agent


@pytest.fixture
def bin_dir(tmp_path, monkeypatch):
    """An otherwise empty PATH, and no vLLM or llama-cpp-python in the agent's own Python."""
    path = tmp_path / "bin"
    path.mkdir()
    monkeypatch.setenv("PATH", f"{path}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.setattr(engine_versions, "package_version", lambda distribution: None)
    return path


def program(bin_dir: Path, name: str, body: str, shebang: str = "/bin/sh") -> Path:
    path = bin_dir / name
    path.write_text(f"#!{shebang}\n{body}\n")
    path.chmod(0o755)
    return path


def site_packages(tmp_path: Path, monkeypatch, **distributions) -> Path:
    """A folder of installed distributions (name -> version) that a child Python finds."""
    site = tmp_path / "site"
    for name, version in distributions.items():
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\n"
                                       f"Version: {version}\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    return site


def test_the_programs_on_path_say_their_versions(bin_dir):
    program(bin_dir, "vllm", 'echo "INFO 12-05 loading plugins"; echo 0.30.1')
    # llama-server prints its version on stderr.
    program(bin_dir, "llama-server", 'echo "version: 6500 (abc1234)" >&2\n'
                                     'echo "built with cc (GCC) 13.2 for x86_64-linux-gnu" >&2')
    assert engine_versions.installed() == {"vllm": "0.30.1", "llama-server": "6500"}


def test_missing_programs_are_left_out(bin_dir):
    assert engine_versions.installed() == {}
    assert engine_versions.installed(["vllm", "serve", "m"]) == {}
    assert engine_versions.installed(["/nowhere/llama-server", "-m", "x.gguf"]) == {}


@pytest.mark.parametrize("body", [
    "echo not a version",
    'echo "0.30.1"; exit 1',  # a failing program's word is not taken
    "echo '0.30.1; rm -rf /'",
])
def test_a_program_that_says_no_version_is_left_out(bin_dir, body):
    program(bin_dir, "vllm", body)
    program(bin_dir, "llama-server", body)
    assert engine_versions.installed() == {}


def test_a_hanging_program_is_killed_at_the_timeout(bin_dir, tmp_path):
    """Its children too: the process group goes."""
    pid_file = tmp_path / "child.pid"
    program(bin_dir, "vllm", f"sleep 30 & echo $! > {pid_file}; wait")
    started = time.monotonic()
    assert engine_versions.installed(timeout_s=0.5) == {}
    assert time.monotonic() - started < 5
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_python_script_is_asked_through_its_python(bin_dir, tmp_path, monkeypatch):
    """pip's `vllm` script names its Python: that Python's package metadata answers, without
    the script's own start (which imports torch)."""
    site_packages(tmp_path, monkeypatch, vllm="0.26.3")
    program(bin_dir, "vllm", "raise SystemExit('the script itself must not run')",
            shebang=sys.executable)
    assert engine_versions.installed() == {"vllm": "0.26.3"}


def test_the_command_the_agent_runs_is_asked_first(bin_dir, tmp_path, monkeypatch):
    site_packages(tmp_path, monkeypatch, llama_cpp_python="0.3.16", vllm="0.11.0rc2")
    other = tmp_path / "venv" / "bin"
    other.mkdir(parents=True)
    program(other, "vllm", "echo 0.29.0")
    program(bin_dir, "vllm", "echo 0.30.1")
    assert engine_versions.installed([str(other / "vllm"), "serve", "m"]) == {"vllm": "0.29.0"}
    assert engine_versions.installed([sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
                                     ) == {"vllm": "0.11.0rc2"}
    assert engine_versions.installed([sys.executable, "-m", "llama_cpp.server", "--model", "x"]
                                     ) == {"vllm": "0.30.1", "llama-cpp-python": "0.3.16"}


def test_the_reader_reads_again_only_for_a_new_engine_process():
    calls = []

    def read(argv=None):
        calls.append(argv)
        return {"vllm": f"0.{29 + len(calls)}.0"}

    reader = engine_versions.Reader(read)
    assert reader.get() == {"vllm": "0.30.0"}
    assert reader.get() == {"vllm": "0.30.0"} and len(calls) == 1
    argv = ["vllm", "serve", "m"]
    assert reader.get(argv, None) == {"vllm": "0.30.0"}  # not started yet: nothing new
    assert reader.get(argv, 41) == {"vllm": "0.31.0"}  # started: read again
    assert reader.get(argv, 41) == {"vllm": "0.31.0"} and len(calls) == 2
    assert reader.get(argv, None) == {"vllm": "0.31.0"}  # crashed: kept
    assert reader.get(argv, 42) == {"vllm": "0.32.0"}  # restarted (after an upgrade, say)


def test_a_reader_that_fails_reports_nothing():
    def read(argv=None):
        raise RuntimeError("boom")

    assert engine_versions.Reader(read).get() == {}


def test_the_heartbeat_carries_the_versions(platform, engine, credential_file, h200_machine,
                                            bin_dir):
    program(bin_dir, "llama-server", 'echo "version: 6500 (abc1234)" >&2')
    assert run_agent(credential_file, engine.url, "--once") == 0
    [request] = heartbeats(platform)
    assert request.body["engine_versions"] == {"llama-server": "6500"}


def test_the_heartbeat_leaves_them_out_when_none_is_found(platform, engine, credential_file,
                                                          h200_machine, bin_dir):
    assert run_agent(credential_file, engine.url, "--once") == 0
    [request] = heartbeats(platform)
    assert "engine_versions" not in request.body
