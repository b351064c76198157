"""A node's engine configuration: the command that serves a model on this machine, every flag
with its reason, the flags that differ from what one fleet-wide command would carry, and the
operator's or provider's overrides on top. Pure: plain values in and out, no ORM.
marketplace/selectors.py feeds it a node's stored facts and overrides; the provider's machine
page shows it; `EngineConfig.to_json()` is what the heartbeat reply will carry to the agent
that runs the engine (docs/engine-config.md).

Why per node (FACTS.md): one configuration for a whole fleet is the weakest card's. An RTX 5090
ran at 8% of its memory bandwidth because a flag a 24 GB card needed was applied fleet-wide;
two arguments given only to the cards that could take them made it 15x faster. On 2x RTX 4090,
splitting a 27B model over both cards (tensor parallel) beat two replicas by 2-4x. vLLM leaves
prefix caching off on hybrid (Mamba-style) models unless told, and with it a repeated
13,000-token prompt went from 7.2 s to 1.6 s.

The memory arithmetic is marketplace/modelmath.py's (weights, KV per token, vLLM's blocks and a
hybrid's state blocks, llama.cpp's cells); this module decides what to ask the engine for with
it. The rules, each stated where it is applied:

- The engine: GGUF weights, Apple Silicon (no CUDA) and cards below compute capability 7.0
  run llama.cpp's llama-server; everything else vLLM.
- vLLM on several GPUs: as many replicas (data parallel) as serve well, else the fewest GPUs
  per replica (tensor parallel) that do. A replica serves well when its KV pool holds
  CONCURRENT_AT_MAX_LEN requests of WELL_SERVED_CONTEXT tokens (or the model's whole context,
  if shorter).
- --gpu-memory-utilization: vLLM's 0.9, 0.95 on cards of 80 GiB or more, less under WSL2.
- --kv-cache-dtype fp8 only where the card has FP8 (compute capability 8.9+) and a 16-bit
  cache would not hold CONCURRENT_AT_MAX_LEN requests of the longest length.
- --max-model-len: the model's own limit, or less where the pool would not hold
  CONCURRENT_AT_MAX_LEN requests of it (one long prompt must not evict everyone else).
- --max-num-seqs: the requests of TYPICAL_REQUEST_TOKENS the pool holds at once, at most
  vLLM's own default for the card.
- Hybrid models: prefix caching said explicitly, in align mode, with a prefix-match unit
  that divides the large hybrid block.

Flags are vLLM's as documented for VLLM_VERSION, less those the node's own vLLM (as its agent
reports it) lacks, and llama.cpp's llama-server as its tools/server/README.md lists them; the
sources are named at each flag's rule.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from agent import engine_tls as agent_tls
from marketplace import modelmath
from marketplace.modelmath import GIB, Architecture

MIB = 2**20

# The vLLM release whose flags this module writes: `--mamba-cache-mode` and
# `--prefix-match-unit` as docs.vllm.ai/en/v0.30.0/features/automatic_prefix_caching/
# documents them. The command is computed for the vLLM the node's agent reports installed
# (Node.engine_versions), this one where it says none; the flags that need a newer release
# than the node's are left out (an unknown flag stops vLLM at start).
VLLM_VERSION = (0, 30)
# `--prefix-match-unit` (CacheConfig.prefix_match_unit): measured on vLLM 0.27.1
# (noonghunna/club-3090 PR #1262) and documented for 0.30.
PREFIX_MATCH_UNIT_SINCE = (0, 27)
# `--mamba-cache-mode` (CacheConfig.mamba_cache_mode, "all" | "align" | "none"): in v0.16.0's
# CacheConfig, absent from v0.10.2's; the releases between are not checked, so 0.16.
MAMBA_CACHE_MODE_SINCE = (0, 16)

# What `--api-key` carries in the command the platform sends: the agent that runs the engine
# puts the node's engine key (engine_keys.py) in its place. Requests without
# `Authorization: Bearer <key>` are refused by both engines (FACTS.md).
ENGINE_KEY_PLACEHOLDER = "${RIGSHARE_ENGINE_KEY}"
# What the TLS flags carry: the agent puts the paths of the key and self-signed certificate it
# made in their place, and reports the certificate for the platform to pin (engine_tls.py).
TLS_KEY_PLACEHOLDER, TLS_CERT_PLACEHOLDER = agent_tls.TLS_KEY, agent_tls.TLS_CERT
PLACEHOLDERS = (ENGINE_KEY_PLACEHOLDER, TLS_KEY_PLACEHOLDER, TLS_CERT_PLACEHOLDER)
VLLM_PORT = 8000

# A replica serves well when its KV pool holds this many requests of its longest length at
# once: fewer, and one long prompt holds the pool while the others wait.
CONCURRENT_AT_MAX_LEN = 4
# ...and that longest length is at least this (a long conversation or a document), or the
# model's whole context where that is shorter.
WELL_SERVED_CONTEXT = 32_768
# Below this longest request a node is not worth serving the model from.
MIN_CONTEXT = 4_096
# The request --max-num-seqs is sized on: a chat turn with some history, prompt and output.
TYPICAL_REQUEST_TOKENS = 4_096
CONTEXT_STEP = 1_024  # a context cut by memory is rounded down to a multiple of this
# vLLM's own --max-num-seqs for an OpenAI server: 1024 on cards of 70 GiB or more (A100s
# excepted), else 256 (vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults).
VLLM_DEFAULT_MAX_NUM_SEQS, VLLM_DEFAULT_MAX_NUM_SEQS_LARGE = 256, 1024
VLLM_LARGE_CARD_BYTES = 70 * GIB
# On cards this large the 10% vLLM leaves by default is 8 GiB or more; 5% still covers the
# CUDA context and NCCL's buffers, which live outside vLLM's share.
LARGE_CARD_BYTES = 80 * GIB
LARGE_CARD_UTILIZATION = 0.95
# WSL2: Windows keeps part of the card. Its desktop took 1,528 MiB of an RTX 4090 at idle
# (nvidia-smi in microsoft/WSL#11050), and WSL2's CUDA driver up to 1.31 GiB more that the
# Linux side cannot see (noonghunna/club-3090#102: 0.95 failed, 0.944 started). vLLM refuses
# to start when the card's free memory is below the share it asks for.
WSL2_WINDOWS_BYTES = 1_528 * MIB + 1.31 * GIB
# vLLM needs compute capability 7.0 or newer (its GPU installation guide); FP8 arithmetic in
# hardware starts with Ada (8.9).
VLLM_MIN_CC = (7, 0)
FP8_MIN_CC = (8, 9)
# A prefix-match unit is a multiple of the 16-token attention kernel block and must divide
# every KV cache group's block (vllm/config/cache.py, CacheConfig.prefix_match_unit); the
# finest we ask for is 16 tokens, the coarsest 64 (the unit vLLM's docs use).
PREFIX_MATCH_UNITS = (64, 48, 32, 16)

# llama.cpp: parallel slots a node runs at most. Its slots share a weight read, but Metal's
# and CUDA's batched kernels gain little beyond a few (fleetsim's M4 Max: ~2x at 4).
LLAMACPP_SLOTS = 4
LLAMACPP_ALL_LAYERS = 999  # -ngl above any model's layer count: every layer on the GPU
# With layers left on the CPU, each slot gets this much context at most.
LLAMACPP_OFFLOAD_CONTEXT = 8_192
# Metal lets a process wire about two thirds of unified memory on Macs of up to 36 GB and
# three quarters above (recommendedMaxWorkingSetSize: 21,845 MB of a 32 GB M1 Max in
# llama.cpp PR #2011; ~47 GB of a 64 GB M2 Max in ggml-org/llama.cpp#1870).
METAL_SHARE_SMALL, METAL_SHARE, METAL_SMALL_BYTES = 2 / 3, 0.75, 36 * GIB


def parse_vllm_version(text) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version as its package says it: "0.30.1" -> (0, 30),
    "0.11.0rc2" -> (0, 11), "0.9.2.dev123+gabc1234" -> (0, 9); None for anything else."""
    match = _VLLM_VERSION.fullmatch(text.strip()) if isinstance(text, str) else None
    return (int(match.group(1)), int(match.group(2))) if match else None


