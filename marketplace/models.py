"""Things for sale: machines (Node), their GPUs (Card), offers (Listing) and rentals.

Hardware facts on Node and Card are written only from agent heartbeats (services.py); forms
and the REST API may change only a provider's own words: names, region, price, claims.
"""

import hashlib
import hmac

from django.conf import settings
from django.db import models
from django.db.models import F, Q, Value
from django.db.models.functions import Cast, Coalesce, Concat, Upper
from django.utils import timezone

from marketplace import engine_tls


# How the ledger names what earned: a rental's transfers name its card, a served request's
# charge names the machine whose engine answered it (an engine may span several cards).
def card_ref(card_id: int) -> str:
    return f"card:{card_id}"


def node_ref(node_id: int) -> str:
    return f"node:{node_id}"


def ref_id(reference: str, kind: str) -> int | None:
    """The id in a `kind:N` reference, or None when it names something else."""
    prefix, _, value = reference.partition(":")
    return int(value) if prefix == kind and value.isdigit() else None


class EnrolmentToken(models.Model):
    """A one-time token that lets an agent create a Node for its owner."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                              related_name="enrolment_tokens")
    prefix = models.CharField(max_length=32, unique=True)
    digest = models.CharField(max_length=64)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    node = models.ForeignKey("Node", null=True, blank=True, on_delete=models.SET_NULL,
                             related_name="+")

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return f"rse_{self.prefix}_… ({self.state()})"

    def state(self, now=None) -> str:
        now = now or timezone.now()
        if self.used_at:
            return "used"
        if self.revoked_at:
            return "revoked"
        if self.expires_at <= now:
            return "expired"
        return "active"


class Node(models.Model):
    """A provider's machine, as its agent reports it."""

    class Status(models.TextChoices):
        ONLINE = "online"
        OFFLINE = "offline"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                              related_name="nodes")
    name = models.CharField(max_length=100)
    region = models.CharField(max_length=64, blank=True, db_index=True)
    created_at = models.DateTimeField(default=timezone.now)

    credential_prefix = models.CharField(max_length=32, unique=True)
    credential_digest = models.CharField(max_length=64)
    credential_revoked_at = models.DateTimeField(null=True, blank=True)

    # Reported by the agent in every heartbeat.
    hostname = models.CharField(max_length=256, blank=True)
    os = models.CharField(max_length=256, blank=True)
    agent_version = models.CharField(max_length=64, blank=True)
    driver_version = models.CharField(max_length=64, blank=True)
    cuda_version = models.CharField(max_length=64, blank=True)
    has_nvidia = models.BooleanField(default=False)
    simulated = models.BooleanField(default=False)
    engine_url = models.CharField(max_length=256, blank=True)  # as the agent reports it
    # Where the platform calls the engine: engine_url with its host resolved and checked
    # (engine_address.py); empty while the URL is refused. Checked again when the URL changes
    # and at least every ENGINE_RECHECK.
    engine_connect_url = models.CharField(max_length=300, blank=True)
    engine_checked_at = models.DateTimeField(null=True, blank=True)
    # The certificate the engine presents over TLS (PEM), as the agent read it on the machine,
    # and its SHA-256: the platform's connections trust it alone (engine_tls.py). Empty:
    # plain HTTP, or not reported.
    engine_tls_certificate = models.TextField(blank=True)
    engine_tls_fingerprint = models.CharField(max_length=64, blank=True)
    engine_reachable = models.BooleanField(default=False)
    engine_models = models.JSONField(default=list, blank=True)
    # Per model in engine_models that the agent described: [{"id", "engine", "max_context",
    # "quantization"}] as the heartbeat serializer validated it (docs/agent-protocol.md).
    engine_served = models.JSONField(default=list, blank=True)
    engine_error = models.CharField(max_length=256, blank=True)
    # The engines installed beside the agent, by kind, as the agent read their versions:
    # {"vllm": "0.30.1", "llama-server": "b6500"}; the engine configuration is computed for
    # the version the node will run (empty: not said, the platform's assumed version).
    engine_versions = models.JSONField(default=dict, blank=True)
    # The engine as the agent's child (docs/agent-protocol.md, section 4): its state as the
    # agent last said it ("" where the agent does not run the engine: the provider runs it),
    # since when (the platform's clock), and the rest of what the agent said of it
    # (`engine.supervisor` as validated: argv with the key masked, pid, exit code, log tail...).
    engine_state = models.CharField(max_length=16, blank=True)
    engine_state_since = models.DateTimeField(null=True, blank=True)
    engine_process = models.JSONField(default=dict, blank=True)
    # Which command the engine last became ready with (a digest of its argv): a different one
    # is a new engine configuration, verified again.
    engine_ready_digest = models.CharField(max_length=64, blank=True)
    # Restarts the owner asked for: the heartbeat reply carries the count, and the agent
    # restarts its engine when it grows past the one it has acted on.
    engine_restarts_requested = models.PositiveIntegerField(default=0)
    engine_restart_requested_at = models.DateTimeField(null=True, blank=True)
    # The engine key (marketplace/engine_keys.py), sealed: `engine_key_sealed` is the one the
    # platform sends the engine (the agent reported its engine runs with it), `engine_key_next`
    # one issued to the agent that its engine does not run with yet (a new node's first key, a
    # rotation). The platform never sends a key before the agent says its engine has it.
    engine_key_sealed = models.TextField(blank=True)
    engine_key_fingerprint = models.CharField(max_length=16, blank=True)
    engine_key_next = models.TextField(blank=True)
    # Whether the engine refused the platform's health check without the key (None: not known).
    engine_key_enforced = models.BooleanField(null=True, blank=True)
    # What the catalog's search reads, kept by the database itself: the name and the served
    # models in capitals (migrations/0008 indexes its trigrams).
    search_text = models.GeneratedField(
        expression=Upper(Concat("name", Value(" "), Cast("engine_models", models.TextField()),
                                output_field=models.TextField())),
        output_field=models.TextField(), db_persist=True)
    hardware_changed_at = models.DateTimeField(null=True, blank=True)
    # The machine around the GPUs, from the heartbeat's `host` (agent/host.py): empty or null
    # where the agent could not read a fact, or is older than these facts.
    cpu_model = models.CharField(max_length=256, blank=True)
    cpu_cores = models.PositiveIntegerField(null=True, blank=True)  # logical, as the OS counts
    ram_mib = models.PositiveIntegerField(null=True, blank=True)
    disk_free_gb = models.PositiveIntegerField(null=True, blank=True)  # 10^9 bytes, of "/"
    net_link_mbps = models.PositiveIntegerField(null=True, blank=True)  # fastest physical link

    status = models.CharField(max_length=16, choices=Status.choices, default=Status.OFFLINE,
                              db_index=True)
    status_changed_at = models.DateTimeField(default=timezone.now)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    # Share of the reliability window covered by heartbeats, refreshed by services.
    reliability_pct = models.DecimalField(max_digits=5, decimal_places=2, default=0,
                                          db_index=True)

    # An operator's hold: out of the catalog and of shared /v1 traffic until they lift it.
    needs_review = models.BooleanField(default=False)
    review_reason = models.CharField(max_length=512, blank=True)
    # A GPU UUID this node reports is held by a node that reported it first (UuidConflict):
    # kept out the same way, set and cleared by the heartbeats themselves.
    uuid_conflict = models.BooleanField(default=False, db_index=True)

    class Meta:
        ordering = ["name", "id"]
        indexes = [
            # The catalog's reliability sort (marketplace.filters.SORTS): nodes a catalog may
            # show, in order, their cards found through (node, index).
            models.Index(fields=["reliability_pct", "id"], name="node_catalog_reliability",
                         condition=Q(status="online", credential_revoked_at__isnull=True,
                                     needs_review=False, uuid_conflict=False)),
            # The catalog's region filter (any case): the index, and the statistics PostgreSQL
            # keeps on its expression, without which it guesses one node in 200 matches.
            models.Index(Upper("region"), name="node_region_upper"),
        ]

    def __str__(self):
        return f"{self.name} (#{self.pk})"

    @property
    def engine_encrypted(self) -> bool:
        """The platform reaches the engine over TLS, pinned to its reported certificate."""
        return engine_tls.encrypted(self.engine_connect_url, self.engine_tls_certificate)

    @property
    def is_online(self) -> bool:
        return self.status == self.Status.ONLINE

    @property
    def engine_takes_work(self) -> bool:
        """The engine may be sent new requests: ready, or run by the provider (no state; then
        whether it answers decides). Starting, loading, draining, crashed or stopped: not; nor
        while it serves the platform's yardstick for a verification run."""
        return self.engine_state in ("", "ready") and not self.engine_on_yardstick

    @property
    def engine_on_yardstick(self) -> bool:
        return bool((self.engine_process or {}).get("yardstick"))

    @property
    def held_out(self) -> bool:
        """Out of the catalog, rentals and shared /v1 traffic."""
        return self.needs_review or self.uuid_conflict


