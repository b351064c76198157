import re
import threading
from decimal import Decimal

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.utils.serializer_helpers import BindingDict

from agent import model_files
from billing.serializers import UsdField
from marketplace import engine_tls
from marketplace.models import Card, EnrolmentToken, Listing, Node, Rental

# --- agent protocol (docs/agent-protocol.md) ---

MAX_HEARTBEAT_BYTES = 256 * 1024


class GpuReportSerializer(serializers.Serializer):
    index = serializers.IntegerField(min_value=0, max_value=63)
    name = serializers.CharField(max_length=128)
    uuid = serializers.CharField(max_length=96, allow_null=True, allow_blank=True,
                                 required=False, default=None)
    memory_total_mib = serializers.IntegerField(min_value=0, max_value=100_000_000,
                                                allow_null=True, required=False, default=None)
    compute_capability = serializers.CharField(max_length=16, allow_null=True, allow_blank=True,
                                               required=False, default=None)
    pcie_gen_current = serializers.IntegerField(min_value=0, max_value=16, allow_null=True,
                                                required=False, default=None)
    pcie_gen_max = serializers.IntegerField(min_value=0, max_value=16, allow_null=True,
                                            required=False, default=None)
    pcie_width_current = serializers.IntegerField(min_value=0, max_value=64, allow_null=True,
                                                  required=False, default=None)
    pcie_width_max = serializers.IntegerField(min_value=0, max_value=64, allow_null=True,
                                              required=False, default=None)
    power_limit_w = serializers.IntegerField(min_value=0, max_value=10_000, allow_null=True,
                                             required=False, default=None)
    # NVLink links up on the GPU: 0 for a card joined by PCIe alone; null or absent where the
    # agent cannot say (or is older than the field).
    nvlink_links = serializers.IntegerField(min_value=0, max_value=64, allow_null=True,
                                            required=False, default=None)
    # Sent while the platform asks for it (the answer's `report_power`): the draw now, in W.
    power_draw_w = serializers.IntegerField(min_value=0, max_value=10_000, allow_null=True,
                                            required=False, default=None)


class HostReportSerializer(serializers.Serializer):
    """The machine around the GPUs (agent/host.py); each fact optional, absent when unknown."""

    cpu_model = serializers.CharField(max_length=256, required=False, allow_blank=True)
    cpu_cores = serializers.IntegerField(min_value=1, max_value=65_535, required=False)
    ram_mib = serializers.IntegerField(min_value=1, max_value=2_000_000_000, required=False)
    disk_free_gb = serializers.IntegerField(min_value=0, max_value=2_000_000_000,
                                            required=False)
    net_link_mbps = serializers.IntegerField(min_value=1, max_value=10_000_000, required=False)


ENGINE_KINDS = ("vllm", "llama.cpp")


# The config.json fields a model's size is read from: the agent sends these alone.
MODEL_CONFIG_KEYS = model_files.CONFIG_KEYS


class ModelConfigField(serializers.DictField):
    """config.json's sizing fields: known keys only, each a number, a boolean, a short string or
    a short list of short strings (`layer_types`)."""

    def to_internal_value(self, data):
        data = super().to_internal_value(data)
        unknown = sorted(set(data) - MODEL_CONFIG_KEYS)
        if unknown:
            raise serializers.ValidationError(f"Unknown config.json field '{unknown[0]}'.")
        for key, value in data.items():
            scalar = (isinstance(value, bool | int | float) and abs(value) < 10**15) or (
                isinstance(value, str) and len(value) < 64 and "\x00" not in value)
            listed = (isinstance(value, list) and len(value) <= 512
                      and all(isinstance(v, str) and len(v) < 64 for v in value))
            if not (scalar or listed):
                raise serializers.ValidationError(f"'{key}' is not a config.json value.")
        return data


class ModelFilesSerializer(serializers.Serializer):
    """What the agent read of the model's own files (docs/agent-protocol.md, `files`)."""

    config = ModelConfigField(required=False, default=dict)
    weights_bytes = serializers.IntegerField(min_value=1, max_value=10**15, required=False,
                                             allow_null=True, default=None)
    params = serializers.IntegerField(min_value=1, max_value=10**15, required=False,
                                      allow_null=True, default=None)
    source = serializers.CharField(max_length=256, required=False, allow_blank=True,
                                   default="")