_VLLM_VERSION = re.compile(r"v?(\d{1,4})\.(\d{1,4})(?:[.+-]?[0-9A-Za-z][0-9A-Za-z.+_-]*)?")


def vllm_version_text(version: tuple[int, int] | None) -> str:
    """The vLLM a command is computed for, and where that version comes from."""
    if version is None:
        return f"vLLM {VLLM_VERSION[0]}.{VLLM_VERSION[1]} (assumed: the agent did not say)"
    return f"vLLM {version[0]}.{version[1]} (as the agent reported)"


class OverrideError(ValueError):
    """An override the platform does not accept: its message is shown beside the field."""


# --- what the engine configuration is computed from --------------------------------------------

@dataclass(frozen=True)
class Gpu:
    """One GPU as the agent reported it (and verification measured it)."""

    name: str
    memory_mib: int
    compute_capability: str = ""  # "8.9"; "" where NVML gave none (Apple Silicon)
    bandwidth_gbs: float | None = None  # measured (STREAM triad), None before verification
    pcie_gen: int | None = None

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB

    @property
    def cc(self) -> tuple[int, int] | None:
        match = re.fullmatch(r"(\d+)\.(\d+)", self.compute_capability or "")
        return (int(match.group(1)), int(match.group(2))) if match else None


@dataclass(frozen=True)
class NodeFacts:
    """A machine as its heartbeats describe it."""

    gpus: tuple[Gpu, ...]
    os: str = ""
    nvidia: bool = True
    # GPUs joined by NVLink (nvlink_joined: each reports links up) rather than PCIe alone.
    # False: joined by PCIe alone, or not known (an agent that does not say). The tensor
    # parallel reason names the link; the layout is chosen by memory alone.
    nvlink: bool = False

    @property
    def wsl(self) -> bool:
        return "microsoft" in self.os.lower()  # WSL's kernel release (FACTS.md)

    @property
    def apple(self) -> bool:
        return self.os.lower().startswith("darwin") or any(
            "apple" in gpu.name.lower() for gpu in self.gpus)

    @classmethod
    def from_report(cls, report: Mapping) -> NodeFacts:
        """From a heartbeat's hardware part (docs/agent-protocol.md: `os`, `nvidia`, `gpus`
        with `name`, `memory_total_mib`, `compute_capability`, `pcie_gen_max`,
        `nvlink_links`)."""
        reported = [gpu for gpu in report.get("gpus") or [] if gpu.get("memory_total_mib")]
        gpus = tuple(Gpu(name=gpu.get("name") or "", memory_mib=int(gpu["memory_total_mib"]),
                         compute_capability=gpu.get("compute_capability") or "",
                         bandwidth_gbs=gpu.get("bandwidth_gbs"),
                         pcie_gen=gpu.get("pcie_gen_max"))
                     for gpu in reported)
        return cls(gpus=gpus, os=report.get("os") or "", nvidia=bool(report.get("nvidia")),
                   nvlink=nvlink_joined(gpu.get("nvlink_links") for gpu in reported))


def nvlink_joined(links) -> bool:
    """Whether GPUs that report these NVLink link counts (None: not known) are joined by
    NVLink: more than one GPU, each with a link up. NVML's count does not say which GPU a link
    reaches, so cards bridged in pairs count as joined too."""
    links = list(links)
    return len(links) > 1 and all(links)


# --- what it computes ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Flag:
    """One flag of the command: its value, why, and what a fleet-wide command would say."""

    name: str  # as written on the command line: "--max-model-len", "-c"
    value: str  # for a switch: "on" or "off"
    reason: str
    # What one command for the whole fleet carries here: the engine's own default
    # (None: the flag is absent from such a command).
    default: str | None = None
    default_reason: str = ""  # what that default is, where it is not plain
    switch: bool = False
    negation: str | None = None  # a switch's argv when "off" (None: left out)
    overridden: bool = False
    # An override's: what the platform computes without the overrides (None: no such flag)
    computed: str | None = None
    override_reason: str = ""  # an override's: why it was set

    @property
    def differs(self) -> bool:
        if self.switch:
            return self.value != (self.default or "off")
        return self.value != self.default

    def argv(self) -> list[str]:
        if self.switch:
            if self.value == "on":
                return [self.name]
            return [self.negation] if self.negation else []
        return [self.name, self.value]

    def to_json(self) -> dict:
        return {"flag": self.name, "value": self.value, "reason": self.reason,
                "default": self.default, "differs": self.differs,
                "overridden": self.overridden, "computed": self.computed,
                "override_reason": self.override_reason}


@dataclass(frozen=True)
class Ignored:
    """A stored override that does not apply to this configuration, and why."""

    flag: str
    value: str
    reason: str


@dataclass(frozen=True)
class EngineConfig:
    engine: str  # "vllm" or "llama.cpp"
    model: str
    program: tuple[str, ...]  # ("vllm", "serve", MODEL) or ("llama-server",)
    layout: str  # "one GPU", "tensor parallel 2", "2 replicas (data parallel)", ...
    layout_reason: str
    flags: tuple[Flag, ...] = ()
    problems: tuple[str, ...] = ()  # why this node cannot serve the model (then no command)
    ignored: tuple[Ignored, ...] = ()
    notes: tuple[str, ...] = ()
    figures: Mapping[str, float | int | str] = field(default_factory=dict)
    # The engine release the flags are for (vllm_version_text); "" for llama.cpp.
    engine_version: str = ""

    @property
    def runnable(self) -> bool:
        return not self.problems

    @property
    def argv(self) -> tuple[str, ...]:
        return (*self.program, *(part for flag in self.flags for part in flag.argv()))

    def command(self) -> str:
        """The argv as one shell line (the placeholder key left for the shell to expand)."""
        return " ".join(part if part in PLACEHOLDERS else shlex.quote(part)
                        for part in self.argv)

    def flag(self, name: str) -> Flag | None:
        return next((flag for flag in self.flags if flag.name == name), None)

    def value(self, name: str) -> str | None:
        found = self.flag(name)
        return found.value if found else None

    def differences(self) -> list[Flag]:
        return [flag for flag in self.flags if flag.differs]

    def to_json(self) -> dict:
        """JSON-ready, for the heartbeat reply: the agent runs `argv` (with the node's engine
        key in place of ENGINE_KEY_PLACEHOLDER)."""
        return {"engine": self.engine, "model": self.model, "layout": self.layout,
                "layout_reason": self.layout_reason, "runnable": self.runnable,
                "argv": list(self.argv) if self.runnable else [],
                "engine_key_placeholder": ENGINE_KEY_PLACEHOLDER,
                "flags": [flag.to_json() for flag in self.flags],
                "problems": list(self.problems), "notes": list(self.notes),
                "ignored_overrides": [{"flag": i.flag, "value": i.value, "reason": i.reason}
                                      for i in self.ignored],
                "figures": dict(self.figures), "engine_version": self.engine_version}


