"""`python -m agent enroll | run | facts | probe`: see docs/agent-protocol.md."""

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from agent import (
    __version__,
    client,
    engine_tls,
    engine_versions,
    hardware,
    probe_jobs,
    probes,
    supervisor,
)
from agent.credential import (
    DEFAULT_CREDENTIAL_FILE,
    CredentialError,
    read_credential,
    write_credential,
)

DEFAULT_INTERVAL_S = 10.0


class AgentError(Exception):
    """Stops the agent: the message is printed as one line and the exit status is 1."""


def main(argv: list[str] | None = None, *, machine: hardware.Machine | None = None) -> int:
    """`machine`: what the agent reports on and probes; this computer unless the caller hands
    it another (fleetsim runs the agent for its simulated machines this way)."""
    args = build_parser().parse_args(argv)
    try:
        return args.command(args, machine or hardware.LocalMachine())
    except (AgentError, CredentialError, hardware.FactsError,
            supervisor.SupervisorError) as exc:
        print(exc, file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m agent", description="Rigshare node agent")
    parser.add_argument("--version", action="version", version=__version__)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    enroll = commands.add_parser("enroll", help="exchange an enrolment token for a node credential")
    enroll.add_argument("--platform", required=True, help="e.g. https://rigshare.example")
    enroll.add_argument("--token", required=True, help="the rse_... token from Add machine")
    _hostname_argument(enroll)
    _credential_argument(enroll)
    enroll.set_defaults(command=cmd_enroll)

    run = commands.add_parser("run", help="report to the platform every few seconds")
    run.add_argument("--engine-url", help="e.g. http://127.0.0.1:8000 (the default when the "
                     "agent runs the engine)")
    # The agent may run the engine itself, as its child (docs/agent-protocol.md, section 4).
    own = run.add_mutually_exclusive_group()
    own.add_argument("--serve", metavar="MODEL",
                     help="run the engine for MODEL with the command the platform computes "
                     "for this machine, and restart it when that changes")
    own.add_argument("--engine-command", metavar="COMMAND",
                     help='run this engine command (shell words, no shell), e.g. "vllm serve '
                     'Qwen/Qwen3-27B --port 8000"')
    run.add_argument("--model-file", metavar="PATH",
                     help="with --serve and llama.cpp: the GGUF file to load")
    run.add_argument("--state-dir", type=Path, metavar="DIR",
                     help="where the engine's log and keeper live (default: beside the "
                     "credential file); a second agent on the same one takes the engine over")
    run.add_argument("--drain-timeout", type=_positive_float, default=300.0, metavar="S",
                     help="longest wait for requests in flight before a restart (default 300)")
    run.add_argument("--stop-timeout", type=_positive_float, default=30.0, metavar="S",
                     help="seconds from SIGTERM to SIGKILL when stopping the engine "
                     "(default 30)")
    _credential_argument(run)
    run.add_argument("--interval", type=_positive_float, default=DEFAULT_INTERVAL_S,
                     help="seconds between heartbeats until the platform says otherwise")
    run.add_argument("--once", action="store_true", help="send one heartbeat and exit")
    # What the engine's /v1/models leaves unsaid; what it does say wins.
    run.add_argument("--engine-kind", choices=client.ENGINE_KINDS,
                     help="the engine, where it does not say (llama-cpp-python's server)")
    run.add_argument("--max-context", type=_max_context, metavar="N",
                     help="tokens a request (prompt + output) may take, where the engine does "
                     "not say")
    run.add_argument("--quantization", type=_quantization, metavar="Q",
                     help="the weights' format, e.g. bf16, fp8, awq-int4, Q4_K_M, where the "
                     "engine does not say (vLLM never does)")
    _hostname_argument(run)
    run.set_defaults(command=cmd_run)

    facts = commands.add_parser("facts", help="print the hardware facts a heartbeat would send")
    facts.set_defaults(command=cmd_facts)

    probe = commands.add_parser("probe", help="run the verification probes here and print "
                                "the result the platform would get")
    probe.add_argument("--quick", action="store_true",
                       help="short warm-up, few iterations, small sizes: a fast check")
    probe.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                       help="auto: the GPUs torch sees, else none; cpu: measure the CPU "
                       "(a check of the probes, not of a GPU)")
    probe.add_argument("--params", type=_json_object, default={},
                       help='probe params as JSON, e.g. \'{"matmul_n": 4096, "iterations": 50}\'')
    probe.set_defaults(command=cmd_probe)
    return parser


