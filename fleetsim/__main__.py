"""python -m fleetsim list | serve | up | agent: see fleetsim/__init__.py."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from fleetsim.profiles import HONEST, LIARS, PLANTED_FLEET, PROFILES, get_profile


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fleetsim",
                                     description="Simulated GPU machines with measured profiles")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    list_ = commands.add_parser("list", help="print the profiles and their headline figures")
    list_.set_defaults(command=cmd_list)

    serve = commands.add_parser("serve", help="run one simulated engine server")
    serve.add_argument("--profile", required=True, choices=sorted(PROFILES), metavar="KEY")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    _time_scale_argument(serve)
    serve.add_argument("--die-after-tokens", type=_positive_int, metavar="N",
                       help="drop each stream's connection after N tokens (fault injection)")
    serve.add_argument("--max-concurrency", type=_positive_int, metavar="N",
                       help="override the profile's number of concurrently running requests")
    serve.add_argument("--api-key", help="answer /v1 requests only with this key (as vLLM's "
                       "--api-key)")
    serve.add_argument("--ssl-keyfile", help="serve HTTPS with this key (as vLLM's)")
    serve.add_argument("--ssl-certfile", help="and this certificate")
    serve.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="as vLLM's flag: usage says how many prompt tokens were cached")
    other = serve.add_argument_group(
        "another model", "the machine serving another model than its profile's (the platform's "
        "yardstick, a renter's choice), at the speed its card's character gives it")
    other.add_argument("--model", help="the model to serve (a marketplace/model_data.py name)")
    other.add_argument("--quantization", help="its weights' format (bf16, fp8, awq, Q4_K_M...)")
    other.add_argument("--engine", choices=("vllm", "llama.cpp"),
                       help="the engine to imitate (default: llama.cpp for a GGUF type)")
    other.add_argument("--tensor-parallel-size", type=_positive_int, metavar="N",
                       help="GPUs per replica (default: all of them)")
    other.add_argument("--max-model-len", type=_positive_int, metavar="N",
                       help="the longest request, prompt and output")
    other.add_argument("--speculative", action="store_true",
                       help="decode with the model's multi-token-prediction head")
    serve.set_defaults(command=cmd_serve)

    up = commands.add_parser("up", help="run a fleet: engine servers plus the real node agent")
    up.add_argument("--platform", required=True, help="e.g. http://127.0.0.1:8000")
    fleet = up.add_mutually_exclusive_group(required=True)
    fleet.add_argument("--profiles", type=_csv, metavar="KEY[,KEY...]",
                       help="one machine per key; a key may repeat")
    fleet.add_argument("--planted", dest="profiles", action="store_const", const=PLANTED_FLEET,
                       help=f"the verification benchmark's fleet: {len(HONEST)} honest machines "
                            f"and {len(LIARS)} with planted faults ({len(PLANTED_FLEET)} "
                            "machines, one token each)")
    up.add_argument("--tokens", type=_csv, default=[], metavar="TOKEN[,TOKEN...]",
                    help="one enrolment token per machine, in order")
    up.add_argument("--state-dir", type=Path, default=Path("var/fleetsim"),
                    help="credential files, one per machine (default var/fleetsim)")
    up.add_argument("--base-port", type=_port, metavar="PORT",
                    help="the first machine's engine port; the next ones follow (default: "
                         "free ports the system picks)")
    up.add_argument("--agent-engines", type=_csv, default=[], metavar="KEY[,KEY...]",
                    help="the machines of these profiles have their agent run their engine, "
                         "as its child (`python -m agent run --engine-command ...`), so that "
                         "verification can switch it to its yardstick; `all`: every machine")
    _time_scale_argument(up)
    up.set_defaults(command=cmd_up)

    agent = commands.add_parser(
        "agent", help="run the real node agent for one simulated machine (its facts and probe "
                      "results come from the profile)")
    agent.add_argument("--profile", required=True, choices=sorted(PROFILES), metavar="KEY")
    agent.add_argument("--machine-id", required=True,
                       help="which simulated machine: its GPU uuids and figures derive from it")
    _time_scale_argument(agent)
    agent.add_argument("agent_args", nargs=argparse.REMAINDER, metavar="COMMAND ...",
                       help="the agent's command and options, e.g. run --engine-url URL")
    agent.set_defaults(command=cmd_agent)
    return parser


def _time_scale_argument(parser):
    parser.add_argument("--time-scale", type=_positive_float, default=1.0, metavar="X",
                        help="run X times faster than the measured card (default 1)")


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError("must be a port from 1 to 65535")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be a positive number")
    return value


def cmd_list(args) -> int:
    print(f"{'KEY':<22} {'ENGINE':<10} {'GPUS (AS REPORTED)':<62} {'CONTEXT':>8} "
          f"{'TOK/S@1':>8} {'TOK/S@MAX':>14} {'PREFILL':>8}  PLANTED")
    for p in PROFILES.values():
        top_n, top_tps = p.throughput[-1]
        gpus = f"{p.gpu_count}x {p.gpu_name} ({p.memory_total_mib:,} MiB)"
        print(f"{p.key:<22} {p.engine:<10} {gpus:<62} {p.context_length:>8,} "
              f"{p.aggregate_tps(1):>8.0f} {f'{top_tps:,.0f} at {top_n}':>14} "
              f"{p.prefill_tps:>8.0f}  {LIARS.get(p.key, '-')}")
    return 0


def cmd_serve(args) -> int:
    import uvicorn

    from fleetsim.physics import SPEC_TOKENS_PER_PASS
    from fleetsim.server import EngineServer

    profile = get_profile(args.profile)
    if args.model:
        try:
            profile = profile.serving(
                args.model, args.quantization or profile.quantization, engine=args.engine,
                tp=args.tensor_parallel_size, context_length=args.max_model_len,
                max_concurrency=args.max_concurrency,
                tokens_per_pass=SPEC_TOKENS_PER_PASS if args.speculative else None)
        except ValueError as exc:
            print(f"fleetsim: {profile.title} cannot serve {args.model}: {exc}", flush=True)
            return 1
    app = EngineServer(profile, time_scale=args.time_scale,
                       die_after_tokens=args.die_after_tokens,
                       max_concurrency=args.max_concurrency,
                       prompt_tokens_details=args.enable_prompt_tokens_details,
                       api_key=args.api_key or None)
    print(f"fleetsim: {profile.title} serving {profile.model} at http://{args.host}:{args.port} "
          f"(time scale {args.time_scale:g})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", lifespan="off",
                ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    return 0


def cmd_up(args) -> int:
    from fleetsim.fleet import FleetError, plan_machines, run_fleet

    try:
        every = args.agent_engines == ["all"]
        own = set(args.profiles) if every else set(args.agent_engines)
        unknown = [] if every else sorted(own - set(PROFILES))  # `all`: plan_machines says
        if unknown:
            raise FleetError(f"--agent-engines: unknown fleetsim profile {unknown[0]!r}")
        machines = plan_machines(args.profiles, args.tokens, args.state_dir.resolve(),
                                 args.base_port, platform=args.platform,
                                 agent_engines=frozenset(own))
        asyncio.run(run_fleet(args.platform, machines, time_scale=args.time_scale))
    except FleetError as exc:
        print(f"fleetsim: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


def cmd_agent(args) -> int:
    from agent.cli import main as agent_main
    from fleetsim.machine import SimulatedMachine

    machine = SimulatedMachine(args.profile, args.machine_id,
                               engine_url=_option(args.agent_args, "--engine-url"),
                               time_scale=args.time_scale)
    return agent_main(args.agent_args, machine=machine)


def _option(argv: list[str], name: str) -> str | None:
    """The value of `name` among the agent's own arguments (`NAME VALUE` or `NAME=VALUE`)."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


if __name__ == "__main__":
    sys.exit(main())
