from decimal import Decimal

from rest_framework import serializers

from billing.pricing import micros_to_usd, usd_to_micros
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


ENGINE_KINDS = ("vllm", "llama.cpp")


class ServedModelSerializer(serializers.Serializer):
    """What the agent knows of one model its engine serves; "" or null where nothing said."""

    id = serializers.CharField(max_length=256)
    engine = serializers.ChoiceField(choices=ENGINE_KINDS, allow_blank=True, required=False,
                                     default="")
    max_context = serializers.IntegerField(min_value=1, max_value=10_000_000, allow_null=True,
                                           required=False, default=None)
    quantization = serializers.CharField(max_length=64, allow_blank=True, required=False,
                                         default="")


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


class HeartbeatSerializer(serializers.Serializer):
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

    def validate_gpus(self, gpus):
        indexes = [gpu["index"] for gpu in gpus]
        if len(indexes) != len(set(indexes)):
            raise serializers.ValidationError("Each GPU index may appear only once.")
        return gpus


class EnrollSerializer(serializers.Serializer):
    token = serializers.CharField(max_length=200)
    hostname = serializers.CharField(max_length=256, allow_blank=True, required=False,
                                     default="")
    agent_version = serializers.CharField(max_length=64, required=False, default="")


class EnrollResponseSerializer(serializers.Serializer):
    node_id = serializers.IntegerField()
    credential = serializers.CharField()
    heartbeat_interval_s = serializers.IntegerField()


class HeartbeatResponseSerializer(serializers.Serializer):
    node_id = serializers.IntegerField()
    status = serializers.CharField()
    needs_review = serializers.BooleanField()
    heartbeat_interval_s = serializers.IntegerField()
    jobs = serializers.ListField(child=serializers.DictField())


# --- catalog, rentals, provider resources ---

class UsdField(serializers.DecimalField):
    """Dollars as a decimal string in the API, integer micros in the database."""

    def __init__(self, **kwargs):
        super().__init__(max_digits=14, decimal_places=6, coerce_to_string=True, **kwargs)

    def to_representation(self, value):
        return super().to_representation(micros_to_usd(value))

    def to_internal_value(self, data):
        return usd_to_micros(super().to_internal_value(data))


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

    class Meta:
        model = Card
        fields = ["id", "gpu_model", "vram_gb", "memory_total_mib", "cards_per_node",
                  "price_per_hour_usd", "reliability_pct", "region", "verification_status",
                  "node_id", "node_name", "compute_capability", "pcie_gen_current",
                  "pcie_gen_max", "pcie_width_current", "pcie_width_max", "power_limit_w"]


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
                  "power_limit_w", "present", "verification_status", "listing"]
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
    card = serializers.IntegerField(source="card_id")
    price_per_hour_usd = UsdField(source="price_per_hour_micros", read_only=True)
    elapsed_seconds = serializers.SerializerMethodField()
    gpu_model = serializers.CharField(source="card.name", read_only=True)
    # "" while the rental runs: declared here, as a read-only model field would lose its blank.
    stop_reason = serializers.ChoiceField(choices=Rental.StopReason.choices, allow_blank=True,
                                          read_only=True)

    class Meta:
        model = Rental
        fields = ["id", "card", "gpu_model", "hours", "price_per_hour_usd", "started_at",
                  "ends_at", "stopped_at", "stop_reason", "elapsed_seconds"]
        read_only_fields = ["started_at", "ends_at", "stopped_at"]

    def get_elapsed_seconds(self, obj) -> int:
        return obj.elapsed_seconds()