def _hostname_argument(parser):
    parser.add_argument("--hostname", help="the name to report (default: this machine's)")


def _reported_hostname(args, machine) -> str:
    return args.hostname or machine.hostname()


def _credential_argument(parser):
    parser.add_argument("--credential-file", type=Path, default=Path(DEFAULT_CREDENTIAL_FILE),
                        help=f"default {DEFAULT_CREDENTIAL_FILE}")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _max_context(text: str) -> int:
    try:
        value = client.valid_context(int(text))
    except ValueError:
        value = None
    if value is None:
        raise argparse.ArgumentTypeError(
            f"must be a whole number of tokens from 1 to {client.MAX_CONTEXT:,}")
    return value


def _quantization(text: str) -> str:
    value = text.strip()
    if not value or len(value) > client.MAX_QUANTIZATION:
        raise argparse.ArgumentTypeError(
            f"must be a name of 1 to {client.MAX_QUANTIZATION} characters")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return value


# --- enroll ---------------------------------------------------------------------------------

def cmd_enroll(args, machine) -> int:
    platform = _base_url(args.platform, "--platform")
    body = {"token": args.token, "hostname": _reported_hostname(args, machine),
            "agent_version": __version__}
    try:
        with httpx.Client() as http:
            reply = client.enroll(http, platform, body)
    except client.Refused as exc:
        raise AgentError(f"Enrolment refused by {platform}: {exc}") from None
    except client.Unavailable as exc:
        raise AgentError(f"Enrolment failed, {exc} ({platform}).") from None
    path = args.credential_file.expanduser()
    write_credential(path, {"platform": platform, "node_id": reply["node_id"],
                            "credential": reply["credential"]})
    if isinstance(reply.get("engine_key"), str) and reply["engine_key"]:
        # The engine's --api-key: the agent starts its engine with it; an engine the provider
        # runs reads it from this file (docs/operations.md).
        key_dir = _state_dir(None, path)
        supervisor.write_engine_key(key_dir, reply["engine_key"])
        print(f"Engine key saved to {key_dir / supervisor.KEY_FILE}.", flush=True)
    default = args.credential_file == Path(DEFAULT_CREDENTIAL_FILE)
    where = "" if default else f" --credential-file {path}"
    print(f"Enrolled as node {reply['node_id']}; credential saved to {path}. "
          f"Next: python -m agent run --engine-url http://127.0.0.1:8000{where}", flush=True)
    return 0


# --- run ------------------------------------------------------------------------------------

