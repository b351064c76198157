"""What the agent reads of a model's size from the machine's own files (agent/model_files.py):
a real GGUF's header, a model directory, the Hugging Face cache, llama-server's model list, and
nonsense that must never stop a heartbeat."""

import json
import struct

import pytest

from agent import model_files
from tests.engine import gguf_path


@pytest.fixture(autouse=True)
def _fresh_cache():
    model_files._CACHE.clear()


def test_a_real_gguf_header_gives_the_models_shape_and_the_file_its_size():
    path = gguf_path()  # SmolLM2-135M-Instruct at Q4_1, the engine the suite runs
    found = model_files.read({"id": "smollm2"}, paths=[str(path)])
    assert found["weights_bytes"] == path.stat().st_size
    assert found["config"] == {"num_hidden_layers": 30, "hidden_size": 576,
                               "num_attention_heads": 9, "num_key_value_heads": 3,
                               "max_position_embeddings": 8192, "intermediate_size": 1536,
                               "vocab_size": 49152}
    assert model_files.paths_in(["python", "-m", "llama_cpp.server", "--model", str(path)]) \
        == [str(path)]


def test_a_model_directory_and_a_hub_id_in_the_cache(tmp_path, monkeypatch):
    model = tmp_path / "house"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 40, "hidden_size": 5120, "num_attention_heads": 32,
        "num_key_value_heads": 8, "architectures": ["MistralForCausalLM"],
        "text_config": {"vocab_size": 131072}, "secret": "x" * 10}))
    for i in range(2):
        with open(model / f"model-0000{i}.safetensors", "wb") as f:
            f.truncate(10**9)
    (model / "README.md").write_text("not weights")
    found = model_files.read({"id": "acme/house", "root": str(model)})
    assert found["weights_bytes"] == 2 * 10**9
    assert found["config"] == {"num_hidden_layers": 40, "hidden_size": 5120,
                               "num_attention_heads": 32, "num_key_value_heads": 8,
                               "vocab_size": 131072}
    # The same under a hub id, in the Hugging Face cache: its newest snapshot.
    snapshot = tmp_path / "hub" / "models--acme--house" / "snapshots" / "abc"
    snapshot.parent.mkdir(parents=True)
    model.rename(snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_files.read({"id": "served-name", "root": "acme/house"})["weights_bytes"] \
        == 2 * 10**9
    assert model_files.read({"id": "acme/missing"}) is None


def test_llama_servers_own_word_comes_first():
    found = model_files.read({"id": "m", "meta": {"n_params": 8_030_000_000,
                                                  "size": 4_920_000_000, "n_embd": 4096}})
    assert found == {"config": {"hidden_size": 4096}, "weights_bytes": 4_920_000_000,
                     "params": 8_030_000_000, "source": "llama-server's model list"}


@pytest.mark.parametrize("content", [
    b"GGUF", b"GGUF" + struct.pack("<I", 9) + b"\0" * 16,  # a version it does not know
    b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**40),  # a giant key
    b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 3) + b"abc"
    + struct.pack("<I", 99),  # an unknown value type
    b"not a gguf at all",
])
def test_a_broken_file_is_read_as_nothing_or_its_size_never_an_error(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    assert model_files.read({"id": "m"}, paths=[str(path)]) is None
    (tmp_path / "config.json").write_text("{not json")
    # Its directory: no config to read, the file's bytes as the weights'.
    assert model_files.read({"id": "m", "root": str(tmp_path)}) == {
        "source": f"config.json and weights in {tmp_path}", "weights_bytes": len(content)}
