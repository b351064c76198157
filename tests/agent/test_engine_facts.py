"""engine.served: what the agent learns about each model from the engine's GET /v1/models and
from `run`'s flags (docs/agent-protocol.md, section 2). The engines are fleetsim's (vLLM's and
llama-server's shapes) on a real uvicorn server, or a real HTTP server answering shapes
fleetsim does not imitate (llama-cpp-python, nonsense)."""

import httpx
import pytest

from agent import client
from agent.cli import build_parser, main
from fleetsim.fleet import agent_run_args, plan_machines
from fleetsim.profiles import MODEL_27B, PROFILES, get_profile
from fleetsim.server import EngineServer, ServerThread
from tests.agent.fakes import FakeServer

# What `python -m llama_cpp.server --model ... --model_alias qwen3-27b` answers.
LLAMA_CPP_PYTHON = {"object": "list", "data": [
    {"id": "qwen3-27b", "object": "model", "owned_by": "me", "permissions": []}]}


@pytest.fixture
def fleetsim_engine():
    """fleetsim_engine(profile key) -> the base URL of that profile's engine server."""
    servers = []

    def start(key):
        server = ServerThread(EngineServer(get_profile(key))).__enter__()
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        server.__exit__(None, None, None)


@pytest.fixture
def answering():
    """answering(body) -> the URL of a real HTTP engine whose /v1/models answers `body`."""
    servers = []

    def start(body):
        server = FakeServer(lambda request: (200, body))
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def http():
    with httpx.Client() as c:
        yield c


def served(http, url, **flags):
    return client.engine_status(http, url, **flags)["served"]


FLAGS = {"engine_kind": "llama.cpp", "max_context": 4096, "quantization": "fp8"}


# --- each engine's shape ----------------------------------------------------------------------

def test_vllm_says_its_kind_and_context_and_the_flag_gives_quantization(fleetsim_engine, http):
    url = fleetsim_engine("2x-rtx-4090")
    assert client.engine_status(http, url) == {
        "url": url, "reachable": True, "models": [MODEL_27B], "error": None,
        "served": [{"id": MODEL_27B, "engine": "vllm", "max_context": 65_536,
                    "quantization": ""}],
    }
    # The engine's kind and context win over the flags; vLLM never says its quantization.
    assert served(http, url, **FLAGS) == [
        {"id": MODEL_27B, "engine": "vllm", "max_context": 65_536, "quantization": "fp8"}]


def test_llama_server_says_all_three_and_they_win_over_the_flags(fleetsim_engine, http):
    url = fleetsim_engine("m4-max-llamacpp")
    expected = [{"id": MODEL_27B, "engine": "llama.cpp", "max_context": 32_768,
                 "quantization": "Q4_K_M", "files": {
                     "config": {"hidden_size": 5120, "vocab_size": 248_320,
                                "max_position_embeddings": 262_144},
                     "weights_bytes": int(27e9 * 4.85 / 8), "params": 27_000_000_000,
                     "source": "llama-server's model list"}}]
    assert served(http, url) == expected
    assert served(http, url, engine_kind="vllm", max_context=131_072,
                  quantization="bf16") == expected


def test_llama_cpp_python_says_nothing_so_the_flags_fill_in(answering, http):
    url = answering(LLAMA_CPP_PYTHON)
    assert served(http, url) == [
        {"id": "qwen3-27b", "engine": "", "max_context": None, "quantization": ""}]
    assert served(http, url, engine_kind="llama.cpp", max_context=16_384,
                  quantization="Q4_K_M") == [
        {"id": "qwen3-27b", "engine": "llama.cpp", "max_context": 16_384,
         "quantization": "Q4_K_M"}]


# --- nonsense from the engine ---------------------------------------------------------------

@pytest.mark.parametrize("context", [-1, 0, 10_000_001, 10**30, "4096", 4096.5, True, None,
                                     [4096], {"n": 4096}])
def test_a_context_that_is_not_a_token_count_counts_as_unsaid(answering, http, context):
    vllm = answering({"data": [{"id": "m", "owned_by": "vllm", "max_model_len": context}]})
    llama = answering({"data": [{"id": "m", "owned_by": "llamacpp",
                                 "meta": {"n_ctx": context, "ftype": "Q8_0"}}]})
    for url, kind in ((vllm, "vllm"), (llama, "llama.cpp")):
        [model] = served(http, url)
        assert (model["engine"], model["max_context"]) == (kind, None)
        assert served(http, url, max_context=8192)[0]["max_context"] == 8192


@pytest.mark.parametrize("meta", [
    {"n_ctx": 2048, "ftype": 15},
    {"n_ctx": 2048, "ftype": "q" * 65},
    {"n_ctx": 2048, "ftype": ""},
    {"n_ctx": 2048, "ftype": " Q4_K_M "},
    {"n_ctx": 2048, "ftype": "Q4\x00"},
    {"n_ctx": 2048},
])
def test_a_quantization_the_platform_cannot_store_counts_as_unsaid(answering, http, meta):
    url = answering({"data": [{"id": "m", "owned_by": "llamacpp", "meta": meta}]})
    assert served(http, url)[0]["quantization"] == ""
    assert served(http, url, quantization="Q5_K_M")[0] == {
        "id": "m", "engine": "llama.cpp", "max_context": 2048, "quantization": "Q5_K_M"}