def cmd_run(args, machine) -> int:
    path = args.credential_file.expanduser()
    node = read_credential(path)
    platform = _base_url(node["platform"], f"the platform URL in {path}")
    engine = _supervisor(args, path, machine)
    if engine is None and not args.engine_url:
        raise AgentError("Give --engine-url (the engine you run), or let the agent run the "
                         "engine: --serve MODEL or --engine-command COMMAND.")
    engine_url = engine.engine_url if engine else _base_url(args.engine_url, "--engine-url")
    state_dir = engine.state_dir if engine else _state_dir(args.state_dir, path)
    interval = args.interval
    report_power = False  # the platform asks for the GPUs' draw while it measures the machine
    notice_shown = False
    last_summary = None
    runner = probe_jobs.JobRunner(platform=platform, credential=node["credential"],
                                  executors={"probes": _probe_executor(machine)}, log=log)
    versions = engine_versions.Reader()
    if engine is not None:
        engine.start()
    restore = _stop_on_sigterm()
    # No keep-alive to the engine: an idle connection of the agent's own must not count as a
    # request in flight when the supervisor drains an engine that says nothing of its requests.
    no_keepalive = httpx.Limits(max_keepalive_connections=0)
    try:
        # The engine's certificate is reported, not checked here (agent/engine_tls.py).
        with httpx.Client() as platform_http, \
                httpx.Client(limits=no_keepalive, verify=False) as engine_http:
            while True:
                if engine is not None:  # https:// once it runs with the agent's certificate
                    engine_url = engine.engine_url
                facts, notice = machine.facts()
                if notice and not notice_shown:  # once per run, not once per heartbeat
                    log(notice)
                    notice_shown = True
                if report_power:
                    facts = with_power_draw(facts, machine.power_draw())
                body = {
                    "agent_version": __version__,
                    "hostname": _reported_hostname(args, machine),
                    **facts,
                    "engine": _engine_report(engine_http, engine_url, args, engine, state_dir),
                }
                if engine is not None:
                    body["engine"]["supervisor"] = engine.report()
                if installed := _engine_versions(versions, engine, body):
                    body["engine_versions"] = installed
                try:
                    reply = client.heartbeat(platform_http, platform, node["credential"], body)
                except client.Refused as exc:
                    if exc.status in (401, 403):  # revoked or unknown: this node must stop
                        raise AgentError(
                            f"The platform refused this node (HTTP {exc.status}): {exc}"
                        ) from None
                    # Anything else (400: a fact the platform rejects) may pass; keep trying.
                    if args.once:
                        raise AgentError(f"Heartbeat refused (HTTP {exc.status}): {exc}") from None
                    log(f"Heartbeat refused (HTTP {exc.status}): {exc}; retrying in {interval:g} s")
                    last_summary = None
                except client.Unavailable as exc:
                    if args.once:
                        raise AgentError(f"Heartbeat failed: {exc}.") from None
                    log(f"Heartbeat failed: {exc}; retrying in {interval:g} s")
                    last_summary = None
                else:
                    interval = _reply_interval(reply, interval)
                    report_power = reply.get("report_power") is True
                    summary = _summary(reply, body, interval, args.once)
                    if summary != last_summary:  # log changes, not a line every 10 s
                        log(summary)
                        last_summary = summary
                    if args.once:
                        return 0
                    runner.offer(reply.get("jobs"))
                    _take_engine_key(reply.get("engine_key"), state_dir, engine)
                    if engine is not None:
                        engine.on_reply(reply.get("engine"),
                                        sent_state=body["engine"]["supervisor"]["state"])
                if engine is None:
                    time.sleep(interval)
                    continue
                # A change of the engine's state is reported at once, not at the next beat.
                time.sleep(MIN_BEAT_GAP_S)
                engine.changed.wait(max(0.0, interval - MIN_BEAT_GAP_S))
                engine.changed.clear()
                if engine.replaced_by is not None:
                    log(f"Handed over to the newer agent (pid {engine.replaced_by}); the "
                        "engine goes on under it.")
                    return 0
    except KeyboardInterrupt:
        log("Stopped.")
        return 0
    finally:
        # Whatever stops the agent often signals again at once (Ctrl-C reaches the whole
        # terminal group, then its script or supervisor sends SIGTERM): the stop goes on to
        # its end, the engine's first, however many come (only SIGKILL cuts it short).
        held = _hold_signals()
        try:
            runner.close()
            if engine is not None and engine.replaced_by is None:
                engine.stop()
                _last_heartbeat(platform, node["credential"], args, machine, engine,
                                engine_url, versions.get())
        finally:
            held()
            restore()


# Heartbeats come at least this far apart, however fast the engine's state moves.
MIN_BEAT_GAP_S = 0.2


def _state_dir(given: Path | None, credential_path: Path) -> Path:
    return (given or credential_path.with_name(credential_path.stem + "-engine")).expanduser()