class ServedModelSerializer(serializers.Serializer):
    """What the agent knows of one model its engine serves; "" or null where nothing said."""

    id = serializers.CharField(max_length=256)
    engine = serializers.ChoiceField(choices=ENGINE_KINDS, allow_blank=True, required=False,
                                     default="")
    max_context = serializers.IntegerField(min_value=1, max_value=10_000_000, allow_null=True,
                                           required=False, default=None)
    quantization = serializers.CharField(max_length=64, allow_blank=True, required=False,
                                         default="")
    # Absent where the agent could read none of the model's files (or is older than them).
    files = ModelFilesSerializer(required=False)


class YardstickReportSerializer(serializers.Serializer):
    """The platform's yardstick the engine serves: the run that asked, the command's version."""

    run = serializers.IntegerField(min_value=1)
    version = serializers.CharField(max_length=64, allow_null=True, required=False,
                                    default=None)


ENGINE_STATES = ("starting", "loading", "ready", "draining", "crashed", "stopped")


class SupervisorReportSerializer(serializers.Serializer):
    """The engine the agent runs as its child (docs/agent-protocol.md, section 4)."""

    state = serializers.ChoiceField(choices=ENGINE_STATES)
    mode = serializers.ChoiceField(choices=("platform", "command"))
    # The model and weights' format the agent was asked to serve with the platform's
    # configuration (`run --serve MODEL --quantization Q`); null for the provider's command.
    model = serializers.CharField(max_length=256, allow_null=True, required=False, default=None)
    quantization = serializers.CharField(max_length=64, allow_null=True, allow_blank=True,
                                         required=False, default=None)
    # As the engine was started, with its key masked: every word as it is, blank ones too.
    argv = serializers.ListField(child=serializers.CharField(
        max_length=1024, allow_blank=True, trim_whitespace=False), max_length=256,
        required=False, default=list)
    config_version = serializers.CharField(max_length=64, allow_null=True, required=False,
                                           default=None)
    pid = serializers.IntegerField(min_value=1, max_value=2**31 - 1, allow_null=True,
                                   required=False, default=None)
    # A signal's number negated (-9: SIGKILL), as Python's subprocess says it.
    exit_code = serializers.IntegerField(min_value=-255, max_value=255, allow_null=True,
                                         required=False, default=None)
    restarts = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False,
                                        default=0)
    log_tail = serializers.ListField(child=serializers.CharField(
        max_length=512, allow_blank=True, trim_whitespace=False), max_length=50,
        required=False, default=list)
    error = serializers.CharField(max_length=256, allow_null=True, allow_blank=True,
                                  required=False, default=None)
    restart_seen = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False,
                                            default=0)
    # The agent makes the engine's TLS key and certificate where the command asks for them
    # (engine_tls.py): the platform's command then carries them. Absent from older agents.
    tls = serializers.BooleanField(required=False, default=False)
    # Serving the platform's yardstick for a verification run (null: the provider's engine).
    yardstick = YardstickReportSerializer(required=False, allow_null=True, default=None)