@pytest.mark.parametrize("meta", ["junk", None, [1, 2], 7])
def test_a_llama_server_meta_that_is_not_an_object_says_nothing(answering, http, meta):
    url = answering({"data": [{"id": "m", "owned_by": "llamacpp", "meta": meta}]})
    assert served(http, url) == [
        {"id": "m", "engine": "llama.cpp", "max_context": None, "quantization": ""}]


def test_an_unknown_or_odd_owner_says_nothing(answering, http):
    url = answering({"data": [
        {"id": "a", "owned_by": ["vllm"], "max_model_len": 4096},
        {"id": "b", "owned_by": "sglang", "max_model_len": 4096},
        {"id": "c", "max_model_len": 4096, "meta": {"n_ctx": 4096, "ftype": "Q4_0"}},
    ]})
    assert served(http, url) == [
        {"id": i, "engine": "", "max_context": None, "quantization": ""} for i in "abc"]


def test_a_huge_odd_model_list_keeps_what_the_platform_can_store(answering, http):
    junk = [{"id": 5}, {"id": None}, {"id": ""}, {"id": " padded"}, {"id": "x" * 257},
            {"id": "nul\x00"}, {"id": ["a"]}]
    first = {"id": "a", "owned_by": "vllm", "max_model_len": 100}
    again = {"id": "a", "owned_by": "vllm", "max_model_len": 200}  # listed twice: first wins
    many = [{"id": f"m{i}", "owned_by": "vllm", "max_model_len": 1000 + i} for i in range(5000)]
    status = client.engine_status(http, answering({"data": [*junk, first, again, *many]}))
    assert status["reachable"] and status["error"] is None
    assert status["models"] == ["a", *(f"m{i}" for i in range(255))]
    assert [model["id"] for model in status["served"]] == status["models"]
    assert status["served"][0]["max_context"] == 100
    assert status["served"][-1]["max_context"] == 1254


@pytest.mark.parametrize("body", [
    {"data": [{"id": "a"}, "junk"]},
    {"data": [{"id": "a"}, {"name": "b"}]},
    {"data": {"id": "a"}},
    {"data": "a"},
    {"models": []},
    ["a"],
])
def test_an_answer_that_is_not_a_model_list_is_an_error(answering, http, body):
    status = client.engine_status(http, answering(body))
    assert status["reachable"] is False
    assert (status["models"], status["served"]) == ([], [])
    assert status["error"] == "GET /v1/models did not answer an OpenAI-style model list"


# --- `run` --------------------------------------------------------------------------------------

def heartbeat_engine(platform):
    [request] = [r for r in platform.requests if r.path == "/api/agent/heartbeat/"]
    return request.body["engine"]


def run_once(credential_file, engine_url, *flags):
    return main(["run", "--engine-url", engine_url, "--credential-file", str(credential_file),
                 "--once", *flags])


def test_run_reports_served_with_its_flags(platform, credential_file, h200_machine,
                                           fleetsim_engine, capsys):
    url = fleetsim_engine("h200")
    assert run_once(credential_file, url, "--quantization", " bf16 ", "--max-context", "9") == 0
    assert heartbeat_engine(platform)["served"] == [
        {"id": MODEL_27B, "engine": "vllm", "max_context": 262_144, "quantization": "bf16"}]
    err = capsys.readouterr().err
    assert "engine up, 1 model(s); every" in err  # nothing left unknown: no hint


def test_run_says_which_flags_an_engine_that_says_nothing_needs(platform, credential_file,
                                                                h200_machine, answering, capsys):
    url = answering(LLAMA_CPP_PYTHON)
    assert run_once(credential_file, url) == 0
    assert ("engine up, 1 model(s), 1 without engine kind or context (see --engine-kind, "
            "--max-context)") in capsys.readouterr().err
    platform.requests.clear()
    assert run_once(credential_file, url, "--engine-kind", "llama.cpp", "--max-context",
                    "32768", "--quantization", "Q4_K_M") == 0
    assert heartbeat_engine(platform)["served"] == [
        {"id": "qwen3-27b", "engine": "llama.cpp", "max_context": 32_768,
         "quantization": "Q4_K_M"}]
    assert "without engine kind" not in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-context", "0"], "1 to 10,000,000"),
    (["--max-context", "10000001"], "1 to 10,000,000"),
    (["--max-context", "lots"], "1 to 10,000,000"),
    (["--quantization", "  "], "1 to 64 characters"),
    (["--quantization", "q" * 65], "1 to 64 characters"),
    (["--engine-kind", "sglang"], "invalid choice"),
])
def test_bad_flags_are_refused_before_anything_is_sent(platform, credential_file, capsys,
                                                       flags, message):
    with pytest.raises(SystemExit) as exit_:
        run_once(credential_file, "http://127.0.0.1:1", *flags)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert flags[0] in err and message in err
    assert platform.requests == []


@pytest.mark.parametrize("key", sorted(PROFILES))
def test_fleetsim_up_gives_every_agent_what_its_engine_does_not_say(fleetsim_engine, http,
                                                                    tmp_path, key):
    url = fleetsim_engine(key)
    [machine] = plan_machines([key], ["rse_t"], tmp_path, int(url.rsplit(":", 1)[1]))
    args = build_parser().parse_args(agent_run_args(machine))
    profile = get_profile(key)
    # Complete facts, and for llama-server its own `ftype` agrees with the profile's.
    reported = served(http, machine.engine_url, engine_kind=args.engine_kind,
                      max_context=args.max_context, quantization=args.quantization)
    assert [{k: v for k, v in entry.items() if k != "files"} for entry in reported] == [
        {"id": profile.model, "engine": profile.engine, "max_context": profile.context_length,
         "quantization": profile.quantization}]