class UuidConflict(models.Model):
    """A GPU UUID reported by `node` while `incumbent`, which reported it first, still does.

    One GPU cannot sit in two machines, so one of the two reports is false; the node that
    brought the UUID later (the newcomer) is kept out, and the incumbent, with its history,
    stays listed. The row is closed, never deleted, when the conflict ends, so the history
    stays (services.uuid_conflicts_refresh).
    """

    uuid = models.CharField(max_length=96)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="uuid_conflicts")
    incumbent = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="+")
    opened_at = models.DateTimeField(default=timezone.now)
    closed_at = models.DateTimeField(null=True, blank=True)
    closed_because = models.CharField(max_length=200, blank=True)

    class Meta:
        ordering = ["-opened_at"]
        constraints = [models.UniqueConstraint(fields=["node", "uuid"],
                                               condition=Q(closed_at__isnull=True),
                                               name="uuid_conflict_one_open")]
        indexes = [models.Index(fields=["incumbent", "closed_at"])]

    def __str__(self):
        state = "open" if self.closed_at is None else "closed"
        return f"GPU {self.uuid} on node #{self.node_id}, held by #{self.incumbent_id} ({state})"


class NodeStatusChange(models.Model):
    """Every online/offline transition, for the uptime history and later for billing."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="status_changes")
    status = models.CharField(max_length=16, choices=Node.Status.choices)
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-at"]
        indexes = [models.Index(fields=["node", "-at"])]

    def __str__(self):
        return f"{self.node_id} {self.status} at {self.at:%Y-%m-%d %H:%M:%S}"


class NodeUptimeHour(models.Model):
    """Heartbeats counted per node and hour: the ground for reliability and the uptime chart."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="uptime_hours")
    hour = models.DateTimeField()
    heartbeats = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["node", "hour"], name="uptime_node_hour")]
        ordering = ["hour"]

    def __str__(self):
        return f"{self.node_id} {self.hour:%Y-%m-%d %H:00}: {self.heartbeats}"


