"""Verification: reference specs, runs, what was measured, and what it means for renters.

A run verifies one node: the agent probes its GPUs, the platform load-tests its engine, a pure
evaluator (evaluate.py) turns measurements + spec + claims into findings, and the card's
verified capacity is published for routing.
"""

from django.db import models
from django.db.models import Q
from django.utils import timezone

from marketplace.models import Card, Node


class GpuSpec(models.Model):
    """A GPU model's published figures (seeded by a data migration; operators edit in admin)."""

    name = models.CharField(max_length=100, unique=True)
    nvml_names = models.JSONField(default=list)  # the names NVML reports for this model
    memory_gb = models.PositiveIntegerField()
    bandwidth_gbs = models.PositiveIntegerField()
    bf16_tflops = models.PositiveIntegerField(null=True, blank=True)  # dense, FP32 accumulate
    l2_mb = models.PositiveIntegerField(null=True, blank=True)
    power_w = models.PositiveIntegerField(null=True, blank=True)
    pcie_gen = models.PositiveSmallIntegerField(null=True, blank=True)
    compute_capability = models.CharField(max_length=8, blank=True)
    bus_width_bits = models.PositiveIntegerField(null=True, blank=True)
    sm_count = models.PositiveIntegerField(null=True, blank=True)
    sources = models.JSONField(default=dict)  # field (or "*") -> where the figure comes from

    class Meta:
        ordering = ["name"]
        verbose_name = "GPU spec"

    def __str__(self):
        return self.name

    def source_of(self, field: str) -> str:
        return self.sources.get(field) or self.sources.get("*", "")


class VerificationRun(models.Model):
    class Status(models.TextChoices):
        QUEUED = "queued"
        PROBING = "probing", "probing the hardware"
        LOAD_TESTING = "load_testing", "load-testing the engine"
        EVALUATING = "evaluating"
        DONE = "done"
        FAILED = "failed"
        TIMED_OUT = "timed_out", "timed out"

    ACTIVE = (Status.QUEUED, Status.PROBING, Status.LOAD_TESTING, Status.EVALUATING)

    class YardstickState(models.TextChoices):
        ASKED = "asked", "asked of the machine"  # the heartbeat reply carries its command
        DONE = "done", "measured"
        SKIPPED = "skipped"
        FAILED = "failed"

    class Trigger(models.TextChoices):
        ENROLMENT = "enrolment"
        HARDWARE_CHANGE = "hardware_change", "hardware or driver change"
        ENGINE_CHANGE = "engine_change", "new engine configuration"
        SCHEDULE = "schedule", "weekly check"
        PROVIDER = "provider", "requested by the provider"
        OPERATOR = "operator", "requested by an operator"
        RESTART = "restart", "restarted after a timeout"
        SERVED_TRAFFIC = "served_traffic", "served traffic slower than verified"
        PEERS = "peers", "serving read again against its peers' figures"

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="verification_runs")
    trigger = models.CharField(max_length=20, choices=Trigger.choices)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.QUEUED)
    step_detail = models.CharField(max_length=200, blank=True)  # "concurrency 8 of 1, 8, 32"
    progress_pct = models.PositiveSmallIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    updated_at = models.DateTimeField(default=timezone.now)  # any progress; stale runs time out
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True)
    model = models.CharField(max_length=200, blank=True)  # the engine model load-tested
    # The provider's model as the engine described it when it was load-tested: its `served`
    # entry (engine, quantization, the files the agent read) and the command's layout, so that
    # a later judgment reads what was measured, not what the engine serves by then.
    served = models.JSONField(default=dict, blank=True)
    # That model's answers to the canary prompts (verification/fingerprint.py).
    fingerprint = models.JSONField(default=list, blank=True)
    # The platform's yardstick (verification/yardstick.py): the workload (its key), where the
    # run is with it (asked: the heartbeat reply carries `config` for the agent to serve;
    # done; skipped or failed, with the reason in yardstick_note), the command handed over.
    yardstick = models.CharField(max_length=200, blank=True)
    yardstick_state = models.CharField(max_length=16, blank=True, choices=YardstickState.choices)
    yardstick_config = models.JSONField(default=dict, blank=True)
    yardstick_note = models.CharField(max_length=300, blank=True)
    # Times a step was taken up again after the worker doing it died (services.STEP_STALE).
    resumed = models.PositiveSmallIntegerField(default=0)
    # A worker is doing a step now (it stamps updated_at as it goes); false while the run waits
    # for its next step's task, however long the queue: only a running step can go stale.
    step_running = models.BooleanField(default=False)
    # A load test read by a worker too crowded to keep up, or cut short by the engine, is not
    # judged: the run waits for its load test again until measure_after (services._measure_later),
    # `remeasured` times so far.
    measure_after = models.DateTimeField(null=True, blank=True)
    remeasured = models.PositiveSmallIntegerField(default=0)
    # A reading whose serving fell short is taken again before the card is flagged on it
    # (services.TIMED): the first reading's shortfalls, {"at": ..., "findings": {metric: ...}}.
    first_reading = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [models.UniqueConstraint(
            fields=["node"], condition=Q(status__in=["queued", "probing", "load_testing",
                                                     "evaluating"]),
            name="verification_one_active_run_per_node")]

    def __str__(self):
        return f"run #{self.pk} of {self.node} ({self.status})"

    @property
    def is_active(self) -> bool:
        return self.status in self.ACTIVE


