"""A simulated machine handed to the real node agent.

`python -m fleetsim agent --profile KEY --machine-id ID COMMAND ...` runs the agent's COMMAND
(`run`, `facts`, `probe`, `enroll`) with a `SimulatedMachine` in place of this computer: the
heartbeat's hardware facts, the probe results and the GPUs' power draw come from the profile,
faults included; everything else (engine status, heartbeats, jobs) is the agent's own code.
The agent never imports fleetsim: fleetsim imports the agent and hands it the machine.
"""

import json
import re
import sys

import httpx

from agent import hardware
from fleetsim.profiles import (
    get_profile,
    power_draw_w,
    simulated_facts,
    simulated_probe_results,
)

# The batch an engine runs now, as its /metrics says: vLLM's and llama-server's names.
_RUNNING = re.compile(r"^(?:vllm:num_requests_running|llamacpp:requests_processing)(?:\{[^}]*\})?"
                      r"\s+([0-9.eE+-]+)\s*$", re.M)


class SimulatedMachine:
    """`agent.hardware.Machine` for one simulated machine. Raises KeyError (naming the known
    profiles) for an unknown profile. `engine_url`: the machine's simulated engine, whose
    load its GPUs' power draw follows (none: idle)."""

    def __init__(self, profile_key: str, machine_id: str, engine_url: str | None = None,
                 time_scale: float = 1.0):
        self.profile = get_profile(profile_key)
        self.machine_id = machine_id
        self.engine_url = engine_url
        self.time_scale = time_scale

    def hostname(self) -> str:
        return self.machine_id  # simulated machines share one host: ids tell them apart

    def facts(self) -> tuple[dict, str | None]:
        facts = simulated_facts(self.profile.key, self.machine_id)
        return {"os": hardware.host_os(), **facts, "simulated": True}, None

    def probes(self, params: dict, *, device: str | None = None, log=None) -> dict:
        return simulated_probe_results(self.profile.key, self.machine_id, params or {})

    def power_draw(self) -> dict[int, int]:
        """Each GPU's draw for the batch the engine runs now (fleetsim.profiles.power_draw_w);
        nothing where NVML would read nothing."""
        watts = power_draw_w(self.profile, engine_running(self.engine_url))
        return {} if watts is None else dict.fromkeys(range(self.profile.gpu_count), watts)


    def engine_argv(self, argv: list[str]) -> list[str]:
        """The platform's yardstick command (vLLM or llama-server), run on this machine: its
        simulated engine serving that model as its card would (`python -m fleetsim serve
        --model ...`)."""
        return simulated_engine_argv(argv, self.profile.key, time_scale=self.time_scale)


def engine_running(engine_url: str | None) -> int:
    """Requests in the engine's batch now (0 when it cannot be asked: an idle GPU)."""
    if not engine_url:
        return 0
    try:
        text = httpx.get(f"{engine_url.rstrip('/')}/metrics", timeout=2).text
    except httpx.HTTPError:
        return 0
    found = _RUNNING.search(text)
    return int(float(found[1])) if found else 0



# vLLM's and llama-server's flags the simulated engine takes, and its own names for them.
_VALUE_FLAGS = {"--quantization": "--quantization", "--tensor-parallel-size": "--tensor-parallel-size",
                "-tp": "--tensor-parallel-size", "--max-model-len": "--max-model-len",
                "--max-num-seqs": "--max-concurrency", "--port": "--port", "--host": "--host",
                "--parallel": "--max-concurrency", "-np": "--max-concurrency",
                "--ssl-keyfile": "--ssl-keyfile", "--ssl-certfile": "--ssl-certfile",
                "--ssl-key-file": "--ssl-keyfile", "--ssl-cert-file": "--ssl-certfile"}
_GGUF_TYPE = re.compile(r"(Q\d_K_[MS]|Q\d_K|Q\d_\d|IQ\d_XS|F16|BF16)", re.I)


def simulated_engine_argv(argv: list[str], profile_key: str, *, time_scale: float = 1.0
                          ) -> list[str]:
    """`python -m fleetsim serve` for a vLLM (`vllm serve MODEL ...`) or llama-server command:
    the same model, weights, layout, limits and port; flags with no meaning here are left."""
    words = list(argv)
    llamacpp = bool(words) and words[0].endswith("llama-server")
    out = [sys.executable, "-m", "fleetsim", "serve", "--profile", profile_key,
           "--time-scale", f"{time_scale:g}", "--engine", "llama.cpp" if llamacpp else "vllm"]
    model = quantization = None
    if not llamacpp and len(words) > 2 and words[1] == "serve":
        model = words[2]
    context = slots = replicas = None
    for i, word in enumerate(words[:-1]):
        value = words[i + 1]
        if word == "--alias":
            model = value
        elif word in ("--hf-file", "-m", "--model") and llamacpp:
            found = _GGUF_TYPE.search(value)
            quantization = found.group(1).upper() if found else quantization
        elif word == "-c":
            context = int(value)
        elif word in ("--parallel", "-np"):
            slots = int(value)
        elif word in ("--data-parallel-size", "-dp"):
            replicas = int(value)
        elif word == "--speculative-config":
            with_draft = json.loads(value).get("num_speculative_tokens") if value else None
            if with_draft:
                out.append("--speculative")
        if word in _VALUE_FLAGS and not (word == "--quantization" and llamacpp):
            out += [_VALUE_FLAGS[word], value]
            if word == "--quantization":
                quantization = value
    if replicas and replicas > 1 and "--tensor-parallel-size" not in out:
        out += ["--tensor-parallel-size", "1"]  # replicas of one GPU each
    if llamacpp and context and slots:
        out += ["--max-model-len", str(context // slots)]
    if model:
        out += ["--model", model]
    if quantization and "--quantization" not in out:
        out += ["--quantization", quantization]
    elif not quantization and not llamacpp:
        out += ["--quantization", _checkpoint_quantization(model or "")]
    return out


def _checkpoint_quantization(model: str) -> str:
    """A vLLM checkpoint's weights where no --quantization says: a quantized one names itself
    (…-AWQ, …-GPTQ-Int4, …-FP8), else 16 bits."""
    lowered = model.lower()
    for name in ("awq", "gptq", "fp8"):
        if name in lowered:
            return name
    return "bf16"
