"""Writes for verification. The pipeline, one step per function (Celery tasks call them):

  run_start -> (the agent answers its probe job: job_result_record) -> run_load_test ->
  run_evaluate -> run_publish

Each step claims its run with a compare-and-set on the status, so a step retried after a crash
or run twice by two workers does its work once; measurements and findings are unique per
(run, card, metric), so a repeated step overwrites instead of duplicating.

A step in progress (`step_running`) stamps `updated_at` at least every TOUCH_EVERY_S. A running
step whose stamp is older than STEP_STALE was left by a worker that died: the same task
redelivered by Celery (acks_late, reject_on_worker_lost) or queued again by the sweep
(`runs_resume_stale`, every 15 s) takes it up, at most MAX_RESUMES times. Staleness counts from
when a step started, never from when it was queued: a run whose step is done waits for its next
step's task as long as the queue takes (behind a burst of load tests), and is queued again after
REQUEUE_AFTER in case the message was lost (`runs_requeue_waiting`).
"""

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Exists, F, OuterRef, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from agent.probes import DEFAULT_PARAMS as PROBE_PARAMS
from config.prepared import Prepared
from marketplace import alerts, engine_keys
from marketplace import services as marketplace
from marketplace.models import Card, Node, Rental, UuidConflict
from verification import evaluate as ev
from verification import evidence, loadtest
from verification import fingerprint as fp
from verification import yardstick as ys
from verification.findings import THRESHOLDS
from verification.models import (
    Finding,
    GpuSpec,
    Measurement,
    ProbeJob,
    ServedDrift,
    VerificationRun,
    VerifiedCapacity,
)

Status = VerificationRun.Status
PROVIDER_COOLDOWN = timedelta(hours=1)
logger = logging.getLogger(__name__)

STALE_AFTER = timedelta(minutes=20)  # no progress for this long: the run is timed out
STEP_STALE = timedelta(seconds=45)  # a running step not stamped for this long lost its worker
# A run waiting this long for its next step's task is queued again (a message lost); beyond
# WAITING_LIMIT it is timed out.
REQUEUE_AFTER = timedelta(minutes=5)
WAITING_LIMIT = timedelta(hours=2)
TOUCH_EVERY_S = 10.0
MAX_RESUMES = 3
WEEKLY = timedelta(days=7)
# The concurrency whose output tokens/s a card is verified at (and its power draw measured at).
VERIFIED_CONCURRENCY = 32
# While a run measures a machine, its agent reports each GPU's power draw in its heartbeats
# (`report_power`), and once its probes are answered it heartbeats every POWER_HEARTBEAT_S, so
# that several readings fall in each level of the load test.
POWER_HEARTBEAT_S = 1
POWER_IDLE_READINGS = 2  # fresh readings per card before the first request: the idle draw
POWER_POLL_S = 0.25  # how often the load test reads the heartbeats' latest figures


class VerificationRefused(Exception):
    pass


def run_start(*, node_id: int, trigger: str, now: datetime | None = None) -> VerificationRun:
    """Start verifying a node, or return the run already under way (one at a time)."""
    now = now or timezone.now()
    active = VerificationRun.objects.filter(node_id=node_id, status__in=VerificationRun.ACTIVE)
    if (found := active.first()) is not None:
        return found
    try:
        with transaction.atomic():
            run = VerificationRun.objects.create(
                node_id=node_id, trigger=trigger, status=Status.PROBING, created_at=now,
                updated_at=now, step_detail="waiting for the machine to run its probes")
            ProbeJob.objects.create(run=run, node_id=node_id, params=dict(PROBE_PARAMS),
                                    created_at=now)
            # The job reaches the agent with its next heartbeat, not after a repeated answer.
            marketplace.node_heartbeat_forget(node_ids=[node_id])
    except IntegrityError:  # another start won the race: one active run per node
        return active.get()
    return run


def run_request_by_provider(*, owner, node_id: int) -> VerificationRun:
    node = Node.objects.get(pk=node_id, owner=owner)
    last = (VerificationRun.objects.filter(node=node, trigger=VerificationRun.Trigger.PROVIDER)
            .order_by("-created_at").first())
    if last is not None and timezone.now() - last.created_at < PROVIDER_COOLDOWN:
        raise VerificationRefused("Re-verification can be asked at most once an hour.")
    return run_start(node_id=node.pk, trigger=VerificationRun.Trigger.PROVIDER)


def jobs_for_node(node_id: int) -> list[dict]:
    return [{"id": job.pk, "kind": job.kind, "params": job.params}
            for job in ProbeJob.objects.filter(node_id=node_id, status=ProbeJob.Status.PENDING)]


@dataclass(frozen=True)
class HeartbeatWork:
    """What the answer to a node's heartbeat carries from verification."""

    jobs: list[dict]  # probe jobs to run
    report_power: bool  # GPUs' power draw in the next heartbeats
    interval: int | None  # seconds to the next heartbeat; None: the platform's usual
    yardstick: dict | None  # {"run", "config"}: serve the platform's yardstick instead


IDLE = HeartbeatWork(jobs=[], report_power=False, interval=None, yardstick=None)


# Read on every heartbeat: compiled once (config/prepared.py).
_MEASURING = Prepared(lambda node_id: VerificationRun.objects.filter(
    node_id=node_id, status__in=(Status.PROBING, Status.LOAD_TESTING)).order_by()
    .only("pk", "status", "yardstick_state", "yardstick_config")[:1], int)


def heartbeat_work(*, node_id: int) -> HeartbeatWork:
    """Power while a run probes or load-tests the machine, every POWER_HEARTBEAT_S once its
    probes are in (the load test is near); the probe jobs while it probes; the yardstick while
    its load test asks the agent to serve it. One query while no run measures the machine.
    (A report that starts a run is asked for power too: agentapi.)"""
    run = next(iter(_MEASURING(node_id)), None)
    if run is None:
        return IDLE
    pk, status, yardstick_state, yardstick_config = (run.pk, run.status, run.yardstick_state,
                                                     run.yardstick_config)
    jobs = jobs_for_node(node_id) if status == Status.PROBING else []
    asked = status == Status.LOAD_TESTING and yardstick_state == Yardstick.ASKED
    return HeartbeatWork(
        jobs=jobs, report_power=True,
        interval=POWER_HEARTBEAT_S if status == Status.LOAD_TESTING or not jobs else None,
        yardstick={"run": pk, "config": yardstick_config} if asked else None)


class JobNotFound(Exception):
    pass


class JobAlreadyAnswered(Exception):
    pass