class Card(models.Model):
    """One GPU of a node, as NVML (or a fleetsim profile) describes it."""

    class Verification(models.TextChoices):
        UNVERIFIED = "unverified", "not verified yet"
        VERIFIED = "verified", "verified"
        # Only the engine could be measured (Apple Silicon without probes): its serving speed
        # is verified, its hardware is not.
        SERVING_VERIFIED = "serving_verified", "serving verified"
        # Measured and never found short, but its serving could not be judged: an engine its
        # provider runs by hand (no yardstick), a model whose size nothing says.
        NOT_JUDGED = "not_judged", "serving not judged"
        FLAGGED = "flagged", "mismatch found"

    # Verified to serve as its hardware should: what the fleet's figures are drawn from.
    SERVING_JUDGED = (Verification.VERIFIED, Verification.SERVING_VERIFIED)
    # What shared /v1 traffic may reach, weighted by the capacity measured from the platform.
    ROUTABLE = (*SERVING_JUDGED, Verification.NOT_JUDGED)

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="cards")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=96, blank=True, db_index=True)
    name = models.CharField(max_length=128, db_index=True)
    memory_total_mib = models.PositiveIntegerField(null=True, blank=True, db_index=True)
    compute_capability = models.CharField(max_length=16, blank=True)
    pcie_gen_current = models.PositiveSmallIntegerField(null=True, blank=True)
    pcie_gen_max = models.PositiveSmallIntegerField(null=True, blank=True)
    pcie_width_current = models.PositiveSmallIntegerField(null=True, blank=True)
    pcie_width_max = models.PositiveSmallIntegerField(null=True, blank=True)
    # NVLink links up on this GPU (nvmlDeviceGetNvLinkState over each link): 0 on a card
    # joined to the others by PCIe alone, null where NVML could not say or the agent is older.
    nvlink_links = models.PositiveSmallIntegerField(null=True, blank=True)
    power_limit_w = models.PositiveIntegerField(null=True, blank=True)
    present = models.BooleanField(default=True)  # false once the agent stops reporting it
    first_seen_at = models.DateTimeField(default=timezone.now)
    last_seen_at = models.DateTimeField(default=timezone.now)
    verification_status = models.CharField(max_length=16, choices=Verification.choices,
                                           default=Verification.UNVERIFIED, db_index=True)
    # Written by verification: output tokens/s at 32 concurrent (this card's share of its
    # engine), and the reference spec it was judged against ("" = none in the table).
    verified_tokens_per_s = models.FloatField(null=True, blank=True, db_index=True)
    reference_spec = models.CharField(max_length=100, blank=True)
    # Written by verification: how many of the latest run's findings on this card are
    # mismatches or warnings (the provider's dashboard counts them).
    verification_problems = models.PositiveSmallIntegerField(default=0)
    # What that figure means: the model the engine served during the load test and the number
    # of concurrent requests it was measured at ("" and null until a load test succeeds).
    verified_model = models.CharField(max_length=200, blank=True)
    verified_concurrency = models.PositiveSmallIntegerField(null=True, blank=True)
    # Memory bandwidth the probes measured (best STREAM triad), and the reference spec's figure
    # it is judged against (null: not measured, or no spec).
    bandwidth_gbs = models.FloatField(null=True, blank=True)
    spec_bandwidth_gbs = models.PositiveIntegerField(null=True, blank=True)
    # Written by verification with the figures above: output tokens/s of one request alone
    # (this card's share of its engine, as verified_tokens_per_s), and the GPU's power draw
    # (W, NVML) while idle and while serving verified_concurrency requests, from the
    # heartbeats around and during the load test. The break-even calculator starts from them.
    verified_single_tokens_per_s = models.FloatField(null=True, blank=True)
    power_idle_w = models.FloatField(null=True, blank=True)
    power_loaded_w = models.FloatField(null=True, blank=True)
    # The latest power draw a heartbeat reported (W) and when: agents report it while the
    # platform measures the machine (docs/agent-protocol.md, `report_power`).
    power_draw_w = models.PositiveIntegerField(null=True, blank=True)
    power_read_at = models.DateTimeField(null=True, blank=True)
    # Written by routing every minute from the traffic its engine served (routing/traffic.py):
    # decode tokens/s per stream and TTFT p50 over the last hour, of the model it served most,
    # and every served model's figures over the last hour and day (`served`: {"models": [...]}).
    served_tokens_per_s = models.FloatField(null=True, blank=True)
    served_ttft_ms = models.FloatField(null=True, blank=True)
    served = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["node_id", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="card_node_index")]
        indexes = [
            # The catalog's VRAM and capacity sorts, as marketplace.filters.SORTS orders them.
            models.Index(Coalesce(F("memory_total_mib"), Value(0)), F("id"),
                         name="card_catalog_vram", condition=Q(present=True)),
            models.Index(Coalesce(F("verified_tokens_per_s"), Value(0.0)), F("id"),
                         name="card_catalog_capacity", condition=Q(present=True)),
            models.Index(Coalesce(F("served_tokens_per_s"), Value(0.0)), F("id"),
                         name="card_catalog_served", condition=Q(present=True)),
            # The GPU filter (any case), as for Node's region.
            models.Index(Upper("name"), name="card_name_upper"),
        ]

    def __str__(self):
        return f"{self.name} #{self.number} on {self.node}"

    @property
    def number(self) -> int:
        """The card's place in its machine as people count it: #1 is NVML's index 0."""
        return self.index + 1

    @property
    def public_id(self) -> str:
        """What the public sees of the GPU UUID: a short keyed digest. The full UUID is shown
        only to the owner and staff, so nobody can copy a competitor's UUID from the site."""
        if not self.uuid:
            return ""
        digest = hmac.new(settings.SECRET_KEY.encode(), self.uuid.encode(), hashlib.sha256)
        return "gpu-" + digest.hexdigest()[:12]

    @property
    def memory_gb(self) -> float | None:
        # Display only; MiB from NVML shown as GB the way vendors round (24,564 MiB -> 24 GB).
        if self.memory_total_mib is None:
            return None
        return round(self.memory_total_mib / 1024)


