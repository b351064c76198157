"""The engine supervisor's parts that need no engine (agent/supervisor.py); the engine itself,
for real, is tests/test_engine_supervision.py."""

import socket
import sys
import time

import pytest

from agent import supervisor
from agent.supervisor import KEY_PLACEHOLDER, Backoff, Supervisor


def test_the_key_takes_the_placeholders_place_or_its_flag_goes():
    argv = ["vllm", "serve", "m", "--api-key", KEY_PLACEHOLDER, "--port", "8000"]
    assert supervisor.argv_with_key(argv, "sk-1") == ["vllm", "serve", "m", "--api-key",
                                                       "sk-1", "--port", "8000"]
    assert supervisor.argv_with_key(argv, None) == ["vllm", "serve", "m", "--port", "8000"]
    joined = ["llama-server", f"--api-key={KEY_PLACEHOLDER}", "-c", "4096"]
    assert supervisor.argv_with_key(joined, "sk-1") == ["llama-server", "--api-key=sk-1", "-c",
                                                         "4096"]
    assert supervisor.argv_with_key(joined, None) == ["llama-server", "-c", "4096"]


def test_a_shown_command_never_carries_a_key():
    argv = ["vllm", "serve", "m", "--api-key", "sk-secret", "--api_key=typed-by-hand",
            "--served-model-name", "name-with-sk-secret-inside"]
    assert supervisor.masked(argv, "sk-secret") == [
        "vllm", "serve", "m", "--api-key", "***", "--api_key=***", "--served-model-name",
        "name-with-***-inside"]
    # The placeholder is no secret: shown as the platform wrote it.
    assert supervisor.masked(["x", "--api-key", KEY_PLACEHOLDER]) == [
        "x", "--api-key", KEY_PLACEHOLDER]
    assert len(supervisor.masked(["x" * 5000] * 300)) == supervisor.MAX_ARGV
    assert {len(a) for a in supervisor.masked(["x" * 5000])} == {supervisor.MAX_ARG}


def test_the_model_file_replaces_the_one_the_platform_names():
    argv = ["llama-server", "-m", "qwen3-27b-Q4_K_M.gguf", "--alias", "Qwen/Qwen3-27B"]
    assert supervisor.with_model_file(argv, "/data/q.gguf")[2] == "/data/q.gguf"
    assert supervisor.with_model_file(argv, None) == argv


def test_the_log_tail_is_bounded_and_plain(tmp_path):
    log = tmp_path / "engine.log"
    lines = [f"line {i}" for i in range(100)]
    log.write_bytes(("\n".join(lines) + "\n\x1b[31mred\x1b[0m \x00nul\r\nprogress 50%\r"
                     "progress 100%\n" + "y" * 1000 + "\n").encode())
    tail = supervisor.log_tail(log)
    assert len(tail) == supervisor.LOG_LINES
    assert tail[-4:] == ["red nul", "progress 50%", "progress 100%", "y" * 300]
    assert supervisor.log_tail(tmp_path / "missing.log") == []


def test_requests_in_flight_as_engines_say_them():
    vllm = ('# HELP vllm:num_requests_running x\nvllm:num_requests_running{model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{model_name="m"} 2.0\nvllm:kv_cache_usage_perc 0.5\n')
    assert supervisor.queue_from_metrics(vllm) == 5
    llama = "llamacpp:requests_processing 1\nllamacpp:requests_deferred 0\n"
    assert supervisor.queue_from_metrics(llama) == 1
    assert supervisor.queue_from_metrics("process_cpu_seconds_total 4\n") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/net/tcp is Linux's")
def test_connections_open_to_a_port_are_counted():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert supervisor.established_connections(port) == 0
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        assert supervisor.established_connections(port) == 1
        client.close()
        accepted.close()
        assert supervisor.established_connections(port) == 0