def job_result_record(*, node_id: int, job_id: int, status: str, result: dict | None,
                      error: str = "", now: datetime | None = None) -> ProbeJob:
    """The agent's answer to a probe job: stored once, its figures become measurements."""
    now = now or timezone.now()
    error = error or ""
    with transaction.atomic():
        job = ProbeJob.objects.select_for_update().filter(pk=job_id, node_id=node_id).first()
        if job is None:
            raise JobNotFound
        if job.status != ProbeJob.Status.PENDING:
            raise JobAlreadyAnswered
        job.status = ProbeJob.Status.DONE if status == "done" else ProbeJob.Status.FAILED
        job.result, job.error, job.answered_at = result, error[:500], now
        job.save()
        run = job.run
        if job.status == ProbeJob.Status.DONE:
            _record_probes(run, result or {})
        _progress(run, "probes done; load test next" if job.status == ProbeJob.Status.DONE
                  else f"probes failed: {error[:150]}; load test next", 30, now)
    return job


def _record_probes(run: VerificationRun, result: dict) -> None:
    cards = {c.index: c for c in Card.objects.filter(node=run.node_id)}
    for gpu in result.get("gpus") or []:
        card = cards.get(gpu.get("index"))
        if card is None:
            continue
        bandwidth, matmul = gpu.get("bandwidth") or {}, gpu.get("matmul") or {}
        copy, vram = gpu.get("host_device") or {}, gpu.get("vram") or {}
        figures = [("bandwidth_gbs", bandwidth.get("best_gbs"), "GB/s", bandwidth),
                   ("bf16_tflops", matmul.get("best_tflops"), "TFLOPS", matmul),
                   ("h2d_gbs", copy.get("h2d_gbs"), "GB/s", copy),
                   ("d2h_gbs", copy.get("d2h_gbs"), "GB/s", copy),
                   ("vram_free_gb", (vram.get("free_bytes") or 0) / 2**30 or None, "GB", vram)]
        for metric, value, unit, details in figures:
            if value is not None:
                _measure(run, card, metric, float(value), unit, details)


def _measure(run, card, metric: str, value: float, unit: str, details: dict) -> None:
    Measurement.objects.update_or_create(run=run, card=card, metric=metric,
                                         defaults={"value": value, "unit": unit,
                                                   "details": details})


def _progress(run: VerificationRun, detail: str, pct: int, now=None) -> None:
    VerificationRun.objects.filter(pk=run.pk).update(
        step_detail=detail[:200], progress_pct=pct, updated_at=now or timezone.now())


def _claim(run_id: int, before: str, after: str, detail: str, pct: int) -> bool:
    """Take the run from `before` to `after`, or take up again an `after` step whose worker
    died (no stamp for STEP_STALE); False when another worker has it."""
    now = timezone.now()
    if VerificationRun.objects.filter(pk=run_id, status=before).update(
            status=after, step_detail=detail, progress_pct=pct, updated_at=now,
            step_running=True):
        return True
    return bool(VerificationRun.objects.filter(
        pk=run_id, status=after, step_running=True, updated_at__lt=now - STEP_STALE,
        resumed__lt=MAX_RESUMES,
    ).update(step_detail=f"{detail} (taken up again)", progress_pct=pct, updated_at=now,
             resumed=F("resumed") + 1))


def _step_done(run: VerificationRun, detail: str, pct: int) -> None:
    """The step is over: the run waits for its next step's task, which no queue makes stale."""
    VerificationRun.objects.filter(pk=run.pk).update(
        step_detail=detail[:200], progress_pct=pct, updated_at=timezone.now(),
        step_running=False)


# An engine the agent is bringing up (a machine that just joined, a restart): its run's load
# test waits for it as for the probes.
ENGINE_COMING = ("starting", "loading", "draining")


def runs_ready_for_load_test() -> list[int]:
    """Runs whose probe job has been answered and whose engine is up and the provider's own
    again, if the agent runs it (not still the yardstick of a try measured again later), or
    that have waited too long for either: judged without it."""
    now = timezone.now()
    waited = now - settings.RIGSHARE_PROBE_WAIT
    engine_back = Q(node__engine_state__in=ENGINE_COMING) | Q(
        node__engine_process__yardstick__run__isnull=False)
    return list(VerificationRun.objects.filter(status=Status.PROBING).exclude(
        jobs__status=ProbeJob.Status.PENDING, jobs__created_at__gt=waited).annotate(
        waiting_since=Coalesce("measure_after", "created_at")).exclude(
        engine_back & Q(waiting_since__gt=waited)).exclude(
        measure_after__gt=now).values_list("pk", flat=True))


def run_load_test(*, run_id: int) -> bool:
    """Load-test the node's engine from the platform; False if another worker has the run."""
    if not _claim(run_id, Status.PROBING, Status.LOAD_TESTING, "starting the load test", 35):
        return False
    run = VerificationRun.objects.select_related("node").get(pk=run_id)
    ProbeJob.objects.filter(run=run, status=ProbeJob.Status.PENDING).update(
        status=ProbeJob.Status.FAILED, error="the machine did not answer in time")
    node = run.node
    if not node.engine_connect_url or not node.engine_reachable or not node.is_online:
        why = ("the machine is offline" if not node.is_online else node.engine_error
               if node.engine_error.startswith("refused:") else "the engine was not reachable")
        VerificationRun.objects.filter(pk=run.pk).update(error=f"no load test: {why}"[:500])
        _step_done(run, f"no load test: {why}", 80)
        return True

    # The GPUs' power draw comes with the agent's heartbeats: the idle draw before the first
    # request, the loaded one while the verified concurrency runs (heartbeat_power).
    power = PowerWatch(run)
    power.wait_idle(run)
    served = _served_now(node)  # the provider's engine as it runs now, before any switch
    key = engine_keys.unseal(node.engine_key_sealed)
    try:
        result = _load_test(run, lambda progress: loadtest.run_load_test(
            node.engine_connect_url, levels=settings.RIGSHARE_LOAD_TEST_LEVELS,
            max_concurrency=_advertised_concurrency(node), engine_key=key, progress=progress,
            lag_bound_ms=settings.RIGSHARE_LOAD_TEST_LAG_MS,
            tls_certificate=node.engine_tls_certificate), power=power, between=(35, 60))
        _keep_up(result, "the load test")
        _whole(run, result)
    except ReadAgain as exc:
        return _measure_later(run, str(exc))
    except Exception as exc:  # an engine down or broken under load: tried again, then said
        if run.remeasured < settings.RIGSHARE_LOAD_TEST_REMEASURES:
            return _measure_later(run, f"the load test failed ({exc})")
        VerificationRun.objects.filter(pk=run.pk).update(
            error=f"load test: {exc}"[:500], served=served.get("__node__", {}))
        _step_done(run, f"load test failed: {exc}", 80)
        return True
    for level in result.levels:
        details = asdict(level)
        _measure(run, None, f"tps@{level.concurrency}", level.tokens_per_s, "tok/s", details)
        _measure(run, None, f"ttft_p50@{level.concurrency}", level.ttft_p50_ms, "ms", details)
        _measure(run, None, f"ttft_p99@{level.concurrency}", level.ttft_p99_ms, "ms", details)
    if result.prefix_speedup is not None:
        _measure(run, None, "prefix_speedup", result.prefix_speedup, "x",
                 {"cold_ms": result.prefix_cold_ms, "warm_ms": result.prefix_warm_ms})
    if result.context_accepted is not None:
        _measure(run, None, "context_accepted", float(result.context_accepted), "bool",
                 {"context_length": result.context_length})
    if result.tokens_per_pass is not None:
        _measure(run, None, "spec_tokens_per_pass", result.tokens_per_pass, "tokens", {})
    if power.watching:
        power.read()
        power.record(run, result.levels)
    VerificationRun.objects.filter(pk=run.pk).update(
        model=result.model, error="; ".join(result.errors)[:500],
        served=served.get(result.model) or served.get("__node__", {}),
        fingerprint=result.fingerprint)
    run.refresh_from_db()
    try:
        _yardstick(run)
    except ReadAgain as exc:
        return _measure_later(run, str(exc))
    _step_done(run, "load test done", 80)
    return True


