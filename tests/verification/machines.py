"""Simulated machines judged by the real evaluation: a fleetsim profile's hardware reported
through a heartbeat, its probes answered from the profile, and its load tests' figures as the
profile's engine serves them (its own model, any other, the platform's yardstick), written as
the load test writes them; then services.run_evaluate and run_publish. What a load test
measures on a fleetsim engine is tested elsewhere (test_pipeline, test_yardstick_agents); here
the figures are the engine's own, so hundreds of cases run in seconds."""

from __future__ import annotations

from fleetsim.profiles import Profile, simulated_facts, simulated_probe_results
from marketplace import engine_config
from marketplace import services as marketplace
from marketplace.model_data import architecture_for
from marketplace.models import Node
from verification import evidence, services
from verification import yardstick as ys
from verification.models import Measurement, ProbeJob, VerificationRun

JUDGED_LEVELS = (1, 32)


def facts(profile: Profile) -> engine_config.NodeFacts:
    report = simulated_facts(profile.key, "x")
    return engine_config.NodeFacts.from_report({**report, "os": profile.os})


def layout(profile: Profile, model: str, quantization: str) -> engine_config.EngineConfig:
    """What the platform would run `model` with on this machine."""
    return engine_config.compute(facts(profile), model=model, arch=architecture_for(model),
                                 quantization=quantization)


def served_by(profile: Profile, model: str, quantization: str) -> Profile | None:
    """The machine serving `model` as the platform would configure it (None where it cannot:
    the weights do not fit, the heads do not split), speculatively where the machine's own
    engine does and the model has the head for it."""
    config = layout(profile, model, quantization)
    if not config.runnable:
        return None
    spec = profile.tokens_per_pass if architecture_for(model).draft_layers else None
    slots = config.value("--max-num-seqs") or config.value("--parallel")
    try:
        return profile.serving(model, quantization, engine=config.engine,
                               tp=config.figures.get("gpus_per_replica"),
                               max_concurrency=int(slots) if slots else None,
                               tokens_per_pass=spec)
    except ValueError:
        return None


def measured(profile: Profile, levels) -> dict[int, float]:
    """What the load test reads at each concurrency: the engine runs at most its limit at
    once, the rest wait."""
    return {n: profile.aggregate_tps(min(n, profile.max_concurrency)) for n in levels}


def judged_node(owner, profile: Profile, *, machine_id: str = "m-1", own: Profile | None = None,
                own_factor: float = 1.0, yardstick_factor: float = 1.0, supervised: bool = True,
                files: dict | None = None, served_as: str | None = None,
                unsaid: bool = False) -> Node:
    """A node of `profile`'s hardware, whose engine served `own` (default: the profile's own
    model) at `own_factor` of its speed and the platform's yardstick at `yardstick_factor`,
    verified: evaluated and published. `served_as`: the name the model is served under;
    `unsaid`: the agent says neither the engine's kind nor the weights' format."""
    own = own or profile
    _, token = marketplace.enrolment_token_create(owner=owner)
    node = marketplace.node_enroll(token=token, hostname=machine_id, agent_version="0.1.0").node
    model = served_as or own.model
    served = {"id": model, "engine": "" if unsaid else own.engine,
              "max_context": own.context_length, "quantization": "" if unsaid else own.quantization}
    if files:
        served["files"] = files
    report = {**simulated_facts(profile.key, machine_id), "agent_version": "0.1.0",
              "hostname": machine_id, "os": profile.os, "simulated": True,
              "engine": {"url": "http://127.0.0.1:9", "reachable": True, "models": [model],
                         "served": [served], "error": None}}
    if supervised:
        report["engine"]["supervisor"] = {"state": "ready", "mode": "command",
                                          "argv": ["engine"]}
    marketplace.node_heartbeat_record(node_id=node.pk, report=report)
    node = Node.objects.get(pk=node.pk)
    run = VerificationRun.objects.create(
        node=node, trigger="enrolment", model=model, status=VerificationRun.Status.LOAD_TESTING,
        served={**served, "supervised": supervised, "mode": "command", "argv": []})
    measure(run, profile, own=own, own_factor=own_factor, yardstick_factor=yardstick_factor,
            supervised=supervised, machine_id=machine_id)
    return node


def measure(run: VerificationRun, profile: Profile, *, own: Profile | None = None,
            own_factor: float = 1.0, yardstick_factor: float = 1.0, supervised: bool = True,
            machine_id: str = "m-1") -> VerificationRun:
    """The run's probes and load tests as `profile`'s machine answers them (its engine at
    `own_factor` of its speed, the yardstick at `yardstick_factor`), then evaluated and
    published. A run still waiting for its probes (run_start's) is taken as the steps take it."""
    own = own or profile
    node = run.node
    if run.status == VerificationRun.Status.PROBING:
        served = {"id": own.model, "engine": own.engine, "max_context": own.context_length,
                  "quantization": own.quantization}
        VerificationRun.objects.filter(pk=run.pk).update(
            status=VerificationRun.Status.LOAD_TESTING, model=own.model,
            served={**served, "supervised": supervised, "mode": "command", "argv": []})
        ProbeJob.objects.filter(run=run).delete()
        run.refresh_from_db()
    ProbeJob.objects.create(run=run, node=node, status="done",
                            result=simulated_probe_results(profile.key, machine_id))
    read(run, profile, own, own_factor, yardstick_factor, supervised)
    if not services.run_evaluate(run_id=run.pk):
        # Serving short of what the machine should serve is read a second time before the
        # card is flagged: the machine reads the same again (the wait for it skipped).
        run.refresh_from_db()
        assert run.status == VerificationRun.Status.PROBING and run.first_reading
        VerificationRun.objects.filter(pk=run.pk).update(status=VerificationRun.Status.LOAD_TESTING)
        read(run, profile, own, own_factor, yardstick_factor, supervised)
        assert services.run_evaluate(run_id=run.pk)
    assert services.run_publish(run_id=run.pk)
    run.refresh_from_db()
    return run


def read(run: VerificationRun, profile: Profile, own: Profile, own_factor: float,
         yardstick_factor: float, supervised: bool) -> None:
    """One reading of the run's load tests: the engine's and the yardstick's."""
    node = run.node
    for level, tps in measured(own, JUDGED_LEVELS).items():
        Measurement.objects.create(run=run, metric=f"tps@{level}", value=tps * own_factor,
                                   unit="tok/s")
    if own.tokens_per_pass:
        Measurement.objects.create(run=run, metric="spec_tokens_per_pass",
                                   value=own.tokens_per_pass, unit="tokens")
    work = evidence.workload(node, list(node.cards.all()))
    if supervised and work is not None:
        config = evidence.yardstick_config(node, work)
        yardstick = served_by(profile, work.model, work.quantization)
        VerificationRun.objects.filter(pk=run.pk).update(
            yardstick=work.key, yardstick_state="done",
            yardstick_config=config.to_json())
        for level, tps in measured(yardstick, ys.LEVELS).items():
            Measurement.objects.create(run=run, metric=f"ytps@{level}",
                                       value=tps * yardstick_factor, unit="tok/s")
    elif not supervised:
        VerificationRun.objects.filter(pk=run.pk).update(
            yardstick=work.key if work else "", yardstick_state="skipped",
            yardstick_note="its provider runs the engine by hand")