def _engine_report(http, engine_url, args, engine, state_dir: Path) -> dict:
    """The heartbeat's `engine`, asked with the engine's key, and which keys are where:
    `key_held` the newest the agent holds, `key_fingerprint` the one the engine runs with (the
    platform sends that one). An engine the provider runs is asked with the newest key, then
    the one before it: it runs with the one it answers."""
    options = dict(engine_kind=args.engine_kind, max_context=args.max_context,
                   quantization=args.quantization)
    if engine is not None:
        report = client.engine_status(http, engine_url, headers=engine.headers(),
                                      model_paths=engine.model_paths(), **options)
        in_use = engine.key_in_use()
    else:
        keys = supervisor.engine_keys(state_dir) or [None]
        for key in keys:
            headers = {"Authorization": f"Bearer {key}"} if key else None
            report = client.engine_status(http, engine_url, headers=headers, **options)
            if report["reachable"]:
                break
        in_use = supervisor.key_fingerprint(key) if report["reachable"] else None
    report["key_held"] = supervisor.key_fingerprint(supervisor.read_engine_key(state_dir))
    report["key_fingerprint"] = in_use
    report["tls_certificate"] = _presented_certificate(engine_url)
    return report


_certificates: dict[str, tuple[float, str | None]] = {}
CERTIFICATE_RECHECK_S = 60.0


def _presented_certificate(engine_url: str) -> str | None:
    """The engine's certificate, read again once a minute (a handshake each heartbeat would
    cost the engine for nothing: it changes when the engine restarts with another)."""
    now = time.monotonic()
    found = _certificates.get(engine_url)
    if found is None or now - found[0] > CERTIFICATE_RECHECK_S or found[1] is None:
        found = _certificates[engine_url] = (now, engine_tls.presented_certificate(engine_url))
    return found[1]


def _engine_versions(versions: engine_versions.Reader, engine, body: dict) -> dict:
    """The engines installed here: those of the program the agent runs, read again each time
    it starts the engine (an upgrade shows then)."""
    if engine is None:
        return versions.get()
    report = body["engine"]["supervisor"]
    return versions.get(report["argv"], report["pid"])


def _take_engine_key(offer, state_dir: Path, engine) -> None:
    """A key the platform hands over: kept; an engine the agent runs restarts with it (drained
    first: the key is part of its configuration)."""
    if not (isinstance(offer, dict) and isinstance(offer.get("key"), str) and offer["key"]):
        return
    if not supervisor.write_engine_key(state_dir, offer["key"]):
        return
    path = state_dir / supervisor.KEY_FILE
    if engine is None:
        log(f"New engine key saved to {path}: restart your engine with --api-key set to it "
            "(the platform goes on using the previous key until the engine answers the new "
            "one).")
    else:
        log(f"New engine key saved to {path}; the engine restarts with it.")
        engine.changed.set()


def _supervisor(args, credential_path: Path, machine=None) -> supervisor.Supervisor | None:
    """The engine supervisor `run`'s flags ask for, or None (the provider runs the engine).
    `machine` may run the platform's yardstick command its own way (`engine_argv`: a simulated
    machine runs its simulated engine)."""
    if args.serve is None and args.engine_command is None:
        if args.model_file:
            raise AgentError("--model-file goes with --serve.")
        return None
    if args.once:
        raise AgentError("--once reports once: it cannot run the engine (leave out --serve "
                         "and --engine-command).")
    if args.model_file and args.serve is None:
        raise AgentError("--model-file goes with --serve.")
    try:
        command = (supervisor.parse_command(args.engine_command)
                   if args.engine_command is not None else None)
    except ValueError as exc:
        raise AgentError(f"--engine-command: {exc}.") from None
    state_dir = _state_dir(args.state_dir, credential_path)
    return supervisor.Supervisor(
        state_dir=state_dir,
        engine_url=_base_url(args.engine_url or "http://127.0.0.1:8000", "--engine-url"),
        command=command, serve=args.serve, quantization=args.quantization,
        model_file=args.model_file, stop_timeout_s=args.stop_timeout,
        drain_timeout_s=args.drain_timeout, log=log,
        engine_argv=getattr(machine, "engine_argv", None))