# --- overrides: which flags, which values --------------------------------------------------------

@dataclass(frozen=True)
class Knob:
    """A flag an operator or the provider may set on a node, and the values it takes."""

    engine: str
    flag: str
    kind: str  # "int", "float", "choice", "switch", "speculative"
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    multiple_of: int | None = None
    help: str = ""


KNOBS: dict[str, Knob] = {knob.flag: knob for knob in (
    Knob("vllm", "--tensor-parallel-size", "int", 1, 64,
         help="GPUs per replica; the other GPUs run further replicas."),
    Knob("vllm", "--gpu-memory-utilization", "float", 0.5, 0.98,
         help="Share of each GPU vLLM takes (0.5 to 0.98)."),
    Knob("vllm", "--max-model-len", "int", 256, 10_000_000,
         help="Longest request, prompt plus output, in tokens."),
    Knob("vllm", "--max-num-seqs", "int", 1, 4096, help="Requests decoded at once."),
    Knob("vllm", "--kv-cache-dtype", "choice",
         choices=tuple(k for k in modelmath.KV_CACHE_BYTES["vllm"]
                       if k in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16")),
         help="KV cache element type: auto (the model's) or an FP8 type."),
    Knob("vllm", "--enable-prefix-caching", "switch", help="on or off."),
    Knob("vllm", "--prefix-match-unit", "int", 16, 4096, multiple_of=16,
         help="Tokens between prefix-cache hit points (hybrid models)."),
    Knob("vllm", "--speculative-config", "speculative",
         help='Multi-token prediction, e.g. {"method": "mtp", "num_speculative_tokens": 3}.'),
    Knob("vllm", "--enforce-eager", "switch", help="on: no CUDA graphs (less memory, slower)."),
    Knob("llama.cpp", "-c", "int", 256, 10_000_000,
         help="Context cells in all, shared by the parallel slots."),
    Knob("llama.cpp", "--parallel", "int", 1, 64, help="Parallel slots (requests at once)."),
    Knob("llama.cpp", "-ngl", "int", 0, LLAMACPP_ALL_LAYERS, help="Layers on the GPU."),
    Knob("llama.cpp", "--cache-type-k", "choice",
         choices=tuple(k for k in modelmath.KV_CACHE_BYTES["llama.cpp"] if k != "f32"),
         help="K and V cache type (--cache-type-v follows it)."),
)}
SPECULATIVE_METHODS = ("mtp",)  # the checkpoint's own multi-token-prediction head
MAX_SPECULATIVE_TOKENS = 8


def override_flags() -> list[str]:
    return list(KNOBS)


def parse_override(flag: str, value: str):
    """The override's value in its own type; OverrideError for a flag nobody may set or a
    value out of its range. What fits the node is checked by check_override."""
    knob = KNOBS.get((flag or "").strip())
    if knob is None:
        raise OverrideError(f"'{flag}' is not a flag the platform lets you set (it sets: "
                            f"{', '.join(KNOBS)}).")
    text = (value or "").strip()
    if not text:
        raise OverrideError(f"{flag} needs a value.")
    if knob.kind == "switch":
        if text.lower() not in ("on", "off"):
            raise OverrideError(f"{flag} is on or off.")
        return text.lower()
    if knob.kind == "choice":
        if text.lower() not in knob.choices:
            raise OverrideError(f"{flag} takes one of {', '.join(knob.choices)}.")
        return text.lower()
    if knob.kind == "speculative":
        return _parse_speculative(text)
    try:
        number = int(text) if knob.kind == "int" else float(text)
    except ValueError:
        raise OverrideError(f"{flag} takes {'a whole number' if knob.kind == 'int' else 'a number'}"
                            f", not '{text}'.") from None
    if not math.isfinite(number) or not knob.low <= number <= knob.high:
        raise OverrideError(f"{flag} takes {_bound(knob.low)} to {_bound(knob.high)}.")
    if knob.multiple_of and number % knob.multiple_of:
        raise OverrideError(f"{flag} takes a multiple of {knob.multiple_of}.")
    return number


def _parse_speculative(text: str) -> dict:
    try:
        spec = json.loads(text)
    except ValueError:
        raise OverrideError("--speculative-config takes a JSON object.") from None
    if not isinstance(spec, dict) or set(spec) != {"method", "num_speculative_tokens"}:
        raise OverrideError('--speculative-config takes {"method": "mtp", '
                            '"num_speculative_tokens": N} and nothing else.')
    if spec["method"] not in SPECULATIVE_METHODS:
        raise OverrideError(f"--speculative-config's method is one of "
                            f"{', '.join(SPECULATIVE_METHODS)} (the model's own draft head).")
    tokens = spec["num_speculative_tokens"]
    if isinstance(tokens, bool) or not isinstance(tokens, int) \
            or not 1 <= tokens <= MAX_SPECULATIVE_TOKENS:
        raise OverrideError(f"num_speculative_tokens is 1 to {MAX_SPECULATIVE_TOKENS}.")
    return spec


def canonical_value(flag: str, value: str) -> str:
    """The override's value as the command will carry it ("0.85", "fp8", a compact JSON)."""
    parsed = parse_override(flag, value)
    if isinstance(parsed, dict):
        return json.dumps(parsed, separators=(",", ":"), sort_keys=True)
    if isinstance(parsed, float):
        return _num(parsed)
    return str(parsed)


def check_override(node: NodeFacts, *, flag: str, value: str, overrides: Mapping[str, str],
                   **model) -> EngineConfig:
    """The configuration with this override on top of the stored ones; OverrideError when its
    value is out of range, it does not apply to this node's engine, or the node could no longer
    serve the model with it. `model` is compute()'s model arguments."""
    value = canonical_value(flag, value)
    config = compute(node, overrides={**overrides, flag: value}, **model)
    for ignored in config.ignored:
        if ignored.flag == flag:
            raise OverrideError(ignored.reason)
    if config.problems and compute(node, overrides=overrides, **model).runnable:
        raise OverrideError(config.problems[0])
    return config


# --- the computation -----------------------------------------------------------------------------

def compute(node: NodeFacts, *, model: str, arch: Architecture | None,
            quantization: str | None, overrides: Mapping[str, str] | None = None,
            override_reasons: Mapping[str, str] | None = None,
            engine_key: str | None = None, port: int = VLLM_PORT,
            vllm_version: tuple[int, int] | None = None,
            model_file: str | None = None, tls: bool = False) -> EngineConfig:
    """The engine command for `model` at `quantization` on `node`, the stored `overrides`
    (flag -> value, why in `override_reasons`) applied on top: the arithmetic follows them (an
    FP8 cache holds more requests). Each overridden flag keeps the value and reason computed
    without the overrides beside it. `engine_key` is the node's engine key when the caller has
    one (ENGINE_KEY_PLACEHOLDER otherwise); `model_file` the GGUF path llama-server loads;
    `vllm_version` the (major, minor) the node's agent reports installed (None: not said, and
    VLLM_VERSION is assumed); `tls`: the agent makes the engine's certificate (an agent that
    says so), and the engine serves HTTPS with it."""
    args = dict(node=node, model=model, arch=arch, quantization=quantization,
                engine_key=engine_key, port=port, vllm_version=vllm_version,
                model_file=model_file, tls=tls)
    config = _compute(overrides=dict(overrides or {}), **args)
    used = [flag for flag in config.flags if flag.overridden]
    if not used:
        return config
    base = _compute(overrides={}, **args)
    reasons = override_reasons or {}
    flags = []
    for flag in config.flags:
        if flag.overridden:
            computed = base.flag(flag.name)
            flag = replace(flag, computed=computed.value if computed else None,
                           reason=computed.reason if computed else flag.reason,
                           override_reason=reasons.get(flag.name, ""))
        flags.append(flag)
    return replace(config, flags=tuple(flags))


def _compute(*, node, model, arch, quantization, overrides, engine_key, port, vllm_version,
             model_file, tls) -> EngineConfig:
    key = engine_key or ENGINE_KEY_PLACEHOLDER
    kind, why_engine = _engine_kind(node, quantization)
    program = ("vllm", "serve", model) if kind == "vllm" else ("llama-server",)
    if arch is None:
        return EngineConfig(
            engine=kind, model=model, program=program, layout="unknown",
            layout_reason="", problems=(
                f"The platform does not know {model}'s architecture (layers, KV heads, "
                f"context), so it cannot size the engine for it.",),
            ignored=tuple(Ignored(f, v, "The model is not known.") for f, v in overrides.items()))
    if not node.gpus:
        return EngineConfig(engine=kind, model=model, program=program, layout="no GPU",
                            layout_reason="", problems=("The agent reports no GPU.",))
    if modelmath.quantization_bits(quantization) is None:
        return EngineConfig(engine=kind, model=model, program=program, layout="unknown",
                            layout_reason="",
                            problems=(f"Unknown quantization '{quantization}'.",))
    ov = _Overrides(overrides, kind)
    if kind == "vllm":
        config = _vllm(node, model, arch, quantization, ov, key, port,
                       vllm_version or VLLM_VERSION)
        config = replace(config, engine_version=vllm_version_text(vllm_version))
    else:
        config = _llamacpp(node, model, arch, quantization, ov, key, port,
                           model_file or _gguf_name(model, quantization))
        config = replace(config, layout_reason=f"{why_engine} {config.layout_reason}")
    if tls and config.runnable:
        config = replace(config, flags=config.flags + _tls_flags(kind))
    return replace(config, ignored=tuple(ov.ignored()) + config.ignored)


def _tls_flags(kind: str) -> tuple[Flag, ...]:
    """HTTPS with the key and certificate the agent makes: the platform's calls to the engine
    (renters' prompts, the usage it bills from, the engine key) cross the internet."""
    names = (("--ssl-keyfile", "--ssl-certfile") if kind == "vllm"
             else ("--ssl-key-file", "--ssl-cert-file"))
    why = ("Serve HTTPS with the key and self-signed certificate the agent makes; the platform "
           "pins the certificate the agent reports.")
    return (Flag(names[0], TLS_KEY_PLACEHOLDER, why), Flag(names[1], TLS_CERT_PLACEHOLDER,
                                                            "The certificate, as above."))


def _engine_kind(node: NodeFacts, quantization: str | None) -> tuple[str, str]:
    """The engine for these weights on this node, and why."""
    if modelmath.engine_for(quantization).kind == "llama.cpp":
        return "llama.cpp", f"llama.cpp: the weights are a GGUF file ({quantization})."
    if node.apple or not node.nvidia:
        return "llama.cpp", "llama.cpp: vLLM needs CUDA, and this machine has none."
    old = next((gpu for gpu in node.gpus if gpu.cc and gpu.cc < VLLM_MIN_CC), None)
    if old:
        return "llama.cpp", (f"llama.cpp: vLLM needs compute capability 7.0 or newer, and the "
                             f"{old.name} has {old.compute_capability}.")
    return "vllm", ""


class _Overrides:
    """The stored overrides, parsed; remembers which ones were used and which were not."""

    def __init__(self, raw: Mapping[str, str], engine: str):
        self.raw, self.parsed, self.bad, self.used = dict(raw), {}, {}, set()
        for flag, value in raw.items():
            knob = KNOBS.get(flag)
            if knob is None:
                self.bad[flag] = "Not a flag the platform lets anyone set."
                continue
            if knob.engine != engine:
                self.bad[flag] = (f"This node runs {engine}; {flag} is a "
                                  f"{knob.engine} flag.")
                continue
            try:
                self.parsed[flag] = parse_override(flag, value)
            except OverrideError as exc:
                self.bad[flag] = str(exc)

    def get(self, flag: str):
        if flag in self.parsed:
            self.used.add(flag)
        return self.parsed.get(flag)

    def reject(self, flag: str, reason: str) -> None:
        self.parsed.pop(flag, None)
        self.used.discard(flag)
        self.bad[flag] = reason

    def ignored(self) -> list[Ignored]:
        unused = {flag: "It does not apply to this configuration."
                  for flag in self.parsed if flag not in self.used}
        return [Ignored(flag, self.raw[flag], reason)
                for flag, reason in {**self.bad, **unused}.items()]


def _apply(flag: Flag, ov: _Overrides, shown=str) -> Flag:
    """`flag` with its override on top (compute() puts the computed value beside it)."""
    value = ov.get(flag.name)
    if value is None:
        return flag
    return replace(flag, value=shown(value), overridden=True)


# --- vLLM ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Replica:
    """vLLM on `tp` GPUs per replica, with the memory arithmetic for it."""

    tp: int
    replicas: int
    engine: modelmath.Engine
    layout: modelmath.KvLayout
    blocks: int  # the KV pool of each GPU, in blocks
    kv_reason: str
    weights_fit: bool

    def longest(self, concurrent: int = 1) -> int:
        """The longest request the pool holds `concurrent` of at once."""
        per = self.blocks // concurrent
        if per <= self.layout.state_blocks:
            return 0
        return (per - self.layout.state_blocks) // self.layout.attention_groups \
            * self.layout.block_tokens

    def holds(self, tokens: int) -> int:
        return self.blocks // self.layout.blocks_for(tokens)


def _vllm_utilization(node: NodeFacts, card_bytes: int) -> tuple[float, str]:
    base = modelmath.GPU_MEMORY_UTILIZATION
    if node.wsl:
        share = math.floor((1 - WSL2_WINDOWS_BYTES / card_bytes) * 100) / 100
        if share < base:
            return share, (
                f"Under WSL2 Windows keeps part of each {_gb(card_bytes)} card: its desktop "
                f"(1.5 GiB on an RTX 4090) and WSL2's CUDA driver (up to 1.3 GiB Linux cannot "
                f"see). vLLM refuses to start when less than its share is free, so it takes "
                f"{share:.2f}, not {base}.")
        return base, "vLLM's default share; under WSL2 it still leaves Windows its part."
    if card_bytes >= LARGE_CARD_BYTES:
        return LARGE_CARD_UTILIZATION, (
            f"On a {_gb(card_bytes)} card vLLM's default 10% leaves "
            f"{(1 - base) * card_bytes / GIB:.0f} GiB idle; 5% "
            f"({(1 - LARGE_CARD_UTILIZATION) * card_bytes / GIB:.0f} GiB) still covers the CUDA "
            f"context and communication buffers outside vLLM's share, and the rest goes to the "
            f"KV cache.")
    return base, (f"vLLM's default share of each GPU: the other 10% of a {_gb(card_bytes)} card "
                  f"holds the CUDA context and what runs outside vLLM.")


def _replica(arch, quantization, card_bytes, n_gpus, tp, util, kv_override, target, spec,
             prefix, fp8_capable) -> _Replica:
    weights = modelmath.weight_bytes(arch, quantization) / tp
    base = modelmath.Engine(kv_cache_dtype="auto", gpu_memory_utilization=util,
                            speculative_tokens=spec, prefix_caching=prefix)

    def pool(engine) -> tuple[modelmath.KvLayout, int]:
        layout = modelmath.vllm_layout(arch, engine, tp)
        room = card_bytes * util - engine.reserve_bytes - weights
        return layout, max(0, math.floor(room / layout.block_bytes)) if room > 0 else 0

    layout, blocks = pool(base)
    fits = card_bytes * util - base.reserve_bytes - weights > 0
    need = layout.blocks_for(target)
    if kv_override is not None:
        engine = replace(base, kv_cache_dtype=kv_override)
        reason = ""
    elif fits and blocks >= CONCURRENT_AT_MAX_LEN * need:
        engine, reason = base, (
            f"The model's own {_dtype(arch)} cache: the pool holds {blocks // need} requests of "
            f"{target:,} tokens at once, so there is no need to halve it.")
    elif fits and fp8_capable:
        engine = replace(base, kv_cache_dtype="fp8")
        fp8_layout, fp8_blocks = pool(engine)
        reason = (f"A {_dtype(arch)} cache holds {blocks // need} request(s) of {target:,} "
                  f"tokens at once here; FP8 halves each token's cache "
                  f"({_bytes(modelmath.kv_bytes_per_token(arch, arch.dtype_bytes))} -> "
                  f"{_bytes(modelmath.kv_bytes_per_token(arch, 1))}), "
                  f"so it holds {fp8_blocks // fp8_layout.blocks_for(target)}; the card computes "
                  f"in FP8 (compute capability 8.9 or newer).")
    else:
        engine = base
        reason = (f"The model's own {_dtype(arch)} cache"
                  + ("; the card has no FP8 (compute capability below 8.9) to halve it."
                     if fits else "."))
    layout, blocks = pool(engine)
    return _Replica(tp=tp, replicas=n_gpus // tp, engine=engine, layout=layout, blocks=blocks,
                    kv_reason=reason, weights_fit=fits)


def _vllm(node, model, arch, quantization, ov, key, port, version) -> EngineConfig:
    gpus = node.gpus
    n = len(gpus)
    card = min(gpu.memory_bytes for gpu in gpus)
    limit = arch.max_context or WELL_SERVED_CONTEXT
    notes = []
    if len({gpu.memory_mib for gpu in gpus}) > 1:
        notes.append(f"The GPUs differ in memory; every replica is sized for the smallest "
                     f"({_gb(card)}).")

    util, util_reason = _vllm_utilization(node, card)
    util_flag = _apply(Flag("--gpu-memory-utilization", _num(util), util_reason,
                            default=_num(modelmath.GPU_MEMORY_UTILIZATION)), ov, _num)
    util = float(util_flag.value)

    spec_cfg = ov.get("--speculative-config")
    if spec_cfg and not arch.draft_layers:
        ov.reject("--speculative-config", f"{model} has no multi-token-prediction head.")
        spec_cfg = None
    spec = spec_cfg["num_speculative_tokens"] if spec_cfg else 0

    prefix_override = ov.get("--enable-prefix-caching")
    prefix = prefix_override != "off"

    max_len_override = ov.get("--max-model-len")
    if max_len_override is not None and max_len_override > limit:
        ov.reject("--max-model-len", f"{model} reads at most {limit:,} tokens.")
        max_len_override = None
    target = max_len_override or limit
    fp8_capable = all(gpu.cc and gpu.cc >= FP8_MIN_CC for gpu in gpus)
    kv_override = ov.get("--kv-cache-dtype")

    options = {}
    for tp in range(1, n + 1):
        if n % tp == 0 and modelmath.shard_problem(arch, tp) is None:
            options[tp] = _replica(arch, quantization, card, n, tp, util, kv_override, target,
                                   spec, prefix, fp8_capable)
    tp_override = ov.get("--tensor-parallel-size")
    if tp_override is not None and tp_override not in options:
        problem = modelmath.shard_problem(arch, tp_override) if tp_override <= n else None
        ov.reject("--tensor-parallel-size", problem or (
            f"{tp_override} does not divide this node's {n} GPU(s) into whole replicas."))
        tp_override = None
    if not options:
        return EngineConfig(engine="vllm", model=model, program=("vllm", "serve", model),
                            layout="none", layout_reason="", problems=(
                                modelmath.shard_problem(arch, n) or "No GPU layout fits.",))
    well = min(limit, WELL_SERVED_CONTEXT)
    serving = [o for o in options.values() if o.longest(CONCURRENT_AT_MAX_LEN) >= well]
    if tp_override is not None:
        chosen = options[tp_override]
    elif serving:
        chosen = min(serving, key=lambda o: o.tp)
    else:
        chosen = max(options.values(), key=lambda o: (o.longest(CONCURRENT_AT_MAX_LEN),
                                                        o.longest(), -o.tp))
    layout, layout_reason = _vllm_layout_reason(chosen, options, arch, quantization, card,
                                                gpus, well, node)
    if tp_override is not None:
        layout_reason = f"Set by override. {layout_reason}"

    # The longest request and how many run at once follow from the pool.
    longest = chosen.longest()
    four = chosen.longest(CONCURRENT_AT_MAX_LEN)
    problems = []
    if not chosen.weights_fit:
        plan = modelmath.plan(arch, quantization=quantization, context=min(limit, MIN_CONTEXT),
                              vram_bytes=card, gpus=chosen.tp, engine=chosen.engine)
        problems.append(plan.reasons[-1] if plan.reasons else "The weights do not fit.")
    elif longest < min(limit, MIN_CONTEXT):
        problems.append(f"Beside the weights the KV cache holds {longest:,} tokens: not one "
                        f"request of {min(limit, MIN_CONTEXT):,}.")
    if four >= limit:
        max_len, len_reason = limit, (
            f"The model's whole context: the KV pool ({_pool(chosen)}) holds "
            f"{chosen.holds(limit)} requests of {limit:,} tokens at once.")
    elif four >= min(limit, MIN_CONTEXT):
        max_len = _round_context(four)
        len_reason = (f"The KV pool ({_pool(chosen)}) holds {CONCURRENT_AT_MAX_LEN} requests "
                      f"of {max_len:,} tokens at once, and only {chosen.holds(limit)} of the "
                      f"model's {limit:,}: a longer limit would let one long prompt hold the "
                      f"pool while the others wait.")
    else:
        max_len = min(limit, _round_context(longest)) if longest else 0
        len_reason = (f"The KV pool ({_pool(chosen)}) holds fewer than {CONCURRENT_AT_MAX_LEN} "
                      f"requests of any useful length; one request may take {max_len:,} "
                      f"tokens.")
    len_flag = Flag("--max-model-len", str(max_len), len_reason, default=str(limit),
                    default_reason="the model's own limit (config.json)")
    if max_len_override is not None:
        if max_len_override > longest:
            ov.reject("--max-model-len", f"{max_len_override:,} tokens do not fit: the KV pool "
                                         f"holds one request of {longest:,} at most here.")
        else:
            len_flag = _apply(len_flag, ov)
    max_len = int(len_flag.value)

    typical = min(TYPICAL_REQUEST_TOKENS, max_len) if max_len else TYPICAL_REQUEST_TOKENS
    fit_seqs = chosen.holds(typical)
    default_seqs = (VLLM_DEFAULT_MAX_NUM_SEQS_LARGE
                    if card >= VLLM_LARGE_CARD_BYTES and "a100" not in gpus[0].name.lower()
                    else VLLM_DEFAULT_MAX_NUM_SEQS)
    seqs = max(1, min(fit_seqs, default_seqs))
    per_request = chosen.layout.blocks_for(typical)
    state = (f", {chosen.layout.state_blocks} of them the linear layers' state whatever the "
             f"length" if chosen.layout.state_blocks else "")
    seqs_reason = (f"The KV pool holds {fit_seqs} requests of {typical:,} tokens at once "
                   f"({per_request} blocks each{state}); more running at once would be "
                   f"preempted, not served." if fit_seqs <= default_seqs else
                   f"vLLM's own limit for this card: the KV pool holds {fit_seqs} requests of "
                   f"{typical:,} tokens, more than it runs at once.")
    flags = []
    if (quantization or "").lower() in ("fp8", "fp8-dynamic") and "fp8" not in model.lower():
        flags.append(Flag("--quantization", "fp8",
                          "FP8 weights from a 16-bit checkpoint: vLLM quantizes them as it "
                          "loads them.", default="fp8",
                          default_reason="the same weights on every node"))
    quant = (quantization or "").lower()
    if (modelmath.quantization_bits(quantization) or 16) < 8 and quant.split("-")[0] \
            not in model.lower():
        notes.append(f"vLLM reads {quantization} weights from a checkpoint quantized so: "
                     f"{model} must name one (or be served under that name).")
    if chosen.tp > 1:
        flags.append(_apply(Flag("--tensor-parallel-size", str(chosen.tp), layout_reason,
                                 default="1"), ov))
    elif tp_override is not None:
        flags.append(_apply(Flag("--tensor-parallel-size", "1", layout_reason, default="1"), ov))
    if chosen.replicas > 1:
        flags.append(Flag("--data-parallel-size", str(chosen.replicas), layout_reason,
                          default="1"))
    flags += [util_flag, len_flag,
              _apply(Flag("--max-num-seqs", str(seqs), seqs_reason, default=str(default_seqs),
                          default_reason="vLLM's own, by the card's memory"), ov),
              _apply(Flag("--kv-cache-dtype", chosen.engine.kv_cache_dtype, chosen.kv_reason,
                          default="auto"), ov)]
    flags += _vllm_prefix_flags(arch, chosen, ov, version, prefix_override, spec)
    if spec_cfg:
        flags.append(Flag(
            "--speculative-config", json.dumps(spec_cfg, separators=(",", ":"), sort_keys=True),
            f"The model's multi-token-prediction head drafts {spec} token(s) a step; its "
            f"attention layer keeps KV too and each draft token takes a state block, counted "
            f"above.", overridden=True))
    eager = ov.get("--enforce-eager")
    if eager is not None:
        flags.append(Flag("--enforce-eager", eager, "No CUDA graphs: less memory, slower "
                                                    "decoding.", default="off", switch=True,
                          overridden=True))
    flags += [Flag("--port", str(port), "Where the agent tells the platform the engine listens.",
                   default=str(VLLM_PORT)),
              Flag("--api-key", key, "The node's engine key: the engine refuses requests "
                                     "without it, so only the platform's router reaches it.")]
    kv_token = modelmath.kv_bytes_per_token(arch,
                                            modelmath.kv_element_bytes(arch, chosen.engine))
    figures = {
        "gpus": n, "gpus_per_replica": chosen.tp, "replicas": chosen.replicas,
        "card_bytes": card, "weights_bytes": modelmath.weight_bytes(arch, quantization),
        "kv_bytes_per_token": kv_token, "block_tokens": chosen.layout.block_tokens,
        "block_bytes": chosen.layout.block_bytes, "kv_blocks": chosen.blocks,
        "kv_pool_bytes": chosen.blocks * chosen.layout.block_bytes * chosen.tp,
        "kv_bytes_at_max_context": chosen.layout.blocks_for(limit) * chosen.layout.block_bytes
        * chosen.tp,
        "model_max_context": limit, "longest_request": longest,
        "requests_at_max_model_len": chosen.holds(max_len) if max_len else 0,
    }
    if prefix and chosen.layout.state_blocks and not spec and version < PREFIX_MATCH_UNIT_SINCE:
        notes.append(f"This machine's vLLM {version[0]}.{version[1]} has no "
                     f"--prefix-match-unit (from vLLM 0.27): prefix-cache hits land on whole "
                     f"{chosen.layout.block_tokens:,}-token blocks only. A newer vLLM on this "
                     f"machine caches shorter shared prefixes.")
    if spec and prefix and chosen.layout.state_blocks:
        notes.append("With multi-token prediction drafting, prefix-cache hits land on whole "
                     "blocks only: the prefix-match unit is left out (noonghunna/club-3090 "
                     "PR #1262 measured it inert).")
    return EngineConfig(engine="vllm", model=model, program=("vllm", "serve", model),
                        layout=layout, layout_reason=layout_reason, flags=tuple(flags),
                        problems=tuple(problems), notes=tuple(notes), figures=figures)


def _vllm_layout_reason(chosen, options, arch, quantization, card, gpus, well, node
                        ) -> tuple[str, str]:
    n = len(gpus)
    weights = modelmath.weight_bytes(arch, quantization)
    usable = card * chosen.engine.gpu_memory_utilization - chosen.engine.reserve_bytes
    if n == 1:
        return "one GPU", "The node has one GPU."
    bandwidth = min((g.bandwidth_gbs for g in gpus if g.bandwidth_gbs), default=None)
    one = options.get(1)
    if chosen.tp == 1:
        four = min(_round_context(chosen.longest(CONCURRENT_AT_MAX_LEN)),
                   arch.max_context or WELL_SERVED_CONTEXT)
        return (f"{n} replicas (data parallel)",
                f"The weights ({_bytes(weights)}) fit one {_gb(card)} card with room for "
                f"{CONCURRENT_AT_MAX_LEN} requests of {four:,} tokens, so each of the {n} GPUs "
                f"serves its own copy: {n} times the streams, and no all-reduce between cards "
                f"on every token.")
    layout = (f"tensor parallel {chosen.tp}" if chosen.replicas == 1
              else f"{chosen.replicas} replicas of tensor parallel {chosen.tp}")
    if one is None:
        why = modelmath.shard_problem(arch, 1) or "one GPU is not a layout of this model"
    elif not one.weights_fit:
        why = (f"the weights ({_bytes(weights)}) do not fit the {_bytes(usable)} vLLM gets of "
               f"one {_gb(card)} card")
    else:
        why = (f"one {_gb(card)} card would hold the weights but {CONCURRENT_AT_MAX_LEN} requests "
               f"of only {one.longest(CONCURRENT_AT_MAX_LEN):,} tokens beside them (a replica "
               f"serves well from {well:,}), and each replica would read all of them per token")
    four = min(_round_context(chosen.longest(CONCURRENT_AT_MAX_LEN)),
               arch.max_context or WELL_SERVED_CONTEXT)
    reason = (f"Tensor parallel {chosen.tp}: {why}. Split over {chosen.tp} GPUs each holds "
              f"{_bytes(weights / chosen.tp)} of weights and {CONCURRENT_AT_MAX_LEN} requests "
              f"of {four:,} tokens fit beside them.")
    if bandwidth:
        reason += (f" One stream reads each card's share of the weights per token: at the "
                   f"measured {bandwidth:,.0f} GB/s, up to "
                   f"{bandwidth * 1e9 * chosen.tp / weights:,.0f} passes a second.")
    reason += (f" The GPUs exchange activations over {'NVLink' if node.nvlink else 'PCIe'} "
               f"on every token.")
    if node.wsl:
        reason += (" Under WSL2 the same cards serve about half as fast as native "
                   "(FACTS.md: 48% slower).")
    return layout, reason


def _vllm_prefix_flags(arch, chosen, ov, version, prefix_override, spec) -> list[Flag]:
    on = prefix_override != "off"
    if not chosen.layout.state_blocks:
        return [_apply(Flag("--enable-prefix-caching", "on",
                            "A repeated prompt prefix is read from the cache, not computed "
                            "again; routing sends a conversation back to the worker that "
                            "cached it. vLLM's default for this model, said so that no "
                            "version's default decides.", default="on", switch=True,
                            negation="--no-enable-prefix-caching"), ov)]
    flags = [_apply(Flag(
        "--enable-prefix-caching", "on",
        f"{arch.linear_layers} of the model's {arch.layers} layers are linear attention "
        f"(Mamba-style), and vLLM leaves prefix caching off on such hybrid models unless told "
        f"(vLLM PR #23716; PR #50991 turns it on in later versions). With it a repeated "
        f"13,000-token prompt went from 7.2 s to 1.6 s (FACTS.md).", default="off",
        default_reason="vLLM's default for hybrid models (before PR #50991)", switch=True,
        negation="--no-enable-prefix-caching"), ov)]
    if not on:
        return flags
    if version >= MAMBA_CACHE_MODE_SINCE:
        flags.append(Flag("--mamba-cache-mode", "align",
                          "Keeps the linear layers' state at block boundaries so a cached "
                          "prefix resumes there; the mode vLLM documents for prefix caching on "
                          "hybrid models (2 state blocks per sequence, counted above).",
                          default="none"))
    unit = next((u for u in PREFIX_MATCH_UNITS if chosen.layout.block_tokens % u == 0), None)
    override = ov.get("--prefix-match-unit")
    if override is not None and chosen.layout.block_tokens % override:
        ov.reject("--prefix-match-unit", f"{override} does not divide the "
                                         f"{chosen.layout.block_tokens:,}-token block; vLLM "
                                         f"refuses such a unit.")
        override = None
    if version < PREFIX_MATCH_UNIT_SINCE or spec:
        if override is not None:
            ov.reject("--prefix-match-unit", "Inert here: multi-token prediction is drafting."
                      if spec else "The engine is older than vLLM 0.27, which has no such "
                                   "flag.")
        return flags
    if unit:
        flag = Flag("--prefix-match-unit", str(unit),
                    f"vLLM grows the hybrid's attention block to {chosen.layout.block_tokens:,} "
                    f"tokens so one block holds a linear layer's state; prefix-cache hits land "
                    f"only on block boundaries, so a shared prefix shorter than a block never "
                    f"hits (vllm-project/vllm#40696). With {unit}-token units hits land every {unit} "
                    f"tokens; vLLM takes only a unit that divides every group's block.",
                    default=None, default_reason="the block size")
        flags.append(_apply(flag, ov) if override is not None else flag)
    return flags


# --- llama.cpp -----------------------------------------------------------------------------------

def _llamacpp(node, model, arch, quantization, ov, key, port, model_file) -> EngineConfig:
    gpus = node.gpus
    n = len(gpus)
    card = min(gpu.memory_bytes for gpu in gpus)
    limit = arch.max_context or WELL_SERVED_CONTEXT
    if node.apple:
        share = METAL_SHARE if card > METAL_SMALL_BYTES else METAL_SHARE_SMALL
        where = (f"Apple Silicon: Metal lets llama.cpp use about {share:.0%} of the "
                 f"{_gb(card)} of unified memory")
        layout = "llama.cpp on Metal"
    else:
        share = 1.0
        where = f"llama.cpp on {n} CUDA GPU(s)" + (", split by layers" if n > 1 else "")
        layout = "llama.cpp" + (f", layers split over {n} GPUs" if n > 1 else "")
    kv_type = ov.get("--cache-type-k") or "f16"
    engine = replace(modelmath.LLAMA_CPP, kv_cache_dtype=kv_type, gpu_memory_utilization=share)
    weights = modelmath.weight_bytes(arch, quantization)
    usable = n * (card * share - engine.reserve_bytes)
    room = usable - weights
    state = modelmath.llamacpp_kv_bytes(arch, 0, engine=engine)  # one slot's recurrent state
    per_cell = (modelmath.llamacpp_kv_bytes(arch, modelmath.LLAMACPP_CELL_PAD, engine=engine)
                - state) / modelmath.LLAMACPP_CELL_PAD

    def per_slot(slots: int, space: float) -> int:
        cells = math.floor((space - slots * state) / per_cell) if space > slots * state else 0
        return min(limit, cells // slots // CONTEXT_STEP * CONTEXT_STEP)

    problems, notes = [], []
    layers_on_gpu = LLAMACPP_ALL_LAYERS
    ngl_reason = f"Every layer on the GPU: the weights ({_bytes(weights)}) fit. {where}."
    slots_override = ov.get("--parallel")
    slots = slots_override or LLAMACPP_SLOTS
    while not slots_override and slots > 1 and per_slot(slots, room) < min(limit, MIN_CONTEXT):
        slots -= 1
    context = per_slot(slots, room)
    if context < min(limit, MIN_CONTEXT) and not node.apple:
        # Small cards: the layers that fit go on the GPU, the rest stay on the CPU.
        slots = slots_override or 1
        context = min(limit, LLAMACPP_OFFLOAD_CONTEXT)
        kv = modelmath.llamacpp_kv_bytes(arch, context * slots, engine=engine)
        per_layer = weights / arch.layers
        layers_on_gpu = max(0, min(arch.layers, math.floor((usable - kv) / per_layer)))
        ngl_reason = (f"{layers_on_gpu} of the model's {arch.layers} layers fit beside the "
                      f"cache ({_bytes(weights / arch.layers)} each of {_bytes(usable)} usable); "
                      f"the other {arch.layers - layers_on_gpu} run on the CPU from system "
                      f"memory, much slower.")
        if layers_on_gpu < 1:
            problems.append(f"Not one layer fits beside the cache: {_bytes(usable)} usable, "
                            f"{_bytes(weights / arch.layers)} a layer.")
    elif context < min(limit, MIN_CONTEXT):
        problems.append(f"The weights ({_bytes(weights)}) leave room for {context:,} tokens of "
                        f"context in the memory Metal gives ({_bytes(usable)}).")
    total = context * slots
    slots_reason = (f"{slots} slot(s), each a request at once with {context:,} tokens of its "
                    f"own: llama.cpp's slots share each read of the weights, but its batched "
                    f"kernels gain little beyond {LLAMACPP_SLOTS}.")
    c_reason = (f"{slots} slot(s) x {context:,} tokens (llama.cpp gives each slot its share of "
                f"-c)" + (", the model's whole context" if context == limit else
                          "; the memory left beside the weights holds no more") +
                f": {_bytes(modelmath.llamacpp_kv_bytes(arch, total, engine=engine, sequences=1))}"
                f" of {kv_type} cache, allocated at start.")
    c_override = ov.get("-c")
    c_flag = Flag("-c", str(total), c_reason, default="0",
                  default_reason="0: the model's own context, for all slots together")
    if c_override is not None:
        fits = modelmath.llamacpp_kv_bytes(arch, c_override // slots, engine=engine,
                                           sequences=slots) <= room or layers_on_gpu < arch.layers
        if c_override // slots > limit:
            ov.reject("-c", f"{c_override // slots:,} tokens a slot: {model} reads at most "
                            f"{limit:,}.")
        elif not fits:
            ov.reject("-c", f"{c_override:,} cells do not fit beside the weights: "
                            f"{total:,} do.")
        else:
            c_flag = _apply(c_flag, ov)
    # The model's own flags are the same in a fleet-wide command for this model.
    flags = [Flag("-m", model_file, "The GGUF file of these weights on the machine.",
                  default=model_file),
             Flag("--alias", model, "The model id routing knows this worker by.",
                  default=model),
             c_flag,
             _apply(Flag("--parallel", str(slots), slots_reason, default="-1",
                         default_reason="auto"), ov),
             _apply(Flag("-ngl", str(layers_on_gpu), ngl_reason, default="auto"), ov)]
    kv_reason = ("16-bit K and V, llama.cpp's default." if kv_type == "f16" else
                 f"{kv_type} K and V (quantized V needs flash attention, on by default).")
    flags += [_apply(Flag("--cache-type-k", "f16", kv_reason, default="f16"), ov),
              Flag("--cache-type-v", kv_type, "Follows --cache-type-k.", default="f16"),
              Flag("--host", "0.0.0.0", "The platform calls the engine from outside the "
                                        "machine; llama-server listens on 127.0.0.1 alone "
                                        "unless told.", default="127.0.0.1"),
              Flag("--port", str(port), "Where the agent tells the platform the engine listens.",
                   default=None, default_reason="llama-server's own port"),
              Flag("--metrics", "on", "The platform reads llamacpp:requests_processing and "
                                      "llamacpp:requests_deferred from /metrics.",
                   default="off", switch=True),
              Flag("--api-key", key, "The node's engine key: the engine refuses requests "
                                     "without it, so only the platform's router reaches it.")]
    if node.apple and (quantization or "").lower() not in modelmath.GGUF_TYPES:
        notes.append(f"llama.cpp loads GGUF files: {model_file} must be a GGUF build of these "
                     f"{quantization or '16-bit'} weights.")
    figures = {
        "gpus": n, "card_bytes": card, "weights_bytes": weights, "usable_bytes": usable,
        "kv_bytes_per_token": modelmath.kv_bytes_per_token(
            arch, modelmath.kv_element_bytes(arch, engine)),
        "slots": slots, "context_per_slot": context, "model_max_context": limit,
        "kv_bytes": modelmath.llamacpp_kv_bytes(arch, context, engine=engine, sequences=slots),
    }
    return EngineConfig(engine="llama.cpp", model=model, program=("llama-server",),
                        layout=layout, layout_reason=where + ".", flags=tuple(flags),
                        problems=tuple(problems), notes=tuple(notes), figures=figures)


def _gguf_name(model: str, quantization: str | None) -> str:
    return f"{model.rsplit('/', 1)[-1]}-{(quantization or 'f16').upper()}.gguf"


# --- words ---------------------------------------------------------------------------------------

def _round_context(tokens: int) -> int:
    return tokens // CONTEXT_STEP * CONTEXT_STEP


def _pool(replica: _Replica) -> str:
    return (f"{replica.blocks:,} blocks of {replica.layout.block_tokens:,} tokens, "
            f"{_bytes(replica.blocks * replica.layout.block_bytes)} a GPU")


def _dtype(arch: Architecture) -> str:
    return {4: "32-bit", 2: "16-bit", 1: "8-bit"}.get(arch.dtype_bytes, "16-bit")


def _bytes(n: float) -> str:
    if n >= GIB:
        return f"{n / GIB:,.1f} GiB"
    if n >= MIB:
        return f"{n / MIB:,.0f} MiB"
    return f"{n / 1024:,.0f} KiB"


def _gb(n: float) -> str:
    return f"{round(n / GIB)} GB"  # as vendors round a card (24,564 MiB: 24 GB)


def _num(x: float) -> str:
    return f"{x:g}"


def _bound(x: float) -> str:
    return f"{x:,}" if float(x).is_integer() and x >= 1 else _num(x)