# How the catalog's cost sort counts a card not verified yet: above any real cost, so that it
# comes last from cheapest to dearest.
UNKNOWN_COST = 2**62


class Listing(models.Model):
    """The provider's offer for one card: whether it is for rent, its price, their claims."""

    card = models.OneToOneField(Card, on_delete=models.CASCADE, related_name="listing")
    is_listed = models.BooleanField(default=False)
    price_per_hour_micros = models.BigIntegerField(default=0)
    claimed_gpu_model = models.CharField(max_length=128, blank=True)
    claimed_vram_gb = models.PositiveIntegerField(null=True, blank=True)
    description = models.TextField(blank=True, max_length=2000)
    updated_at = models.DateTimeField(auto_now=True)
    # $ per 1M output tokens at full use: the price over the card's verified tokens/s
    # (marketplace.costs.per_mtok_micros), null until verification measured it. Kept by
    # services whenever either changes, so that the catalog can sort by it through an index.
    cost_per_mtok_micros = models.BigIntegerField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(price_per_hour_micros__gte=0),
                                   name="listing_price_not_negative"),
            models.CheckConstraint(condition=Q(is_listed=False) | Q(price_per_hour_micros__gt=0),
                                   name="listing_listed_has_price"),
        ]
        indexes = [
            models.Index(fields=["is_listed", "price_per_hour_micros"]),
            # The catalog's price sort: listed cards by price, then card.
            models.Index(fields=["price_per_hour_micros", "card"], name="listing_catalog_price",
                         condition=Q(is_listed=True)),
            # The catalog's cost sort (marketplace.filters.SORTS): an unknown cost last.
            models.Index(Coalesce(F("cost_per_mtok_micros"), Value(UNKNOWN_COST),
                                  output_field=models.BigIntegerField()), F("card"),
                         name="listing_catalog_cost", condition=Q(is_listed=True)),
        ]

    def __str__(self):
        return f"Listing of {self.card}"


