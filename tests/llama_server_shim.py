"""`llama-server` for the tests: the command the platform computes for a llama.cpp machine
(marketplace/engine_config.py), run by the engine this test machine has, llama-cpp-python's
server with SmolLM2-135M (tests/engine.py). It translates flags and nothing else: the agent
starts it, the real engine loads the real model and answers.

    bin_dir = llama_server_on_path(tmp_path)   # put bin_dir first on the agent's PATH

llama.cpp's flags as tools/server/README.md lists them, and what becomes of each:
  -m/--model F        --model F
  --alias A           --model_alias A
  -c N, --parallel K  --n_ctx N/K: llama-server splits -c over its K slots; llama-cpp-python
                      has one, which gets one slot's context
  -ngl N              --n_gpu_layers N (no GPU here: ignored by the CPU build)
  --host, --port      the same
  --api-key K         --api_key K
  --metrics           left out: llama-cpp-python has no /metrics (the agent then counts the
                      connections open to the engine, see agent/supervisor.py)
  --cache-type-k/-v   f16 left out (llama-cpp-python's own default); anything else refused
  --ssl-key-file K,   --ssl_keyfile K, --ssl_certfile C: HTTPS with the agent's key and
  --ssl-cert-file C   certificate (agent/engine_tls.py)
Any other flag is refused (exit 2), so a flag the platform starts writing is not dropped
unnoticed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

THREADS = "2"  # the test machine's two CPUs


def translate(argv: list[str]) -> list[str]:
    out: list[str] = []
    context, slots = None, 1
    args = iter(argv)
    for flag in args:
        if flag == "--metrics":
            continue
        if flag not in VALUED:
            raise SystemExit(f"llama-server shim: unknown flag {flag!r}")
        value = next(args, None)
        if value is None:
            raise SystemExit(f"llama-server shim: {flag} needs a value")
        if flag == "-c":
            context = int(value)
        elif flag == "--parallel":
            slots = int(value)
        elif flag in ("--cache-type-k", "--cache-type-v"):
            if value != "f16":
                raise SystemExit(f"llama-server shim: {flag} {value} is not translated")
        else:
            out += [VALUED[flag], value]
    if context:
        out += ["--n_ctx", str(context // slots)]
    return [*out, "--n_threads", THREADS, "--n_threads_batch", THREADS,
            "--interrupt_requests", "False", "--use_mlock", "False", "--verbose", "False"]


VALUED = {"-m": "--model", "--model": "--model", "--alias": "--model_alias", "-c": None,
          "--parallel": None, "-ngl": "--n_gpu_layers", "--host": "--host", "--port": "--port",
          "--api-key": "--api_key", "--cache-type-k": None, "--cache-type-v": None,
          "--ssl-key-file": "--ssl_keyfile", "--ssl-cert-file": "--ssl_certfile"}


def llama_server_on_path(directory: Path) -> Path:
    """A directory holding an executable `llama-server` that runs this shim."""
    bin_dir = directory / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "llama-server"
    repo = Path(__file__).resolve().parents[1]
    script.write_text(f'#!/bin/sh\ncd "{repo}" && exec "{sys.executable}" -m '
                      f'tests.llama_server_shim "$@"\n')
    script.chmod(0o755)
    return bin_dir


def main() -> None:
    argv = translate(sys.argv[1:])
    os.execv(sys.executable, [sys.executable, "-m", "llama_cpp.server", *argv])


if __name__ == "__main__":
    main()