class ReadAgain(Exception):
    """A load test whose figures are not the engine's to be judged on: taken again later."""


class Starved(ReadAgain):
    """A load test read by a worker that could not keep up with its streams."""


def _whole(run: VerificationRun, result: loadtest.LoadTestResult,
           what: str = "the load test") -> None:
    """Raise where the engine cut the load test short (loadtest.cut_short: an engine
    restarting, a model switched under the test, a network blip) while the run has tries
    left; the last try is judged on what it read."""
    cut = sum(level.cut_short for level in result.levels)
    if run.remeasured >= settings.RIGSHARE_LOAD_TEST_REMEASURES or not (cut or result.cut_short):
        return
    said = ([f"{cut} streams"] if cut else []) + result.cut_short[:2]
    raise ReadAgain(f"the engine cut {what} short ({'; '.join(said)})")


def _keep_up(result: loadtest.LoadTestResult, what: str) -> None:
    """Raise Starved where the loop that read the streams woke too late to stamp the tokens
    as they came: the figures are then the reader's, and no engine is judged on them."""
    lag = result.loop_lag_ms
    if lag > settings.RIGSHARE_LOAD_TEST_LAG_MS:
        raise Starved(f"{what} was read by an overloaded Rigshare worker (its event loop "
                      f"{lag:.0f} ms late, at most {settings.RIGSHARE_LOAD_TEST_LAG_MS} ms "
                      f"allowed)")


def _measure_later(run: VerificationRun, why: str, *, status: str = Status.LOAD_TESTING,
                   first_reading: dict | None = None) -> bool:
    """A reading not to judge a card on (a starved reader, an engine that cut it short) or
    one to take again before a card is flagged on it (`first_reading`): the run waits for its
    load test again, later each time (a worker crowded by a burst of machines joining, an
    engine restarting, a provider's machine busy for a while: each passes), and False (the
    chain stops here). After RIGSHARE_LOAD_TEST_REMEASURES tries a run with no reading goes
    on without serving figures: its cards are not judged on serving rather than judged on
    figures nobody could take."""
    now = timezone.now()
    Measurement.objects.filter(run=run, card=None).delete()
    Finding.objects.filter(run=run).delete()
    yardstick_reset = {"yardstick": "", "yardstick_state": "", "yardstick_config": {},
                       "yardstick_note": ""}
    logger.warning("run #%s of node #%s: %s (try %s)", run.pk, run.node_id, why,
                   run.remeasured + 1)
    if run.remeasured >= settings.RIGSHARE_LOAD_TEST_REMEASURES:
        error = f"no load test: {why}, {run.remeasured + 1} times"
        VerificationRun.objects.filter(pk=run.pk).update(error=error[:500], **yardstick_reset)
        _step_done(run, error, 80)
        return True
    after = now + settings.RIGSHARE_LOAD_TEST_REMEASURE_AFTER * (
        2 ** run.remeasured * random.uniform(1, 1.5))
    VerificationRun.objects.filter(pk=run.pk, status=status).update(
        status=Status.PROBING, step_running=False, measure_after=after,
        first_reading=first_reading if first_reading is not None else run.first_reading,
        remeasured=F("remeasured") + 1, progress_pct=30, updated_at=now,
        step_detail=f"{why}: measured again after {after:%H:%M:%S} UTC"[:200],
        **yardstick_reset)
    return False


def _served_now(node: Node) -> dict:
    """Each model's `served` entry as the engine describes it now, with what the load test's
    judgment needs beside it: whether the agent runs the engine, and its command's words
    (its layout). Under "__node__", the same for a run that measured no model."""
    process = node.engine_process or {}
    common = {"supervised": bool(node.engine_state), "mode": process.get("mode") or "",
              "argv": list(process.get("argv") or [])[:64]}
    return {"__node__": common} | {entry.get("id"): {**entry, **common}
                                   for entry in node.engine_served or []}


class _Progress:
    """The load test's progress, handed from its event loop to the thread that writes it."""

    def __init__(self):
        self.latest: dict = {}

    def __call__(self, detail: str, pct: int) -> None:
        self.latest = {"detail": detail, "pct": pct}


