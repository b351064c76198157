"""What the machine's own files say of a model its engine serves: the fields of its config.json
that size it, and the bytes of its weights on disk. The platform judges a model's serving speed
from its size; a model whose name states none (a house fine-tune, a model served under another
name) is sized from here. Standard library only.

Where the agent looks, first found wins:
- llama-server's /v1/models entry: `meta.n_params` and `meta.size` (the GGUF's bytes);
- a GGUF file (llama.cpp's `-m`, or a path the engine names): its size and its header's
  metadata (layers, heads, KV heads, width, context), read up to the tensors;
- a model directory (vLLM's `root` when it is a path, or the Hugging Face cache entry of the
  hub id it names, `$HF_HUB_CACHE` or `$HF_HOME/hub`): its config.json and the bytes of its
  weight files (*.safetensors, *.bin, *.pt, *.gguf).

Results are kept per file and modification time: a heartbeat re-reads nothing that did not
change, and reports the same facts every time.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

# The config.json fields that size a model (marketplace/modelmath.py reads them), and no other:
# the heartbeat carries these alone.
CONFIG_KEYS = frozenset({
    "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings",
    "max_position_embeddings", "layer_types", "full_attention_interval",
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "mamba_ssm_dtype",
    "mtp_num_hidden_layers", "num_experts", "num_local_experts", "moe_intermediate_size",
    "num_experts_per_tok", "shared_expert_intermediate_size", "dtype", "torch_dtype",
})
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
MAX_CONFIG_BYTES = 1 << 20
MAX_GGUF_HEADER_BYTES = 64 << 20  # the metadata, vocabulary included, before the tensors
MAX_LIST = 512  # layer_types of the deepest models fit
_CACHE: dict[tuple, dict | None] = {}

# GGUF metadata value types (ggml's gguf.h): how many bytes each scalar takes.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# GGUF keys (after "<architecture>.") and the config.json field each one is.
_GGUF_FIELDS = {
    "block_count": "num_hidden_layers", "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "attention.key_length": "head_dim",
    "context_length": "max_position_embeddings", "feed_forward_length": "intermediate_size",
    "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
}


def read(entry: dict, *, paths: list[str] = ()) -> dict | None:
    """`files` for one /v1/models entry: {"config": {...}, "weights_bytes": N, "params": N,
    "source": "..."} with what could be read (absent keys: not read), or None where nothing
    could. `paths`: files or directories the engine was started with (its argv)."""
    meta = entry.get("meta") if isinstance(entry.get("meta"), dict) else {}
    found = _from_llamacpp_meta(meta)
    if found:
        return found
    candidates = [*paths]
    for name in (entry.get("root"), entry.get("id")):
        if isinstance(name, str) and name:
            candidates.append(name)
    for candidate in candidates:
        found = _from_path(candidate)
        if found:
            return found
    return None


def paths_in(argv: list[str]) -> list[str]:
    """The model files or directories an engine command names: llama.cpp's `-m`/`--model`,
    vLLM's `serve MODEL` or `--model`. A Python interpreter's own `-m` names a module."""
    out = []
    python = bool(argv) and Path(argv[0]).name.startswith("python")
    for i, word in enumerate(argv[:-1]):
        if word == "-m" and python and i == 1:
            continue
        if word in ("-m", "--model") or (word == "serve" and not argv[i + 1].startswith("-")):
            out.append(argv[i + 1])
    return out


def _from_llamacpp_meta(meta: dict) -> dict | None:
    params, size = meta.get("n_params"), meta.get("size")
    if not (_count(params) and _count(size)):
        return None
    config = {k: v for k, v in (("hidden_size", meta.get("n_embd")),
                                ("vocab_size", meta.get("n_vocab")),
                                ("max_position_embeddings", meta.get("n_ctx_train")))
              if _count(v)}
    return {"config": config, "weights_bytes": size, "params": params,
            "source": "llama-server's model list"}


def _count(value) -> bool:
    return type(value) is int and 0 < value < 10**15


def _from_path(name: str) -> dict | None:
    path = _resolve(name)
    if path is None:
        return None
    try:
        stat = path.stat()
    except OSError:
        return None
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    if key not in _CACHE:
        _CACHE[key] = _read_gguf(path) if path.is_file() else _read_directory(path)
    return _CACHE[key]


def _resolve(name: str) -> Path | None:
    """A file or directory on this machine that `name` is: a path, or a hub id in the Hugging
    Face cache (its newest snapshot)."""
    try:
        path = Path(name).expanduser()
        if path.is_absolute() or name.startswith("."):
            return path if path.exists() else None
    except (OSError, ValueError):
        return None
    if name.count("/") != 1:
        return None
    org, model = name.split("/")
    home = os.environ.get("HF_HOME") or os.path.join(Path.home(), ".cache", "huggingface")
    cache = Path(os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub"))
    snapshots = cache / f"models--{org}--{model}" / "snapshots"
    try:
        found = sorted((p for p in snapshots.iterdir() if p.is_dir()),
                       key=lambda p: p.stat().st_mtime)
    except OSError:
        return None
    return found[-1] if found else None


def _read_directory(path: Path) -> dict | None:
    config = {}
    try:
        raw = (path / "config.json").read_bytes()[:MAX_CONFIG_BYTES]
        config = _config_fields(json.loads(raw))
    except (OSError, ValueError):
        pass
    weights = 0
    try:
        for item in path.iterdir():
            if item.name.endswith(WEIGHT_SUFFIXES):
                weights += item.stat().st_size  # a hub snapshot's links: the blob's size
    except OSError:
        pass
    if not config and not weights:
        return None
    found = {"source": f"config.json and weights in {path}"[:256]}
    if config:
        found["config"] = config
    if weights:
        found["weights_bytes"] = weights
    return found


def _config_fields(config) -> dict:
    """The sizing fields of a config.json (a multimodal one's `text_config` merged over)."""
    if not isinstance(config, dict):
        return {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    merged = {**config, **text}
    out = {}
    for key in CONFIG_KEYS:
        value = merged.get(key)
        if isinstance(value, bool | int | float) or (isinstance(value, str) and len(value) < 64):
            out[key] = value
        elif (isinstance(value, list) and len(value) <= MAX_LIST
              and all(isinstance(v, str) and len(v) < 64 for v in value)):
            out[key] = value
    return out


def _read_gguf(path: Path) -> dict | None:
    if path.suffix != ".gguf":
        return None
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            metadata = gguf_metadata(f)
    except (OSError, ValueError, struct.error):
        return None
    arch = metadata.get("general.architecture")
    config = {}
    if isinstance(arch, str):
        for suffix, field in _GGUF_FIELDS.items():
            value = metadata.get(f"{arch}.{suffix}")
            if type(value) is int and value > 0:
                config[field] = value
    vocab = metadata.get("tokenizer.ggml.tokens")
    if isinstance(vocab, int) and vocab > 0:
        config["vocab_size"] = vocab
    found = {"weights_bytes": size, "source": f"the GGUF file {path}"[:256]}
    if config:
        found["config"] = config
    return found


def gguf_metadata(f) -> dict:
    """The key-value metadata of a GGUF file (version 2 or 3), up to its tensor list. Arrays
    are reported by their length only (the vocabulary is an array of strings)."""
    start = f.tell()
    if f.read(4) != b"GGUF":
        raise ValueError("not a GGUF file")
    version, = struct.unpack("<I", f.read(4))
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}")
    _, count = struct.unpack("<QQ", f.read(16))
    metadata = {}
    for _ in range(min(count, 100_000)):
        key = _gguf_string(f)
        kind, = struct.unpack("<I", f.read(4))
        metadata[key] = _gguf_value(f, kind)
        if f.tell() - start > MAX_GGUF_HEADER_BYTES:
            break
    return metadata


def _gguf_string(f) -> str:
    length, = struct.unpack("<Q", f.read(8))
    if length > 1 << 20:
        raise ValueError("GGUF string too long")
    return f.read(length).decode("utf-8", "replace")


def _gguf_value(f, kind: int):
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if kind == _STRING:
        return _gguf_string(f)
    if kind == _ARRAY:
        item, length = struct.unpack("<IQ", f.read(12))
        if item in _SCALARS:
            f.seek(struct.calcsize(_SCALARS[item]) * length, os.SEEK_CUR)
        else:
            for _ in range(length):
                _gguf_value(f, item)
        return length
    raise ValueError(f"GGUF value type {kind}")