class ProbeJob(models.Model):
    """Work for the agent, handed out in heartbeat replies until it answers."""

    class Status(models.TextChoices):
        PENDING = "pending"
        DONE = "done"
        FAILED = "failed"

    run = models.ForeignKey(VerificationRun, on_delete=models.CASCADE, related_name="jobs")
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="probe_jobs")
    kind = models.CharField(max_length=32, default="probes")
    params = models.JSONField(default=dict)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    result = models.JSONField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    answered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["node", "status"])]

    def __str__(self):
        return f"{self.kind} job #{self.pk} ({self.status})"


class Measurement(models.Model):
    """One measured figure of a run; (run, card, metric) is unique, so a retried task
    overwrites rather than duplicates."""

    run = models.ForeignKey(VerificationRun, on_delete=models.CASCADE,
                            related_name="measurements")
    card = models.ForeignKey(Card, null=True, blank=True, on_delete=models.CASCADE,
                             related_name="measurements")  # null: the node's engine as a whole
    metric = models.CharField(max_length=64)
    value = models.FloatField()  # a physical quantity (GB/s, TFLOPS, tok/s, ms), not money
    unit = models.CharField(max_length=16)
    details = models.JSONField(default=dict, blank=True)

    class Meta:
        # Two partial unique indexes rather than one with NULLS NOT DISTINCT, which SQLite (the
        # demo's database) cannot enforce: the engine's own figures (card NULL) are unique too.
        constraints = [
            models.UniqueConstraint(fields=["run", "card", "metric"],
                                    condition=models.Q(card__isnull=False),
                                    name="measurement_once_per_card"),
            models.UniqueConstraint(fields=["run", "metric"],
                                    condition=models.Q(card__isnull=True),
                                    name="measurement_once_per_engine"),
        ]

    def __str__(self):
        return f"{self.metric} = {self.value:g} {self.unit}"