class EngineReportSerializer(serializers.Serializer):
    url = serializers.CharField(max_length=256, allow_blank=True)
    reachable = serializers.BooleanField()
    models = serializers.ListField(child=serializers.CharField(max_length=256), max_length=256,
                                   required=False, default=list)
    # Absent from agents older than the field: they describe no model.
    served = serializers.ListField(child=ServedModelSerializer(), max_length=256,
                                   required=False, default=list)
    error = serializers.CharField(max_length=256, allow_null=True, allow_blank=True,
                                  required=False, default=None)
    # Absent where the provider runs the engine themselves (and from older agents).
    supervisor = SupervisorReportSerializer(required=False)
    # Engine keys, by fingerprint (marketplace/engine_keys.py): the one the agent holds, and
    # the one its engine runs with (null: none, or not known). Absent from older agents.
    key_held = serializers.RegexField(r"^[0-9a-f]{16}$", allow_null=True, required=False)
    key_fingerprint = serializers.RegexField(r"^[0-9a-f]{16}$", allow_null=True,
                                             required=False, default=None)
    # The certificate the engine presents over TLS, in PEM, as the agent read it on the
    # machine (null: plain HTTP, or not reachable over TLS). Absent from older agents.
    tls_certificate = serializers.CharField(max_length=engine_tls.MAX_PEM_CHARS,
                                            allow_null=True, required=False, default=None,
                                            trim_whitespace=False)

    def validate_tls_certificate(self, pem):
        if pem is None:
            return None
        try:
            return engine_tls.parsed(pem)
        except engine_tls.BadCertificate as exc:
            raise serializers.ValidationError(str(exc)) from None

    def validate_served(self, served):
        ids = [model["id"] for model in served]
        if len(ids) != len(set(ids)):
            raise serializers.ValidationError("Each model id may appear only once.")
        return served

    def validate(self, engine):
        # Routing reads both lists: a description of a model the engine does not list would
        # leave them disagreeing about what the node serves.
        listed = set(engine["models"])
        unlisted = [model["id"] for model in engine["served"] if model["id"] not in listed]
        if unlisted:
            raise serializers.ValidationError(
                {"served": [f"{unlisted[0]!r} is not in models."]})
        return engine


# `engine_versions`: an engine's name ("vllm", "llama-server", "llama-cpp-python") and the
# version the agent read from it ("0.30.1", "0.11.0rc2", "0.9.2.dev123+gabc1234", "6500").
MAX_ENGINE_VERSIONS = 8
_ENGINE_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,31}")
_ENGINE_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}")


