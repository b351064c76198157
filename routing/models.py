"""What the inference API sells (Models) and who serves it (Deployments)."""

from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

from marketplace.models import Node


class Model(models.Model):
    """A public model name, as API consumers ask for it. Its prices are billing.ModelPrice rows
    under the same name (versioned by effective time); its engines are Deployments."""

    name = models.CharField(max_length=200, unique=True, validators=[RegexValidator(
        r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$", "Letters, digits and . _ : / - only.")])
    context_length = models.PositiveIntegerField(
        validators=[MinValueValidator(1)],
        help_text="The longest prompt + completion advertised; a request is routed only to "
                  "deployments whose own context holds it.")
    description = models.CharField(max_length=300, blank=True)
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name


class EngineModel(models.Model):
    """An operator's mapping from an id an engine reports (e.g. `Qwen/Qwen3-27B-AWQ` on vLLM,
    `qwen3-27b-q4_k_m` on llama.cpp) to the public model it serves: one name, many engines."""

    engine_model_id = models.CharField(max_length=256, unique=True)
    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="engine_models")

    def __str__(self):
        return f"{self.engine_model_id} -> {self.model}"


class Deployment(models.Model):
    """One engine model served by one node's engine (its cards together: a card group)."""

    class Engine(models.TextChoices):
        VLLM = "vllm", "vLLM"
        LLAMACPP = "llama.cpp", "llama.cpp"
        UNKNOWN = "", "unknown"

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="deployments")
    # Which public model this is comes from EngineModel (or a Model of the same name), looked
    # up when the pool is built: the operator's mapping is the one place for that fact.
    engine_model_id = models.CharField(max_length=256)
    engine = models.CharField(max_length=16, choices=Engine.choices, blank=True)
    max_context = models.PositiveIntegerField(null=True, blank=True)
    quantization = models.CharField(max_length=64, blank=True)
    # Still reported by the node's agent; a model the engine stopped serving stays as history.
    reported = models.BooleanField(default=True)
    first_seen_at = models.DateTimeField(default=timezone.now)
    last_seen_at = models.DateTimeField(default=timezone.now)
    # The platform's own health check of the engine (routing.tasks), not the agent's word.
    healthy = models.BooleanField(default=True)
    health_failures = models.PositiveSmallIntegerField(default=0)
    health_checked_at = models.DateTimeField(null=True, blank=True)
    health_error = models.CharField(max_length=256, blank=True)
    # What the engine's own /metrics said at the last health check, where it has them (vLLM,
    # llama-server --metrics): its queue, and its prefix cache's counters since it started.
    engine_running = models.PositiveIntegerField(null=True, blank=True)
    engine_waiting = models.PositiveIntegerField(null=True, blank=True)
    prefix_queries = models.BigIntegerField(null=True, blank=True)
    prefix_hits = models.BigIntegerField(null=True, blank=True)
    # When the platform next checks it unannounced (routing/checks.py), drawn at random.
    next_check_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["node", "engine_model_id"],
                                               name="deployment_node_engine_model")]

    def __str__(self):
        return f"{self.engine_model_id} on node #{self.node_id}"

    @property
    def worker_ref(self) -> str:
        return worker_ref(self.pk)


def worker_ref(deployment_id: int) -> str:
    """How a deployment is named in headers, metrics, charges and logs."""
    return f"deployment:{deployment_id}"


class RequestLog(models.Model):
    """One /v1 request as the proxy saw it; written in batches, off the request path."""

    request_id = models.CharField(max_length=100, db_index=True)
    created_at = models.DateTimeField(db_index=True)
    user_id = models.BigIntegerField(null=True, blank=True)  # (user_id, created_at) below
    api_key_id = models.BigIntegerField(null=True, blank=True)
    endpoint = models.CharField(max_length=32)
    model = models.CharField(max_length=200, blank=True)
    deployment_id = models.BigIntegerField(null=True, blank=True)
    stream = models.BooleanField(default=False)
    status = models.PositiveSmallIntegerField()
    error_code = models.CharField(max_length=64, blank=True)
    attempts = models.PositiveSmallIntegerField(default=0)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    estimated = models.BooleanField(default=False)
    ttft_ms = models.FloatField(null=True, blank=True)
    latency_ms = models.FloatField()
    # Requests in flight to the deployment while this one ran (the most the platform saw),
    # this one included: the concurrency its speed is judged at (routing/traffic.py).
    concurrency = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        # A consumer's activity log, newest first, a page at a time (routing.selectors).
        indexes = [models.Index(fields=["user_id", "created_at", "id"],
                                name="requestlog_user_time")]

    def __str__(self):
        return f"{self.request_id} {self.status}"


class TrafficBucket(models.Model):
    """What one deployment served in one time bucket (five minutes or an hour) and concurrency
    band, summed as the request log is written (routing/traffic.py): the live figures are sums
    of these, never a scan of the request log."""

    deployment_id = models.BigIntegerField()
    span_s = models.PositiveIntegerField()
    start = models.DateTimeField()
    band = models.PositiveIntegerField()  # its lowest concurrency
    requests = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0)
    streams = models.PositiveIntegerField(default=0)  # those counted for decode speed and TTFT
    decode_tokens = models.BigIntegerField(default=0)
    decode_ms = models.FloatField(default=0)
    # TTFT histogram: bin i counts the streams within traffic.TTFT_BOUNDS_MS[i] (the last bin:
    # slower than all of them).
    ttft_0 = models.PositiveIntegerField(default=0)
    ttft_1 = models.PositiveIntegerField(default=0)
    ttft_2 = models.PositiveIntegerField(default=0)
    ttft_3 = models.PositiveIntegerField(default=0)
    ttft_4 = models.PositiveIntegerField(default=0)
    ttft_5 = models.PositiveIntegerField(default=0)
    ttft_6 = models.PositiveIntegerField(default=0)
    ttft_7 = models.PositiveIntegerField(default=0)
    ttft_8 = models.PositiveIntegerField(default=0)
    ttft_9 = models.PositiveIntegerField(default=0)
    ttft_10 = models.PositiveIntegerField(default=0)
    ttft_11 = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["deployment_id", "span_s", "start", "band"],
                                               name="traffic_bucket_once")]
        indexes = [models.Index(fields=["span_s", "start"], name="traffic_bucket_window")]

    def __str__(self):
        return f"deployment {self.deployment_id} at {self.start:%H:%M} band {self.band}"



class UnannouncedCheck(models.Model):
    """A few requests the platform sent a worker at a random time, as a renter's are sent
    (routing/checks.py): the node's history of them. Never billed."""

    deployment_id = models.BigIntegerField()
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="checks")
    at = models.DateTimeField(default=timezone.now)
    model = models.CharField(max_length=256)
    requests = models.PositiveSmallIntegerField()
    errors = models.PositiveSmallIntegerField(default=0)
    concurrency = models.PositiveIntegerField(default=1)  # in flight to it, the check's included
    tokens_per_s = models.FloatField(null=True, blank=True)  # decode speed per stream
    ttft_ms = models.FloatField(null=True, blank=True)  # median time to first token

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["node", "-at"], name="check_node_time")]

    def __str__(self):
        return f"check of deployment {self.deployment_id} at {self.at:%Y-%m-%d %H:%M}"