class Finding(models.Model):
    class Severity(models.TextChoices):
        OK = "ok"
        WARNING = "warning"
        MISMATCH = "mismatch"
        # One side of the comparison is missing: shown grey with the reason, never as passed.
        NOT_MEASURED = "not_measured", "not measured"

    run = models.ForeignKey(VerificationRun, on_delete=models.CASCADE, related_name="findings")
    card = models.ForeignKey(Card, on_delete=models.CASCADE, related_name="findings")
    severity = models.CharField(max_length=16, choices=Severity.choices)
    metric = models.CharField(max_length=64)
    claimed = models.CharField(max_length=100, blank=True)
    expected = models.CharField(max_length=100, blank=True)
    measured = models.CharField(max_length=100, blank=True)
    message = models.CharField(max_length=500)
    # What `expected` stands on (spec, peers, reference, prediction, none) and, for serving,
    # every basis per concurrency: the rent page's plot.
    basis = models.CharField(max_length=16, blank=True)
    details = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["card_id", "id"]
        constraints = [models.UniqueConstraint(fields=["run", "card", "metric"],
                                               name="finding_once")]

    def __str__(self):
        return f"{self.severity}: {self.message}"


class VerifiedCapacity(models.Model):
    """What routing may count on: output tokens/s at 32 concurrent, per (card, model)."""

    card = models.ForeignKey(Card, on_delete=models.CASCADE, related_name="capacities")
    model = models.CharField(max_length=200)
    tokens_per_s = models.FloatField()
    # What routing weighs the card by: the measurement, kept as it was while re-measurements
    # stay within ROUTING_HYSTERESIS of it, so that noise moves no conversation to another
    # worker. Empty: the measurement itself.
    routing_tps = models.FloatField(null=True, blank=True)
    concurrency = models.PositiveSmallIntegerField(default=32)
    run = models.ForeignKey(VerificationRun, on_delete=models.CASCADE, related_name="+")
    measured_at = models.DateTimeField(default=timezone.now)
    # When routing first counted on it: a newly verified card's traffic ramps up from here.
    routed_since = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["card", "model"],
                                               name="capacity_card_model")]
        verbose_name_plural = "verified capacities"

    def __str__(self):
        return f"{self.card}: {self.tokens_per_s:.0f} tok/s of {self.model}"


class ServedDrift(models.Model):
    """An episode of a node's engine serving the platform's traffic far below the speed it was
    verified at (routing/drift.py): routing weighs it by what it served, a run checks it, and the
    run's verdict closes it (confirmed: the card is flagged with these figures; cleared: the
    run's figure stands and the episode stays in the card's history)."""

    class Outcome(models.TextChoices):
        OPEN = "open", "being checked"
        CONFIRMED = "confirmed"
        CLEARED = "cleared", "not confirmed by the run"

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="served_drifts")
    model = models.CharField(max_length=200)  # the engine model id that served the traffic
    deployment_id = models.BigIntegerField()
    # The concurrency band of the traffic (its lowest concurrency) and the verified level it was
    # compared with (the band's highest concurrency, where each stream is slowest).
    band = models.PositiveIntegerField()
    band_label = models.CharField(max_length=16)  # "2-8"
    level = models.PositiveIntegerField()
    served_tps = models.FloatField()  # decode tokens/s per stream, as served
    verified_tps = models.FloatField()  # per stream at `level`, as verified
    streams = models.PositiveIntegerField()
    window_start = models.DateTimeField()
    opened_at = models.DateTimeField(default=timezone.now)
    run = models.ForeignKey(VerificationRun, null=True, blank=True, on_delete=models.SET_NULL,
                            related_name="served_drifts")
    outcome = models.CharField(max_length=16, choices=Outcome.choices, default=Outcome.OPEN)
    closed_at = models.DateTimeField(null=True, blank=True)
    note = models.CharField(max_length=300, blank=True)

    class Meta:
        ordering = ["-opened_at", "-id"]
        constraints = [models.UniqueConstraint(fields=["node"], condition=Q(outcome="open"),
                                               name="served_drift_one_open_per_node")]

    def __str__(self):
        return f"node {self.node_id}: {self.served_tps:.1f} of {self.verified_tps:.1f} tok/s"

    @property
    def ratio(self) -> float:
        return self.served_tps / self.verified_tps if self.verified_tps else 0.0