def _last_heartbeat(platform, credential, args, machine, engine, engine_url,
                    installed: dict) -> None:
    """One heartbeat saying the engine is stopped, so that the machine page and routing know
    at once; best effort (the platform may be what is down)."""
    try:
        facts, _ = machine.facts()
        body = {"agent_version": __version__, "hostname": _reported_hostname(args, machine),
                **facts, "engine": {"url": engine_url, "reachable": False, "models": [],
                                    "served": [], "error": "stopped with the agent",
                                    "supervisor": engine.report()}}
        if installed:
            body["engine_versions"] = installed
        with httpx.Client(timeout=3.0) as http:
            client.heartbeat(http, platform, credential, body)
    except (client.Refused, client.Unavailable, hardware.FactsError, httpx.HTTPError):
        pass


def with_power_draw(facts: dict, draws: dict[int, int]) -> dict:
    """The facts with each GPU's power draw (W) where the machine could read it."""
    return {**facts, "gpus": [{**gpu, "power_draw_w": draws[gpu["index"]]}
                              if gpu.get("index") in draws else gpu
                              for gpu in facts.get("gpus") or []]}


def _reply_interval(reply: dict, current: float) -> float:
    value = reply.get("heartbeat_interval_s")
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    return current


def _summary(reply: dict, body: dict, interval: float, once: bool) -> str:
    engine = body["engine"]
    # Routing needs a model's engine and context; say which flags would supply them.
    unknown = sum(1 for s in engine["served"] if not s["engine"] or s["max_context"] is None)
    hint = (f", {unknown} without engine kind or context (see --engine-kind, --max-context)"
            if unknown else "")
    engine_text = (
        f"engine up, {len(engine['models'])} model(s){hint}" if engine["reachable"]
        else f"engine unreachable ({engine['error']})"
    )
    if engine.get("supervisor"):  # the agent runs it: its state says more than "unreachable"
        state = engine["supervisor"]["state"]
        engine_text = (f"engine {state}, {len(engine['models'])} model(s){hint}"
                       if engine["reachable"] else f"engine {state}")
    review = ", needs review" if reply.get("needs_review") else ""
    # The job runner logs each job it takes; only --once leaves them.
    jobs = f", {len(reply['jobs'])} job(s) left for run" if once and reply.get("jobs") else ""
    return (f"Heartbeat OK: node {reply.get('node_id')} {reply.get('status')}{review}; "
            f"{len(body['gpus'])} GPU(s); {engine_text}{jobs}; every {interval:g} s")


def _stop_on_sigterm():
    """SIGTERM (systemd, docker stop) ends the loop like Ctrl-C does. Returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _hold_signals():
    """SIGINT and SIGTERM stop nothing until the undo this returns: the agent is stopping
    already (the engine says so in the log). Ignored rather than handled: a handler's output
    could land in the middle of a line being written."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT,
                                                                     signal.SIGTERM)}
    return lambda: [signal.signal(sig, handler) for sig, handler in previous.items()]


# --- facts ----------------------------------------------------------------------------------

def cmd_facts(args, machine) -> int:
    facts, notice = machine.facts()
    if notice:
        print(notice, file=sys.stderr, flush=True)  # stdout stays pure JSON
    print(json.dumps({"agent_version": __version__, "hostname": machine.hostname(), **facts},
                     indent=2))
    return 0


# --- probe ----------------------------------------------------------------------------------

def cmd_probe(args, machine) -> int:
    params = {**args.params, **({"quick": True} if args.quick else {})}
    try:
        result = _probe_executor(machine, device=args.device)(params)
    except probes.ProbeError as exc:
        raise AgentError(str(exc)) from None
    print(json.dumps(result, indent=2))
    return 0


def _probe_executor(machine, device: str | None = None):
    """A function of a job's params returning the machine's probes result."""
    return lambda params: machine.probes(params, device=device, log=log)


# --- helpers --------------------------------------------------------------------------------

def _base_url(url: str, what: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise AgentError(f"{what} must be an http:// or https:// URL, not {url!r}.")
    return url.rstrip("/")


def log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}", file=sys.stderr, flush=True)
