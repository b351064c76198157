"""Writes for verification. The pipeline, one step per function (Celery tasks call them):

  run_start -> (the agent answers its probe job: job_result_record) -> run_load_test ->
  run_evaluate -> run_publish

Each step claims its run with a compare-and-set on the status, so a step retried after a crash
or run twice by two workers does its work once; measurements and findings are unique per
(run, card, metric), so a repeated step overwrites instead of duplicating.
"""

import asyncio
import concurrent.futures
from dataclasses import asdict
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from marketplace import services as marketplace
from marketplace.models import Card, Node
from verification import evaluate as ev
from verification import loadtest
from verification.models import (
    Finding,
    GpuSpec,
    Measurement,
    ProbeJob,
    VerificationRun,
    VerifiedCapacity,
)
from verification.spec_data import SERVING_REFERENCE

Status = VerificationRun.Status
PROVIDER_COOLDOWN = timedelta(hours=1)
STALE_AFTER = timedelta(minutes=20)  # no progress for this long: the run is timed out
WEEKLY = timedelta(days=7)


class VerificationRefused(Exception):
    pass


def _probe_params() -> dict:
    return {"warmup_s": 1.0, "iterations": 20, "matmul_n": 8192, "copy_bytes": 256 * 2**20}


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
            ProbeJob.objects.create(run=run, node_id=node_id, params=_probe_params(),
                                    created_at=now)
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
    return bool(VerificationRun.objects.filter(pk=run_id, status=before).update(
        status=after, step_detail=detail, progress_pct=pct, updated_at=timezone.now()))


def runs_ready_for_load_test() -> list[int]:
    """Runs whose probe job has been answered (or has waited too long: judged without it)."""
    waited = timezone.now() - settings.RIGSHARE_PROBE_WAIT
    return list(VerificationRun.objects.filter(status=Status.PROBING).exclude(
        jobs__status=ProbeJob.Status.PENDING, jobs__created_at__gt=waited)
        .values_list("pk", flat=True))