def _load_test(run: VerificationRun, start, *, power: "PowerWatch | None",
               between: tuple[int, int]) -> loadtest.LoadTestResult:
    """Run a load test (`start(progress)`: a coroutine of loadtest.run_load_test) on its own
    event loop in a worker thread; this thread keeps the ORM (which must not run inside an
    event loop), writes the progress as it comes, between these percentages, and reads the
    power draw while it runs. Raises what the test raised."""
    progress = _Progress()
    lo, hi = between
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(asyncio.run, start(progress))
        shown, stamped = None, time.monotonic()
        watching = power is not None and power.watching
        while True:
            try:
                return future.result(timeout=POWER_POLL_S if watching else 1)
            except concurrent.futures.TimeoutError:
                if watching:
                    power.read()
                latest = progress.latest
                if latest and latest != shown:
                    shown = dict(latest)
                    _progress(run, f"{'yardstick' if lo >= 60 else 'load test'}: "
                                   f"{shown['detail']}", lo + shown["pct"] * (hi - lo) // 100)
                    stamped = time.monotonic()
                elif time.monotonic() - stamped >= TOUCH_EVERY_S:  # alive, between steps
                    VerificationRun.objects.filter(pk=run.pk).update(updated_at=timezone.now())
                    stamped = time.monotonic()


# --- the yardstick ------------------------------------------------------------------------------

YARDSTICK_POLL_S = 0.5
Yardstick = VerificationRun.YardstickState


def yardstick_for_agent(*, node_id: int) -> dict | None:
    """The heartbeat reply's `engine.yardstick`: {"run", "config"} while a run asks this node's
    agent to serve the platform's yardstick; None otherwise (the agent serves its own)."""
    return heartbeat_work(node_id=node_id).yardstick


def _yardstick_plan(node: Node) -> tuple[ys.Workload | None, dict | None, str]:
    """(workload, the command for the agent, "") where the node can serve the yardstick now,
    else why not."""
    cards = list(node.cards.filter(present=True))
    work = evidence.workload(node, cards)
    if not node.engine_state:
        return work, None, ("its provider runs the engine by hand, so Rigshare cannot switch it "
                            "to the yardstick")
    if work is None:
        return None, None, "no yardstick fits its cards"
    if Rental.objects.filter(card__node=node, stopped_at__isnull=True).exists():
        return work, None, ("a card of it is rented: its renter's engine is not interrupted, "
                            "and its last yardstick stands")
    config = evidence.yardstick_config(node, work)
    if not config.runnable:
        return work, None, f"the yardstick does not fit: {' '.join(config.problems)}"
    command = config.to_json()
    if work.engine == "llama.cpp":
        command["argv"] = ys.llamacpp_argv(command["argv"])
    command["version"] = hashlib.sha256(json.dumps(
        [work.key, command["argv"]]).encode()).hexdigest()[:16]
    command["yardstick"] = work.key
    return work, command, ""


def _yardstick(run: VerificationRun) -> None:
    """Have the node's agent serve the platform's yardstick (its reply carries the command),
    wait until its engine is ready with it, load-test it at yardstick.LEVELS, and hand the
    engine back to its provider's command (the reply no longer carries it)."""
    node = Node.objects.get(pk=run.node_id)
    work, command, why = _yardstick_plan(node)
    if why:
        VerificationRun.objects.filter(pk=run.pk).update(
            yardstick=work.key if work else "", yardstick_state=Yardstick.SKIPPED,
            yardstick_note=why[:300])
        return
    VerificationRun.objects.filter(pk=run.pk).update(
        yardstick=work.key, yardstick_state=Yardstick.ASKED, yardstick_config=command,
        yardstick_note="")
    marketplace.node_heartbeat_forget(node_ids=[node.pk])  # the next answer carries it
    state, note = Yardstick.FAILED, ""
    try:
        note = _await_yardstick(run, command["version"])
        node.refresh_from_db()  # where the yardstick answers, as its agent reports it
        if not note:
            result = _load_test(run, lambda progress: loadtest.run_load_test(
                node.engine_connect_url, model=work.model, levels=ys.LEVELS,
                engine_key=engine_keys.unseal(node.engine_key_sealed), caches=False,
                progress=progress, lag_bound_ms=settings.RIGSHARE_LOAD_TEST_LAG_MS,
                tls_certificate=node.engine_tls_certificate),
                power=None, between=(65, 80))
            _keep_up(result, "the yardstick's load test")
            _whole(run, result, "the yardstick's load test")
            for level in result.levels:
                details = asdict(level)
                _measure(run, None, f"ytps@{level.concurrency}", level.tokens_per_s, "tok/s",
                         details)
                _measure(run, None, f"yttft_p50@{level.concurrency}", level.ttft_p50_ms, "ms",
                         details)
            if result.tps():
                state = Yardstick.DONE
            else:
                note = "its engine served no token of the yardstick"
    except ReadAgain:
        raise
    except Exception as exc:  # an engine that breaks on the yardstick: said, no crash
        if loadtest.cut_short(exc) and run.remeasured < settings.RIGSHARE_LOAD_TEST_REMEASURES:
            raise ReadAgain(f"the engine cut the yardstick's load test short ({exc})") from exc
        note = f"the yardstick's load test failed: {exc}"
    finally:
        VerificationRun.objects.filter(pk=run.pk).update(
            yardstick_state=state, yardstick_note=note[:300], updated_at=timezone.now())
        marketplace.node_heartbeat_forget(node_ids=[node.pk])  # the provider's engine back


def _await_yardstick(run: VerificationRun, version: str) -> str:
    """"" once the node's engine is ready with this run's yardstick, else why not (the time
    allowed ran out, the machine went offline)."""
    wait = settings.RIGSHARE_YARDSTICK_READY.total_seconds()
    deadline, stamped = time.monotonic() + wait, time.monotonic()
    _progress(run, "yardstick: waiting for the machine to switch its engine", 62)
    while True:
        node = Node.objects.only("status", "engine_state", "engine_process").get(pk=run.node_id)
        serving = (node.engine_process or {}).get("yardstick") or {}
        if (serving.get("run") == run.pk and serving.get("version") == version
                and node.engine_state == "ready"):
            return ""
        if not node.is_online:
            return "the machine went offline while switching to the yardstick"
        if time.monotonic() >= deadline:
            process = node.engine_process or {}
            said = process.get("error") or " ".join((process.get("log_tail") or [])[-2:])
            return (f"its engine did not serve the yardstick within {wait:.0f} s (it was "
                    f"{node.engine_state or 'not reported'}{': ' + said if said else ''})")
        if time.monotonic() - stamped >= TOUCH_EVERY_S:
            VerificationRun.objects.filter(pk=run.pk).update(updated_at=timezone.now())
            stamped = time.monotonic()
        time.sleep(YARDSTICK_POLL_S)


class PowerWatch:
    """A node's GPU power draw during its load test, as the agent's heartbeats bring it: each
    card's latest reading and the platform's time of that heartbeat (marketplace writes them),
    read often enough to see every one. A machine reports power when its cards did before, or
    its probes read it (NVML's draw among their facts); one that does neither (an agent older
    than the field, a Mac) is not waited for, and gets no power figures."""

    def __init__(self, run: VerificationRun):
        self.node_id = run.node_id
        self.cards = set(Card.objects.filter(node_id=self.node_id, present=True)
                         .values_list("pk", flat=True))
        self.readings: dict[int, dict[datetime, int]] = {}  # card id -> {heartbeat time: W}
        self.since = timezone.now()
        self.read()
        probed = [(gpu.get("facts") or {}).get("power_draw_w") for job in run.jobs.filter(
            status=ProbeJob.Status.DONE) for gpu in (job.result or {}).get("gpus") or []]
        self.watching = bool(self.readings) or any(w is not None for w in probed)

    def read(self) -> None:
        for card_id, watts, at in (Card.objects.filter(node_id=self.node_id, present=True)
                                   .exclude(power_read_at=None).exclude(power_draw_w=None)
                                   .values_list("pk", "power_draw_w", "power_read_at")):
            self.readings.setdefault(card_id, {})[at] = watts

    def _idle(self, card_id: int) -> list[int]:
        return [w for at, w in self.readings.get(card_id, {}).items() if at >= self.since]

    def wait_idle(self, run: VerificationRun) -> None:
        """Wait (a heartbeat interval at most: the agent hears of the faster interval at its
        next one) until each card has POWER_IDLE_READINGS readings from before any request."""
        if not self.watching:
            return
        deadline = time.monotonic() + settings.RIGSHARE_HEARTBEAT_INTERVAL_S + 2
        _progress(run, "load test: reading the idle power draw", 35)
        while time.monotonic() < deadline and any(
                len(self._idle(card_id)) < POWER_IDLE_READINGS for card_id in self.cards):
            time.sleep(POWER_POLL_S)
            self.read()

    def record(self, run: VerificationRun, levels: list[loadtest.Level]) -> None:
        """Each card's idle draw (the median of the readings before the first request) and its
        draw at VERIFIED_CONCURRENCY (the median of those taken while that level ran), as
        measurements."""
        first = min((lv.started for lv in levels), default=None)
        level = next((lv for lv in levels if lv.concurrency == VERIFIED_CONCURRENCY), None)
        for card_id, readings in self.readings.items():
            idle = sorted(w for at, w in readings.items()
                          if at >= self.since and (first is None or at.timestamp() < first))
            if idle:
                _measure_card(run, card_id, "power_idle_w", statistics.median(idle), "W",
                              {"readings": idle})
            if level is None or not level.completed:
                continue
            loaded = sorted(w for at, w in readings.items()
                            if level.started <= at.timestamp() <= level.ended)
            if loaded:
                _measure_card(run, card_id, "power_loaded_w", statistics.median(loaded), "W",
                              {"readings": loaded, "concurrency": level.concurrency})


def _measure_card(run, card_id: int, metric: str, value: float, unit: str, details: dict):
    Measurement.objects.update_or_create(run=run, card_id=card_id, metric=metric,
                                         defaults={"value": value, "unit": unit,
                                                   "details": details})


def _advertised_concurrency(node: Node) -> int | None:
    # The published H200 figure is at 128 concurrent: measure where the reference is.
    names = {c.name for c in node.cards.all()}
    return 128 if any("H200" in n or "H100" in n for n in names) else None


def _specs() -> list[ev.Spec]:
    return [ev.Spec(s.name, s.memory_gb, s.bandwidth_gbs, s.bf16_tflops, s.pcie_gen,
                    s.compute_capability, s.bus_width_bits, s.sm_count, tuple(s.nvml_names),
                    s.power_w)
            for s in GpuSpec.objects.all()]


def run_evaluate(*, run_id: int) -> bool:
    if not _claim(run_id, Status.LOAD_TESTING, Status.EVALUATING, "evaluating", 85):
        return False
    run = VerificationRun.objects.select_related("node").get(pk=run_id)
    findings = _judge(run)
    short = _short(run, findings)
    if short and not run.first_reading and run.remeasured < settings.RIGSHARE_LOAD_TEST_REMEASURES:
        return _measure_later(run, "serving below what the machine should serve: measured again "
                                   "before its cards are flagged", status=Status.EVALUATING,
                              first_reading={"at": timezone.now().isoformat(), "findings": short})
    _step_done(run, "evaluated", 95)
    return True


# Findings read from timed streams, which a machine busy for a while (or a platform crowded by a
# burst of machines joining) can read short: a mismatch on one of these alone is read a second
# time, at least RIGSHARE_LOAD_TEST_REMEASURE_AFTER later, before the card is flagged on it. A run
# started on served traffic needs no second reading (the traffic was the first), and a card
# flagged on anything else is flagged at once.
TIMED = ("serving", "yardstick")


def _second_reading(run: VerificationRun, rows: list[Finding]) -> None:
    """Say, on each timed finding of a run read a second time, what the first reading was."""
    first = run.first_reading or {}
    if not first.get("findings"):
        return
    at = datetime.fromisoformat(first["at"])
    for row in rows:
        was = first["findings"].get(row.metric)
        if was is None:
            continue
        agreed = "agreed" if row.severity == ev.MISMATCH else "was taken again and this one stands"
        row.message = (f"{row.message} A reading at {at:%H:%M} UTC ({was['measured']} against "
                       f"{was['expected']}) {agreed}.")[:500]


def _short(run: VerificationRun, findings: list[Finding]) -> dict:
    """{metric: what was measured and expected} of the run's timed mismatches, where they are
    all the mismatches it has; {} otherwise."""
    if run.trigger == VerificationRun.Trigger.SERVED_TRAFFIC:
        return {}
    mismatches = [f for f in findings if f.severity == ev.MISMATCH]
    if not mismatches or any(f.metric not in TIMED for f in mismatches):
        return {}
    return {f.metric: {"measured": f.measured, "expected": f.expected} for f in mismatches}


def _judge(run: VerificationRun) -> list[Finding]:
    """Findings for every present card of the run's node, from its measurements and the fleet's
    evidence as it stands now; replaces what the run had."""
    specs = _specs()
    job = run.jobs.filter(status=ProbeJob.Status.DONE).first()
    probe = (job.result if job else None) or {}
    by_index = {g.get("index"): g for g in probe.get("gpus") or []}
    node_level = {m.metric: m for m in run.measurements.filter(card__isnull=True)}
    cards = list(run.node.cards.filter(present=True).select_related("listing"))
    serving = evidence.serving(run, cards, node_level, by_index, specs)
    probe_note = _probe_note(run, job, probe)
    uuids = Counter(card.uuid for card in cards if card.uuid)
    with transaction.atomic():
        Finding.objects.filter(run=run).delete()
        rows = []
        for card in cards:
            spec = ev.spec_for(card.name, specs)
            listing = getattr(card, "listing", None)
            facts = ev.Evidence(
                reported_name=card.name, reported_memory_mib=card.memory_total_mib,
                claimed_model=listing.claimed_gpu_model if listing else "",
                claimed_vram_gb=listing.claimed_vram_gb if listing else None,
                probe=by_index.get(card.index), probe_note=probe_note,
                wsl=bool(probe.get("wsl")), other_nodes_with_uuid=_uuid_held_by(card),
                uuid_repeated_on_node=uuids.get(card.uuid, 0) > 1,
                prefix_cache_speedup=(node_level["prefix_speedup"].value
                                      if "prefix_speedup" in node_level else None),
                context_accepted=(bool(node_level["context_accepted"].value)
                                  if "context_accepted" in node_level else None),
                **serving)
            rows += [Finding(run=run, card=card, **asdict(f))
                     for f in ev.evaluate(facts, spec, specs)]
        _second_reading(run, rows)
        served = _served_finding(run, node_level, [r for r in rows if r.metric == "serving"])
        for node_finding in (served, _fingerprint_finding(run)):
            if node_finding is not None:
                rows += [Finding(run=run, card=card, **asdict(node_finding)) for card in cards]
        return Finding.objects.bulk_create(rows)


FINGERPRINT_PEERS = 5  # the latest verified machines' answers a run's are compared with


def _fingerprint_finding(run: VerificationRun) -> ev.Finding | None:
    """Does the engine serve the model it names? Its answers to the canary prompts against
    those of the machines verified serving the same model, quantization and engine
    (verification/fingerprint.py); None where the run measured no model."""
    if not run.model:
        return None
    served = run.served or {}
    quant, engine = served.get("quantization") or "", served.get("engine") or ""
    what = f"{run.model}{f' at {quant}' if quant else ''}{f' on {engine}' if engine else ''}"
    peers, seen = [], set()
    for node_id, answers, their in (
            VerificationRun.objects.filter(status=Status.DONE, model=run.model)
            .exclude(node_id=run.node_id).exclude(fingerprint=[])
            .filter(Exists(Card.objects.filter(node=OuterRef("node_id"), present=True,
                                               verification_status__in=Card.SERVING_JUDGED)))
            .order_by("-finished_at", "-pk").values_list("node_id", "fingerprint", "served")
            [:20 * FINGERPRINT_PEERS]):
        if node_id in seen:
            continue  # a machine's latest run speaks for it
        seen.add(node_id)
        their = their or {}
        if (their.get("quantization") or "") == quant and (their.get("engine") or "") == engine:
            peers.append(answers)
            if len(peers) == FINGERPRINT_PEERS:
                break
    verdict = fp.judge(run.fingerprint, peers)
    asked = len(fp.CANARIES)
    if not run.fingerprint:
        message = f"The engine did not answer the {asked} canary prompts: nothing to compare."
    elif not verdict.peers:
        message = (f"Its answers to {asked} canary prompts at temperature 0 are kept: no "
                   f"verified machine serving {what} answered them yet.")
    elif verdict.severity == ev.MISMATCH:
        message = (f"Serves a different model than it names: its answers to {asked} canary "
                   f"prompts at temperature 0 match none of the {verdict.peers} verified "
                   f"machines serving {what}.")
    else:
        message = (f"Its answers to {asked} canary prompts at temperature 0 match "
                   f"{verdict.matched} of the {verdict.peers} verified machines serving "
                   f"{what}" + (": they disagree among themselves." if verdict.severity ==
                                ev.WARNING else "."))
    return ev.Finding("fingerprint", verdict.severity, run.model,
                      f"the answers of {verdict.peers} verified machine"
                      f"{'s' if verdict.peers != 1 else ''}" if verdict.peers else "",
                      f"matches {verdict.matched}" if verdict.peers and run.fingerprint else "",
                      message[:500], basis="peers" if verdict.peers else "",
                      details={"peers": verdict.peers, "matched": verdict.matched})


def _probe_note(run: VerificationRun, job: ProbeJob | None, probe: dict) -> str:
    """Why a card has no probe figures, in words for the findings."""
    if job is None:
        failed = run.jobs.filter(status=ProbeJob.Status.FAILED).first()
        return (f"the probe job failed ({failed.error})" if failed and failed.error
                else "the machine did not answer its probe job")
    if probe.get("device") == "none":
        return probe.get("message") or "the machine has no GPU the probes can use"
    return "the probes reported nothing for this GPU"


def _uuid_held_by(card: Card) -> tuple[int, ...]:
    """The nodes that hold this card's UUID before it (marketplace's open UuidConflicts)."""
    if not card.uuid:
        return ()
    return tuple(UuidConflict.objects.filter(node_id=card.node_id, uuid=card.uuid,
                                             closed_at__isnull=True)
                 .values_list("incumbent_id", flat=True))


def run_publish(*, run_id: int) -> bool:
    """Each card's verdict to the catalog, and its verified capacity to routing; then the runs
    of its peers are judged again if the fleet's evidence for them changed."""
    now = timezone.now()
    with transaction.atomic():
        if not VerificationRun.objects.filter(pk=run_id, status=Status.EVALUATING).update(
                status=Status.DONE, progress_pct=100, step_detail="done", finished_at=now,
                updated_at=now, step_running=False):
            return False
        run = VerificationRun.objects.select_related("node").get(pk=run_id)
        total = run.measurements.filter(card__isnull=True, metric="tps@32").first()
        cards = list(run.node.cards.filter(present=True))
        routed = dict(VerifiedCapacity.objects.filter(card__in=cards, model=run.model)
                      .values_list("card_id", "routing_tps"))
        for card in cards:
            # Each card's share of its engine: a 2-card tensor-parallel engine counts half each.
            if total and run.model:
                share = total.value / len(cards)
                VerifiedCapacity.objects.update_or_create(
                    card=card, model=run.model,
                    defaults={"tokens_per_s": share, "run": run, "measured_at": now,
                              "routing_tps": routing_capacity(routed.get(card.pk), share)})
        _publish_verdicts(run, cards, list(run.findings.all()), share_of=total)
        _served_drift_close(run, now)
    peers_rejudge(run_id=run.pk)
    return True


# --- served traffic slower than verified --------------------------------------------------------

# Episodes cleared by runs within this long before a new one: a machine slow whenever it is not
# being measured, fast whenever it is. At CLEARED_TO_CONFIRM, the run's verdict is "confirmed".
INTERMITTENT_WINDOW = timedelta(days=1)
CLEARED_TO_CONFIRM = 2
# After an episode closes, the traffic that opens the next is wholly after it.
DRIFT_QUIET = timedelta(minutes=10)


def served_drift_open(*, node_id: int, deployment_id: int, model: str, band: int,
                      band_label: str, level: int, served_tps: float, verified_tps: float,
                      streams: int, window_start: datetime,
                      now: datetime | None = None) -> ServedDrift | None:
    """A node's engine serves far below its verified speed (routing/drift.py): routing weighs
    it by what it serves from now on, a verification run starts, and its provider is told. None
    where an episode is open for the node already, or one closed too recently to judge traffic
    after it."""
    now = now or timezone.now()
    if ServedDrift.objects.filter(node_id=node_id).filter(
            Q(outcome=ServedDrift.Outcome.OPEN) | Q(closed_at__gt=now - DRIFT_QUIET)).exists():
        return None
    try:
        with transaction.atomic():
            drift = ServedDrift.objects.create(
                node_id=node_id, deployment_id=deployment_id, model=model, band=band,
                band_label=band_label, level=level, served_tps=served_tps, verified_tps=verified_tps, streams=streams,
                window_start=window_start, opened_at=now)
            share = served_tps / verified_tps
            for capacity in VerifiedCapacity.objects.select_for_update().filter(
                    card__node_id=node_id, model=model):
                capacity.routing_tps = capacity.tokens_per_s * share
                capacity.save(update_fields=["routing_tps"])
            node = Node.objects.get(pk=node_id)
            alerts.served_slow(node=node, model=model, served_tps=served_tps,
                               verified_tps=verified_tps, level=level, streams=streams, now=now)
    except IntegrityError:  # another refresh opened it first
        return None
    run = run_start(node_id=node_id, trigger=VerificationRun.Trigger.SERVED_TRAFFIC, now=now)
    ServedDrift.objects.filter(pk=drift.pk).update(run=run)
    drift.run = run
    return drift


def _served_finding(run: VerificationRun, node_level: dict, serving: list) -> ev.Finding | None:
    """The finding on served traffic of a run an episode started: confirmed (a mismatch: the
    card is flagged with the served figures) when the run measured the same slowness itself,
    when its serving was judged a mismatch, or when runs cleared CLEARED_TO_CONFIRM episodes of
    the node within INTERMITTENT_WINDOW already; else a warning that stays in its history."""
    drift = ServedDrift.objects.filter(run=run).first()
    if drift is None:
        return None
    measured = node_level.get(f"tps@{drift.level}")
    run_tps = measured.value / drift.level if measured and measured.value else None
    cleared = ServedDrift.objects.filter(
        node_id=run.node_id, outcome=ServedDrift.Outcome.CLEARED,
        closed_at__gt=drift.opened_at - INTERMITTENT_WINDOW).exclude(pk=drift.pk).count()
    low, _ = THRESHOLDS["serving"]
    if run_tps is not None and run_tps < low * drift.verified_tps:
        why = (f"the run measured {run_tps:.1f} tok/s per stream at {drift.level} concurrent "
               f"itself, {100 * run_tps / drift.verified_tps:.0f}% of the verified speed")
    elif any(f.severity == ev.MISMATCH for f in serving):
        why = "the run judged its serving a mismatch"
    elif cleared >= CLEARED_TO_CONFIRM:
        why = (f"runs measured it at full speed {cleared} times in a day while its served "
               "traffic was slow each time: it serves slower whenever it is not being verified")
    else:
        why = ""
    severity = ev.MISMATCH if why else ev.WARNING
    measured_text = f"{drift.served_tps:.1f} tok/s per stream"
    message = (f"Served traffic: {measured_text} over {drift.streams} requests at "
               f"{drift.band_label} concurrent, {100 * drift.ratio:.0f}% of the "
               f"{drift.verified_tps:.1f} verified at {drift.level}. ")
    message += (f"Confirmed: {why}." if why else
                "Not confirmed: the run measured it at its verified speed"
                + (f" ({run_tps:.1f} tok/s per stream)" if run_tps else "")
                + "; the run's figure stands.")
    return ev.Finding("served", severity, "", f"{drift.verified_tps:.1f} tok/s per stream",
                      measured_text, message[:500], basis="served",
                      details={"drift": drift.pk, "band": drift.band, "level": drift.level,
                               "streams": drift.streams, "run_tps": run_tps,
                               "window_start": drift.window_start.isoformat()})


def _served_drift_close(run: VerificationRun, now: datetime) -> None:
    finding = run.findings.filter(metric="served").first()
    outcome = (ServedDrift.Outcome.CONFIRMED if finding and finding.severity == ev.MISMATCH
               else ServedDrift.Outcome.CLEARED)
    ServedDrift.objects.filter(run=run, outcome=ServedDrift.Outcome.OPEN).update(
        outcome=outcome, closed_at=now, note=(finding.message if finding else
                                              "the run measured nothing to compare")[:300])


def served_drifts_close_orphaned(*, now: datetime | None = None) -> int:
    """Episodes whose run ended without publishing (failed, timed out, removed): closed as not
    confirmed, so that the next slow traffic opens a new one."""
    now = now or timezone.now()
    return ServedDrift.objects.filter(outcome=ServedDrift.Outcome.OPEN).exclude(
        run__status__in=VerificationRun.ACTIVE).exclude(run__status=Status.DONE).update(
        outcome=ServedDrift.Outcome.CLEARED, closed_at=now,
        note="its run ended before it measured the machine")


# A re-measurement within this fraction of what routing uses leaves routing's weight alone.
ROUTING_HYSTERESIS = 0.10


def routing_capacity(routed: float | None, measured: float) -> float:
    """What routing should weigh a card by after a new measurement (routing/balancer.py)."""
    if routed and abs(measured - routed) <= ROUTING_HYSTERESIS * routed:
        return routed
    return measured


def run_status(run_id: int) -> str | None:
    return VerificationRun.objects.filter(pk=run_id).values_list("status", flat=True).first()


def _publish_verdicts(run, cards, findings, *, share_of=None) -> None:
    specs = _specs()
    per_card = {(card_id, metric): value for card_id, metric, value in run.measurements.filter(
        card__in=cards, metric__in=("bandwidth_gbs", "power_idle_w", "power_loaded_w"))
        .values_list("card_id", "metric", "value")}
    single = run.measurements.filter(card__isnull=True, metric="tps@1", value__gt=0).first()
    for card in cards:
        mine = [ev.Finding(f.metric, f.severity, f.claimed, f.expected, f.measured, f.message)
                for f in findings if f.card_id == card.pk]
        share = share_of.value / len(cards) if share_of and cards else None
        spec = ev.spec_for(card.name, specs)
        marketplace.card_verification_publish(
            card_id=card.pk, status=ev.verdict(mine), tokens_per_s=share,
            model=run.model if share is not None else "",
            concurrency=int(share_of.metric.removeprefix("tps@")) if share is not None else None,
            reference_spec=spec.name if spec else "",
            bandwidth_gbs=per_card.get((card.pk, "bandwidth_gbs")),
            spec_bandwidth_gbs=spec.bandwidth_gbs if spec else None,
            problems=sum(f.severity in (ev.MISMATCH, ev.WARNING) for f in mine),
            # One request alone, this card's share of it as for the figure under load.
            single_tokens_per_s=single.value / len(cards) if single and share else None,
            power_idle_w=per_card.get((card.pk, "power_idle_w")),
            power_loaded_w=per_card.get((card.pk, "power_loaded_w")))


def run_rejudge(*, run_id: int) -> bool:
    """Judge a finished run again from its measurements and the fleet's evidence as it stands
    now (a peer verified or flagged since, a UUID conflict opened or closed), and publish the
    verdicts. Only the node's latest finished run is judged again."""
    run = VerificationRun.objects.select_related("node").get(pk=run_id)
    latest = (VerificationRun.objects.filter(node_id=run.node_id, status=Status.DONE)
              .order_by("-finished_at", "-pk").first())
    if latest is None or latest.pk != run.pk:
        return False
    with transaction.atomic():
        findings = _judge(run)
        again = _read_again_for_peers(run, findings)
        cards = list(run.node.cards.filter(present=True))
        _publish_verdicts(run, cards, findings,
                          share_of=run.measurements.filter(card__isnull=True,
                                                           metric="tps@32").first())
    if again:
        run_start(node_id=run.node_id, trigger=VerificationRun.Trigger.PEERS)
    return True


def _read_again_for_peers(run: VerificationRun, findings: list[Finding]) -> bool:
    """A run judged again that now falls short on timed findings alone, against peers' figures
    that moved since it was read once: not flagged on that one reading. Its shortfalls stand
    as warnings, and True: a new run reads the machine again (twice where it is short again).
    A run read twice already, or one that is itself such a new reading, is flagged."""
    short = _short(run, findings)
    if (not short or run.first_reading or run.trigger == VerificationRun.Trigger.PEERS
            or run.remeasured >= settings.RIGSHARE_LOAD_TEST_REMEASURES):
        return False
    demoted = [f for f in findings if f.metric in short and f.severity == ev.MISMATCH]
    for finding in demoted:
        finding.severity = ev.WARNING
        finding.message = (f"{finding.message} Read once, against peers' figures that moved "
                           f"since: the machine is measured again before its card is flagged "
                           f"on it.")[:500]
    Finding.objects.bulk_update(demoted, ["severity", "message"])
    return True


def node_rejudge(*, node_id: int) -> bool:
    latest = (VerificationRun.objects.filter(node_id=node_id, status=Status.DONE)
              .order_by("-finished_at", "-pk").values_list("pk", flat=True).first())
    return latest is not None and run_rejudge(run_id=latest)


MAX_PEER_REJUDGES = 50


def peers_rejudge(*, run_id: int) -> list[int]:
    """After a run is published, every latest run of the machines with the same GPU and count
    (itself first) whose serving or yardstick was judged with a different number of peers than
    the fleet has now is judged again: the order in which machines finish must not decide
    whether a slow one is caught. Does not cascade."""
    run = VerificationRun.objects.select_related("node").get(pk=run_id)
    cards = list(run.node.cards.filter(present=True))
    names = {card.name for card in cards}
    if len(names) != 1:
        return []
    gpu = names.pop()
    others = (VerificationRun.objects.filter(
        status=Status.DONE, finished_at__gte=timezone.now() - evidence.PEER_WINDOW,
        node__cards__name=gpu, node__cards__present=True).exclude(node_id=run.node_id)
        .order_by("node_id", "-finished_at", "-pk").values_list("pk", "node_id"))
    group, seen = [run.pk], set()
    for other, node_id in others:
        if node_id not in seen:
            seen.add(node_id)
            group.append(other)
    rejudged = []
    for member in group[:MAX_PEER_REJUDGES]:
        member_run = VerificationRun.objects.select_related("node").get(pk=member)
        member_cards = list(member_run.node.cards.filter(present=True))
        if len(member_cards) != len(cards) or {c.name for c in member_cards} != {gpu}:
            continue
        if _peer_counts_moved(member_run, gpu, len(cards)) and run_rejudge(run_id=member):
            rejudged.append(member)
    return rejudged


def _peer_counts_moved(run: VerificationRun, gpu: str, count: int) -> bool:
    """Whether the fleet has another number of peers for this run's serving or yardstick than
    it was judged with."""
    judged = dict(Finding.objects.filter(run=run, metric__in=("serving", "yardstick"))
                  .values_list("metric", "details"))
    moved = False
    if "serving" in judged and run.model:
        engine, quantization = evidence.served_as(run)
        now = evidence.peer_tps(run.node, gpu, count, run.model, engine, quantization)
        moved = max((len(v) for v in now.values()), default=0) != (
            judged["serving"] or {}).get("peers", 0)
    if "yardstick" in judged and not moved:
        source = evidence.yardstick_run(run)
        if source is not None and source.yardstick:
            now = evidence.yardstick_peer_tps(run.node, gpu, count, source.yardstick)
            moved = max((len(v) for v in now.values()), default=0) != (
                judged["yardstick"] or {}).get("peers", 0)
    return moved


def runs_resume_stale(*, now: datetime | None = None) -> list[tuple[int, str]]:
    """(run id, step) of every load test or evaluation whose worker died (no stamp for
    STEP_STALE), for the sweep to queue again; one taken up MAX_RESUMES times already fails."""
    now = now or timezone.now()
    stale = VerificationRun.objects.filter(status__in=(Status.LOAD_TESTING, Status.EVALUATING),
                                           step_running=True, updated_at__lt=now - STEP_STALE)
    stale.filter(resumed__gte=MAX_RESUMES).update(
        status=Status.FAILED, finished_at=now, updated_at=now,
        error=f"its worker died {MAX_RESUMES + 1} times during the run")
    return list(stale.filter(resumed__lt=MAX_RESUMES).values_list("pk", "status"))


def runs_requeue_waiting(*, now: datetime | None = None) -> list[tuple[int, str]]:
    """(run id, next step: "evaluate" or "publish") of every run that has waited REQUEUE_AFTER
    for its next step's task: queued again (a lost message), not taken for a dead worker."""
    now = now or timezone.now()
    out = []
    for run_id, status in VerificationRun.objects.filter(
            status__in=(Status.LOAD_TESTING, Status.EVALUATING), step_running=False,
            updated_at__lt=now - REQUEUE_AFTER).values_list("pk", "status"):
        if VerificationRun.objects.filter(pk=run_id, status=status, step_running=False,
                                          updated_at__lt=now - REQUEUE_AFTER).update(
                updated_at=now):
            out.append((run_id, "evaluate" if status == Status.LOAD_TESTING else "publish"))
    return out


def runs_time_out_stale(*, now: datetime | None = None) -> list[int]:
    """Runs with no progress for STALE_AFTER (stuck where no step can take them up again; a run
    waiting for its next step's task: WAITING_LIMIT) are timed out and a fresh run is started
    in their place, so none stays "running" for ever."""
    now = now or timezone.now()
    waiting = Q(status__in=(Status.LOAD_TESTING, Status.EVALUATING), step_running=False)
    stale = list(VerificationRun.objects.filter(status__in=VerificationRun.ACTIVE).filter(
        (~waiting & Q(updated_at__lt=now - STALE_AFTER))
        | (waiting & Q(updated_at__lt=now - WAITING_LIMIT))).values_list("pk", "node_id"))
    restarted = []
    for run_id, node_id in stale:
        if VerificationRun.objects.filter(pk=run_id, status__in=VerificationRun.ACTIVE,
                                          updated_at__lt=now - STALE_AFTER).update(
                step_running=False,
                status=Status.TIMED_OUT, finished_at=now, updated_at=now,
                error="no progress for 20 minutes"):
            ProbeJob.objects.filter(run_id=run_id, status=ProbeJob.Status.PENDING).update(
                status=ProbeJob.Status.FAILED, error="run timed out")
            restarted.append(run_start(node_id=node_id, trigger=VerificationRun.Trigger.RESTART,
                                       now=now).pk)
    return restarted


def runs_start_weekly(*, now: datetime | None = None) -> int:
    now = now or timezone.now()
    due = (Node.objects.filter(status=Node.Status.ONLINE, cards__present=True).distinct()
           .exclude(verification_runs__created_at__gt=now - WEEKLY))
    count = 0
    for node_id in due.values_list("pk", flat=True):
        run_start(node_id=node_id, trigger=VerificationRun.Trigger.SCHEDULE, now=now)
        count += 1
    return count