def test_restart_delays_double_up_to_the_cap():
    backoff = Backoff(first_s=1, factor=2, cap_s=60)
    assert [backoff.delay(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]


def wait_state(sup: Supervisor, state: str, timeout: float = 20, **match):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        report = sup.report()
        if report["state"] == state and all(report[k] == v for k, v in match.items()):
            return report
        time.sleep(0.02)
    pytest.fail(f"not {state} {match} within {timeout} s: {sup.report()}")


def test_an_engine_that_keeps_dying_is_restarted_later_each_time(tmp_path):
    logged = []
    sup = Supervisor(state_dir=tmp_path / "state", engine_url="http://127.0.0.1:9",
                     command=[sys.executable, "-c", "print('boom', flush=True); exit(3)"],
                     backoff=Backoff(first_s=0.2, cap_s=0.4), log=logged.append)
    sup.start()
    try:
        crashed = wait_state(sup, "crashed", exit_code=3)
        assert "boom" in crashed["log_tail"]
        assert "rigshare: the engine exited (exit code 3)" in crashed["log_tail"][-1]
        wait_state(sup, "crashed", restarts=2)
    finally:
        sup.stop()
    delays = [line.rsplit("restarting in ", 1)[1] for line in logged if "restarting in" in line]
    assert delays[:3] == ["0.2 s.", "0.4 s.", "0.4 s."]
    assert sup.report()["state"] == "stopped"  # and no engine is started after the stop


def test_a_command_that_cannot_start_is_a_crash_saying_why(tmp_path):
    sup = Supervisor(state_dir=tmp_path / "state", engine_url="http://127.0.0.1:9",
                     command=["/no/such/engine", "--port", "9"], log=lambda line: None)
    sup.start()
    try:
        crashed = wait_state(sup, "crashed", exit_code=127)
    finally:
        sup.stop()
    assert "cannot start '/no/such/engine'" in "\n".join(crashed["log_tail"])


def test_the_platforms_command_is_waited_for_and_its_problems_said(tmp_path):
    sup = Supervisor(state_dir=tmp_path / "state", engine_url="http://127.0.0.1:9",
                     serve="Qwen/Qwen3-27B", quantization="fp8", log=lambda line: None)
    sup.start()
    try:
        waiting = wait_state(sup, "starting",
                             error="waiting for the platform's engine configuration")
        assert (waiting["mode"], waiting["model"], waiting["quantization"]) == (
            "platform", "Qwen/Qwen3-27B", "fp8")
        sup.on_reply({"config": {"version": None, "runnable": False, "argv": [],
                                 "problems": ["The agent reports no GPU."]}, "restart": 0})
        stopped = wait_state(sup, "stopped")
        assert stopped["error"] == ("the platform cannot configure the engine: The agent "
                                    "reports no GPU.")
    finally:
        sup.stop()


def test_restarts_asked_before_the_agent_started_are_not_redone(tmp_path):
    logged = []
    sup = Supervisor(state_dir=tmp_path / "state", engine_url="http://127.0.0.1:9",
                     serve="m", log=logged.append)
    sup.start()
    try:
        sup.on_reply({"config": None, "restart": 5})  # asked long ago: starting is restarting
        assert sup.report()["restart_seen"] == 5 and not sup._restart_wanted
        sup.on_reply({"config": None, "restart": 6})
        assert sup.report()["restart_seen"] == 6 and sup._restart_wanted
    finally:
        sup.stop()
    # Kept in the state directory: the next agent (an upgrade) does not redo it either.
    again = Supervisor(state_dir=tmp_path / "state", engine_url="http://127.0.0.1:9",
                       serve="m", log=logged.append)
    again.start()
    try:
        again.on_reply({"config": None, "restart": 6})
        assert not again._restart_wanted
    finally:
        again.stop()


class _ClosedAfterExit:
    """A keeper link as the supervisor sees it when the engine exited before its keeper read
    the hello: the keeper's `exited` event, then the socket closed, no status."""

    def __init__(self, returncode):
        self.returncode, self.closed = returncode, False

    def send(self, message):
        return True

    def wait_for(self, name, timeout):
        return None, [{"event": "exited", "returncode": self.returncode,
                       "requested": False}], True

    def close(self):
        self.closed = True


def test_an_engine_gone_before_its_keeper_said_hello_is_an_exit_with_its_code(tmp_path):
    sup = Supervisor(state_dir=tmp_path / "state", engine_url="http://127.0.0.1:9",
                     command=[sys.executable, "-c", "exit(3)"], backoff=Backoff(first_s=30),
                     log=lambda line: None)
    link = _ClosedAfterExit(3)
    assert sup._hello(link) is False and link.closed
    report = sup.report()
    assert (report["state"], report["exit_code"]) == ("crashed", 3)
    assert "keeper" not in (report["error"] or "")


def test_the_engine_key_reaches_the_engine_and_nothing_the_platform_sees(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("RIGSHARE_ENGINE_KEY", "sk-node-key-77")
    script = "import sys; print('args:', sys.argv[1:], flush=True); exit(1)"
    sup = Supervisor(state_dir=tmp_path / "state", engine_url="http://127.0.0.1:9",
                     command=[sys.executable, "-c", script, "--api-key", KEY_PLACEHOLDER],
                     backoff=Backoff(first_s=30), log=lambda line: None)
    sup.start()
    try:
        crashed = wait_state(sup, "crashed", exit_code=1)
    finally:
        sup.stop()
    # The engine got the key (it printed it); the report shows *** in its place everywhere.
    assert "sk-node-key-77" in (tmp_path / "state" / "engine.log").read_text()
    assert "args: ['--api-key', '***']" in crashed["log_tail"]
    assert crashed["argv"][-2:] == ["--api-key", "***"]
    assert "sk-node-key-77" not in repr(sup.report())


@pytest.mark.parametrize("args, said", [
    (["--once", "--serve", "m"], "--once reports once: it cannot run the engine"),
    (["--model-file", "/m.gguf", "--engine-url", "http://127.0.0.1:9"],
     "--model-file goes with --serve."),
    (["--engine-command", "vllm serve m", "--model-file", "/m.gguf"],
     "--model-file goes with --serve."),
    (["--engine-command", "  "], "--engine-command: the engine command is empty."),
    ([], "Give --engine-url (the engine you run), or let the agent run the engine"),
])
def test_run_says_what_it_cannot_do(credential_file, capsys, args, said):
    from agent.cli import main

    assert main(["run", "--credential-file", str(credential_file), *args]) == 1
    assert said in capsys.readouterr().err