def run_load_test(*, run_id: int) -> bool:
    """Load-test the node's engine from the platform; False if another worker has the run."""
    if not _claim(run_id, Status.PROBING, Status.LOAD_TESTING, "starting the load test", 35):
        return False
    run = VerificationRun.objects.select_related("node").get(pk=run_id)
    ProbeJob.objects.filter(run=run, status=ProbeJob.Status.PENDING).update(
        status=ProbeJob.Status.FAILED, error="no answer in time")
    node = run.node
    if not node.engine_url or not node.engine_reachable:
        _progress(run, "the engine was not reachable: no load test", 80)
        return True

    # The load test runs on its own event loop in a worker thread; this thread keeps the ORM
    # (which must not run inside an event loop) and writes the progress as it comes.
    latest: dict = {}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(asyncio.run, loadtest.run_load_test(
            node.engine_url, levels=settings.RIGSHARE_LOAD_TEST_LEVELS,
            max_concurrency=_advertised_concurrency(node),
            progress=lambda detail, pct: latest.update(detail=detail, pct=pct)))
        shown = None
        while True:
            try:
                result = future.result(timeout=1)
                break
            except concurrent.futures.TimeoutError:
                if latest and latest != shown:
                    shown = dict(latest)
                    _progress(run, f"load test: {shown['detail']}", 35 + shown["pct"] * 45 // 100)
            except Exception as exc:  # an engine that breaks under load: a finding, no crash
                VerificationRun.objects.filter(pk=run.pk).update(
                    error=f"load test: {exc}"[:500], updated_at=timezone.now())
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
    VerificationRun.objects.filter(pk=run.pk).update(
        model=result.model, error="; ".join(result.errors)[:500])
    _progress(run, "load test done", 80)
    return True


def _advertised_concurrency(node: Node) -> int | None:
    # The published H200 figure is at 128 concurrent: measure where the reference is.
    names = {c.name for c in node.cards.all()}
    return 128 if any("H200" in n or "H100" in n for n in names) else None


def _specs() -> list[ev.Spec]:
    return [ev.Spec(s.name, s.memory_gb, s.bandwidth_gbs, s.bf16_tflops, s.pcie_gen,
                    s.compute_capability, s.bus_width_bits, s.sm_count, tuple(s.nvml_names))
            for s in GpuSpec.objects.all()]


def run_evaluate(*, run_id: int) -> bool:
    if not _claim(run_id, Status.LOAD_TESTING, Status.EVALUATING, "evaluating", 85):
        return False
    run = VerificationRun.objects.select_related("node").get(pk=run_id)
    specs = _specs()
    job = run.jobs.filter(status=ProbeJob.Status.DONE).first()
    probe = (job.result if job else None) or {}
    by_index = {g.get("index"): g for g in probe.get("gpus") or []}
    node_level = {m.metric: m for m in run.measurements.filter(card__isnull=True)}
    served = {int(k.split("@")[1]): m.value for k, m in node_level.items()
              if k.startswith("tps@")}
    model = run.model
    cards = list(run.node.cards.filter(present=True).select_related("listing"))
    with transaction.atomic():
        Finding.objects.filter(run=run).delete()
        rows = []
        for card in cards:
            spec = ev.spec_for(card.name, specs)
            evidence = ev.Evidence(
                reported_name=card.name, reported_memory_mib=card.memory_total_mib,
                claimed_model=card.listing.claimed_gpu_model,
                claimed_vram_gb=card.listing.claimed_vram_gb,
                probe=by_index.get(card.index), wsl=bool(probe.get("wsl")),
                other_nodes_with_uuid=_other_nodes(card),
                served_tps=served, reference_tps=_reference(spec, len(cards), model),
                prefix_cache_speedup=(node_level["prefix_speedup"].value
                                      if "prefix_speedup" in node_level else None),
                context_accepted=(bool(node_level["context_accepted"].value)
                                  if "context_accepted" in node_level else None))
            rows += [Finding(run=run, card=card, **asdict(f))
                     for f in ev.evaluate(evidence, spec, specs)]
        Finding.objects.bulk_create(rows)
    _progress(run, "evaluated", 95)
    return True


def _other_nodes(card: Card) -> tuple[int, ...]:
    """Nodes that reported this GPU's UUID before this card did. The first to register a UUID
    keeps it; a later copy is the suspect (as in the heartbeat's review flag)."""
    if not card.uuid:
        return ()
    earlier = (Q(first_seen_at__lt=card.first_seen_at)
               | Q(first_seen_at=card.first_seen_at, pk__lt=card.pk))
    return tuple(Card.objects.filter(earlier, uuid=card.uuid, present=True)
                 .exclude(node=card.node_id).values_list("node_id", flat=True).distinct())


def _reference(spec: ev.Spec | None, count: int, model: str) -> dict[int, float]:
    if spec is None:
        return {}
    for ref in SERVING_REFERENCE:
        if ref["gpu"] == spec.name and ref["count"] == count and ref["model"] == model:
            return dict(ref["tps"])
    return {}


def run_publish(*, run_id: int) -> bool:
    """Each card's verdict to the catalog, and its verified capacity to routing."""
    run = VerificationRun.objects.select_related("node").get(pk=run_id)
    if run.status != Status.EVALUATING:
        return False
    findings = list(run.findings.all())
    node_level = {m.metric: m for m in run.measurements.filter(card__isnull=True)}
    cards = list(run.node.cards.filter(present=True))
    total = node_level.get("tps@32")
    model = run.model
    specs = _specs()
    with transaction.atomic():
        for card in cards:
            mine = [f for f in findings if f.card_id == card.pk]
            verdict = ev.verdict([ev.Finding(f.metric, f.severity, f.claimed, f.expected,
                                             f.measured, f.message) for f in mine])
            # Each card's share of its engine: a 2-card tensor-parallel engine counts half each.
            share = total.value / len(cards) if total and cards else None
            if share is not None and model:
                VerifiedCapacity.objects.update_or_create(
                    card=card, model=model,
                    defaults={"tokens_per_s": share, "run": run, "measured_at": timezone.now()})
            spec = ev.spec_for(card.name, specs)
            marketplace.card_verification_publish(
                card_id=card.pk, status=verdict, tokens_per_s=share,
                reference_spec=spec.name if spec else "")
        VerificationRun.objects.filter(pk=run.pk).update(
            status=Status.DONE, progress_pct=100, step_detail="done",
            finished_at=timezone.now(), updated_at=timezone.now())
    return True


def runs_time_out_stale(*, now: datetime | None = None) -> list[int]:
    """Runs with no progress for STALE_AFTER (a worker killed mid-step) are timed out and a
    fresh run is started in their place, so none stays "running" for ever."""
    now = now or timezone.now()
    stale = list(VerificationRun.objects.filter(status__in=VerificationRun.ACTIVE,
                                                updated_at__lt=now - STALE_AFTER)
                 .values_list("pk", "node_id"))
    restarted = []
    for run_id, node_id in stale:
        if VerificationRun.objects.filter(pk=run_id, status__in=VerificationRun.ACTIVE,
                                          updated_at__lt=now - STALE_AFTER).update(
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