class FieldsBuiltOnce:
    """For a serializer that only validates input on a hot path: DRF deep-copies the declared
    field tree, nested serializers included, for every instance (a third of the CPU a full
    heartbeat spent validating its report). Here each thread builds the tree once and reuses
    it: validating keeps no state in the fields (errors and validated data live on the
    instance), and a thread validates one report at a time. The fields stay bound to the
    thread's first instance, so a serializer using this takes no `context` or `partial`."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._built = threading.local()

    @property
    def fields(self):
        built = getattr(self._built, "fields", None)
        if built is None:
            built = BindingDict(self)
            for name, field in self.get_fields().items():
                built[name] = field
            self._built.fields = built
        return built


class HeartbeatSerializer(FieldsBuiltOnce, serializers.Serializer):
    agent_version = serializers.CharField(max_length=64)
    hostname = serializers.CharField(max_length=256, allow_blank=True)
    os = serializers.CharField(max_length=256, allow_blank=True, required=False, default="")
    simulated = serializers.BooleanField(required=False, default=False)
    nvidia = serializers.BooleanField()
    driver_version = serializers.CharField(max_length=64, allow_null=True, allow_blank=True,
                                           required=False, default=None)
    cuda_version = serializers.CharField(max_length=64, allow_null=True, allow_blank=True,
                                         required=False, default=None)
    gpus = serializers.ListField(child=GpuReportSerializer(), max_length=64)
    engine = EngineReportSerializer()
    # Absent from agents older than the field: their nodes show no host facts.
    host = HostReportSerializer(required=False)
    # The engines installed beside the agent (agent/engine_versions.py): {"vllm": "0.30.1"}.
    # Absent from older agents and where none was found: the engine configuration is then
    # computed for the vLLM the platform assumes.
    engine_versions = serializers.DictField(child=serializers.CharField(max_length=64),
                                            required=False, default=dict)

    def validate_gpus(self, gpus):
        indexes = [gpu["index"] for gpu in gpus]
        if len(indexes) != len(set(indexes)):
            raise serializers.ValidationError("Each GPU index may appear only once.")
        return gpus

    def validate_engine_versions(self, versions):
        if len(versions) > MAX_ENGINE_VERSIONS:
            raise serializers.ValidationError(
                f"At most {MAX_ENGINE_VERSIONS} engines, not {len(versions)}.")
        for name, version in versions.items():
            if not _ENGINE_NAME.fullmatch(name):
                raise serializers.ValidationError(
                    f"{name[:40]!r} is not an engine name (lower-case letters, digits, '.', "
                    f"'_' and '-', at most 32).")
            if not _ENGINE_VERSION.fullmatch(version):
                raise serializers.ValidationError(
                    f"{name}: {version[:40]!r} is not a version (letters, digits, '.', '+', "
                    f"'_' and '-', at most 64, e.g. 0.30.1).")
        return versions


class EnrollSerializer(serializers.Serializer):
    token = serializers.CharField(max_length=200)
    hostname = serializers.CharField(max_length=256, allow_blank=True, required=False,
                                     default="")
    agent_version = serializers.CharField(max_length=64, required=False, default="")


class EnrollResponseSerializer(serializers.Serializer):
    node_id = serializers.IntegerField()
    credential = serializers.CharField()
    engine_key = serializers.CharField(help_text=(
        "The engine's key: the agent starts the engine with `--api-key` set to it, and the "
        "platform sends it as `Authorization: Bearer` once the agent reports its engine runs "
        "with it."))
    heartbeat_interval_s = serializers.IntegerField()


class HeartbeatResponseSerializer(serializers.Serializer):
    node_id = serializers.IntegerField()
    status = serializers.CharField()
    needs_review = serializers.BooleanField()
    heartbeat_interval_s = serializers.IntegerField()
    jobs = serializers.ListField(child=serializers.DictField())
    report_power = serializers.BooleanField(help_text=(
        "The platform is measuring this machine: send each GPU's `power_draw_w` in the "
        "heartbeats until an answer says false."))
    engine = serializers.DictField(required=False, help_text=(
        "Only to an agent that runs the engine (`engine.supervisor` in the heartbeat): "
        "`config`, the engine configuration the platform computes for this machine (its "
        "`version`, `argv`, `runnable`, `problems`...; null unless the agent serves a model "
        "with the platform's configuration), `restart`, how many engine restarts the "
        "owner has asked for, and `yardstick`: while a verification run asks for it, `run` and "
        "`config` (the command of the platform's yardstick, which the agent serves instead, "
        "drained, until an answer carries null), else null."))
    engine_key = serializers.DictField(required=False, help_text=(
        "Only while the agent does not hold the node's newest engine key (`engine.key_held`): "
        "`key` and its `fingerprint`. The agent keeps it and restarts the engine with it."))


# --- catalog, rentals, provider resources ---

class HostSerializer(serializers.ModelSerializer):
    """The machine around the GPU, as its agent measured it; null where it could not."""

    cpu_model = serializers.SerializerMethodField()
    cpu_cores = serializers.IntegerField(allow_null=True, help_text="Logical CPUs.")
    ram_mib = serializers.IntegerField(allow_null=True)
    disk_free_gb = serializers.IntegerField(
        allow_null=True, help_text="Free space of the root filesystem, in 10^9 bytes.")
    net_link_mbps = serializers.IntegerField(
        allow_null=True, help_text="The fastest physical network link's speed, in Mb/s.")

    class Meta:
        model = Node
        fields = ["cpu_model", "cpu_cores", "ram_mib", "disk_free_gb", "net_link_mbps"]

    def get_cpu_model(self, node) -> str | None:
        return node.cpu_model or None


class VerifiedCapacitySerializer(serializers.Serializer):
    tokens_per_s = serializers.FloatField(source="verified_tokens_per_s", help_text=(
        "Output tokens/s of this one card: its share of its machine's engine under load (a "
        "machine of 2 cards serving one model in tensor parallel counts half each)."))
    per = serializers.ChoiceField(choices=["card"], help_text="What the figure is for: a card.")
    model = serializers.CharField(source="verified_model", help_text=(
        "The model the engine served during the load test (\"\" if it did not say)."))
    concurrency = serializers.IntegerField(source="verified_concurrency", allow_null=True,
                                           help_text="Concurrent requests it was measured at.")


class ServedSerializer(serializers.Serializer):
    tokens_per_s = serializers.FloatField(source="served_tokens_per_s", help_text=(
        "Decode tokens/s per stream its engine delivered to the platform's traffic in the last "
        "hour (the model it served most), measured by the platform; what `sort=served` orders "
        "by."))
    ttft_p50_ms = serializers.FloatField(source="served_ttft_ms", allow_null=True,
                                         help_text="Median time to first token, same window.")
    models = serializers.SerializerMethodField(help_text=(
        "Every model its engine served in the last day: per window (`hour`, `day`) requests, "
        "errors, error_pct, tokens_per_s, ttft_p50_ms, ttft_p95_ms, uptime_pct and the same "
        "per concurrency band (`bands`)."))

    def get_models(self, card) -> list[dict]:
        return (card.served or {}).get("models", [])


class PlatformPriceSerializer(serializers.Serializer):
    model = serializers.CharField(help_text="The public model name the platform's API sells.")
    output_usd_per_mtok = UsdField(source="output_micros_per_mtok", read_only=True,
                                   help_text="Its price per 1M output tokens now.")


class CatalogCardSerializer(serializers.ModelSerializer):
    gpu_model = serializers.CharField(source="name")
    vram_gb = serializers.IntegerField(source="memory_gb", allow_null=True)
    cards_per_node = serializers.IntegerField()
    price_per_hour_usd = UsdField(source="listing.price_per_hour_micros", read_only=True)
    reliability_pct = serializers.DecimalField(source="node.reliability_pct", max_digits=5,
                                               decimal_places=2)
    region = serializers.CharField(source="node.region")
    node_id = serializers.IntegerField()
    node_name = serializers.CharField(source="node.name")
    verified_capacity = serializers.SerializerMethodField(help_text=(
        "What `sort=capacity` orders by; null until a load test measured it."))
    reference_spec = serializers.CharField(help_text=(
        "The spec the card was judged against; \"\" when the spec table has none for it."))
    bandwidth_measured_gbs = serializers.FloatField(source="bandwidth_gbs", allow_null=True,
                                                    help_text="Memory bandwidth the probes "
                                                    "measured (STREAM triad, best run).")
    bandwidth_spec_gbs = serializers.IntegerField(source="spec_bandwidth_gbs", allow_null=True,
                                                  help_text="The reference spec's figure.")
    host = HostSerializer(source="node", read_only=True)
    cost_per_mtok_usd = UsdField(
        source="listing.cost_per_mtok_micros", read_only=True, allow_null=True, help_text=(
            "$ per 1M output tokens at full use: the price per hour over the card's verified "
            "output tokens/s at its verified concurrency (`verified_capacity`), the tokens of "
            "an hour in which it serves that many requests all the time. What `sort=cost` "
            "orders by; null until a load test measured the card."))
    platform_price = serializers.SerializerMethodField(help_text=(
        "What the platform's own API charges per 1M output tokens for the model the card "
        "was measured with (`verified_capacity.model`), to compare with `cost_per_mtok_usd`; "
        "null when the platform does not sell that model (no platform price)."))
    served = serializers.SerializerMethodField(help_text=(
        "What the platform's own traffic measured on its engine; null without traffic in the "
        "last hour."))

    class Meta:
        model = Card
        fields = ["id", "gpu_model", "vram_gb", "memory_total_mib", "cards_per_node",
                  "price_per_hour_usd", "cost_per_mtok_usd", "platform_price",
                  "reliability_pct", "region", "verification_status",
                  "verified_capacity", "served", "reference_spec", "bandwidth_measured_gbs",
                  "bandwidth_spec_gbs", "node_id", "node_name", "host", "compute_capability",
                  "pcie_gen_current", "pcie_gen_max", "pcie_width_current", "pcie_width_max",
                  "nvlink_links", "power_limit_w"]

    @extend_schema_field(PlatformPriceSerializer(allow_null=True))
    def get_platform_price(self, card) -> dict | None:
        # The view reads the page's prices at once (selectors.platform_prices).
        price = self.context.get("platform_prices", {}).get(card.verified_model)
        return None if price is None else PlatformPriceSerializer(price).data

    @extend_schema_field(ServedSerializer(allow_null=True))
    def get_served(self, card) -> dict | None:
        if card.served_tokens_per_s is None:
            return None
        return ServedSerializer(card).data

    @extend_schema_field(VerifiedCapacitySerializer(allow_null=True))
    def get_verified_capacity(self, card) -> dict | None:
        if card.verified_tokens_per_s is None:
            return None
        return VerifiedCapacitySerializer({
            "verified_tokens_per_s": card.verified_tokens_per_s, "per": "card",
            "verified_model": card.verified_model,
            "verified_concurrency": card.verified_concurrency}).data


class CatalogPageSerializer(serializers.Serializer):
    count = serializers.IntegerField(help_text=(
        "Cards matching the filters: exact up to 1,000, beyond that an estimate."))
    count_is_estimate = serializers.BooleanField()
    next = serializers.URLField(allow_null=True, help_text="The next page, or null.")
    previous = serializers.URLField(allow_null=True, help_text="The page before, or null.")
    results = CatalogCardSerializer(many=True)


class ListingSerializer(serializers.ModelSerializer):
    card_id = serializers.IntegerField(read_only=True)
    price_per_hour_usd = UsdField(source="price_per_hour_micros", min_value=Decimal("0"))

    class Meta:
        model = Listing
        fields = ["card_id", "is_listed", "price_per_hour_usd", "claimed_gpu_model",
                  "claimed_vram_gb", "description", "updated_at"]
        read_only_fields = ["updated_at"]


class ProviderCardSerializer(serializers.ModelSerializer):
    listing = ListingSerializer(read_only=True)

    class Meta:
        model = Card
        fields = ["id", "index", "uuid", "name", "memory_total_mib", "compute_capability",
                  "pcie_gen_current", "pcie_gen_max", "pcie_width_current", "pcie_width_max",
                  "nvlink_links", "power_limit_w", "present", "verification_status", "listing"]
        read_only_fields = fields


class NodeSerializer(serializers.ModelSerializer):
    cards = ProviderCardSerializer(many=True, read_only=True)

    class Meta:
        model = Node
        fields = ["id", "name", "region", "status", "last_heartbeat_at", "reliability_pct",
                  "hostname", "os", "agent_version", "driver_version", "cuda_version",
                  "engine_url", "engine_reachable", "engine_models", "needs_review",
                  "review_reason", "created_at", "credential_revoked_at", "cards"]
        read_only_fields = [f for f in fields if f not in ("name", "region")]


class EnrolmentTokenSerializer(serializers.ModelSerializer):
    state = serializers.SerializerMethodField()

    class Meta:
        model = EnrolmentToken
        fields = ["id", "prefix", "created_at", "expires_at", "used_at", "revoked_at", "node",
                  "state"]
        read_only_fields = fields

    def get_state(self, obj) -> str:
        return obj.state()


class RentalSerializer(serializers.ModelSerializer):
    hours = serializers.IntegerField(write_only=True, required=False, allow_null=True,
                                     min_value=1, max_value=24 * 90)
    accept_flagged = serializers.BooleanField(
        write_only=True, required=False, default=False,
        help_text="Required for a card that verification flagged: you read its findings.")
    card = serializers.IntegerField(source="card_id")
    price_per_hour_usd = UsdField(source="price_per_hour_micros", read_only=True)
    elapsed_seconds = serializers.SerializerMethodField()
    gpu_model = serializers.CharField(source="card.name", read_only=True)
    # "" while the rental runs: declared here, as a read-only model field would lose its blank.
    stop_reason = serializers.ChoiceField(choices=Rental.StopReason.choices, allow_blank=True,
                                          read_only=True)

    class Meta:
        model = Rental
        fields = ["id", "card", "gpu_model", "hours", "accept_flagged", "price_per_hour_usd",
                  "started_at",
                  "ends_at", "stopped_at", "stop_reason", "elapsed_seconds"]
        read_only_fields = ["started_at", "ends_at", "stopped_at"]

    def get_elapsed_seconds(self, obj) -> int:
        return obj.elapsed_seconds()