class Rental(models.Model):
    class StopReason(models.TextChoices):
        REQUESTED = "requested", "stopped by the renter"
        EXPIRED = "expired", "booked time ended"
        PROVIDER = "provider", "ended by the provider"
        OPERATOR = "operator", "ended by an operator"
        BALANCE = "balance", "balance ran out"

    card = models.ForeignKey(Card, on_delete=models.PROTECT, related_name="rentals")
    renter = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT,
                               related_name="rentals")
    price_per_hour_micros = models.BigIntegerField()  # the price agreed when it started
    started_at = models.DateTimeField()
    ends_at = models.DateTimeField(null=True, blank=True)  # null: until stopped
    stopped_at = models.DateTimeField(null=True, blank=True)
    stop_reason = models.CharField(max_length=16, choices=StopReason.choices, blank=True)
    # Charging: from ready_at on, per second, except while the node is offline.
    ready_at = models.DateTimeField(null=True, blank=True)
    charged_until = models.DateTimeField(null=True, blank=True)
    billed_seconds = models.PositiveIntegerField(default=0)
    offline_seconds = models.PositiveIntegerField(default=0)  # not billed: the node was down
    charged_micros = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["-started_at"]
        constraints = [
            # The database, not a check in Python, guarantees one renter per card at a time.
            models.UniqueConstraint(fields=["card"], condition=Q(stopped_at__isnull=True),
                                    name="rental_one_active_per_card"),
        ]
        indexes = [models.Index(fields=["renter", "-started_at"])]

    def __str__(self):
        return f"Rental #{self.pk} of {self.card} by {self.renter}"

    @property
    def is_active(self) -> bool:
        return self.stopped_at is None

    def elapsed_seconds(self, now=None) -> int:
        end = self.stopped_at or now or timezone.now()
        return max(0, int((end - self.started_at).total_seconds()))


class ProviderAlert(models.Model):
    """Something a provider must know about their machines: shown on their dashboard and
    sent by email (marketplace/alerts.py)."""

    class Kind(models.TextChoices):
        NODE_OFFLINE = "node_offline", "machine offline"
        NODE_BACK = "node_back", "machine back online"
        CARD_FLAGGED = "card_flagged", "card flagged by verification"
        SERVED_SLOW = "served_slow", "serving slower than verified"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                              related_name="provider_alerts")
    kind = models.CharField(max_length=32, choices=Kind.choices)
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.CASCADE,
                             related_name="alerts")
    card = models.ForeignKey(Card, null=True, blank=True, on_delete=models.CASCADE,
                             related_name="alerts")
    message = models.CharField(max_length=300)
    created_at = models.DateTimeField(default=timezone.now)
    read_at = models.DateTimeField(null=True, blank=True)
    emailed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["owner", "read_at"], name="alert_owner_unread")]

    def __str__(self):
        return f"{self.get_kind_display()}: {self.message}"


class EngineOverride(models.Model):
    """One flag of a node's engine command set by hand, on top of what the platform computes
    (marketplace/engine_config.py). Set by the node's owner on their machine page or by staff
    in the admin; the value is checked against the flag's range and the node's memory before
    it is stored, and shown beside the computed value."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="engine_overrides")
    flag = models.CharField(max_length=64)  # as on the command line: "--max-model-len"
    value = models.CharField(max_length=256)
    reason = models.CharField(max_length=300)
    set_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                               on_delete=models.SET_NULL, related_name="+")
    set_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["node_id", "flag"]
        constraints = [models.UniqueConstraint(fields=["node", "flag"],
                                               name="engine_override_node_flag")]

    def __str__(self):
        return f"{self.flag} {self.value} on node #{self.node_id}"
