from decimal import Decimal

from rest_framework import serializers

from billing.models import ApiKey
from billing.pricing import micros_to_usd, usd_to_micros

MAX_SPEND_LIMIT_MICROS = 1_000_000 * 1_000_000


class UsdField(serializers.DecimalField):
    """Dollars as a decimal string in the API, integer micros in the database."""

    def __init__(self, **kwargs):
        super().__init__(max_digits=14, decimal_places=6, coerce_to_string=True, **kwargs)

    def to_representation(self, value):
        return super().to_representation(micros_to_usd(value))

    def to_internal_value(self, data):
        return usd_to_micros(super().to_internal_value(data))


class ApiKeySerializer(serializers.ModelSerializer):
    """A key's name and limits. The secret itself appears once, in the create response."""

    display = serializers.SerializerMethodField()
    spend_limit_usd = UsdField(source="spend_limit_micros", required=False, allow_null=True,
                               min_value=Decimal("0"))
    allowed_models = serializers.ListField(
        child=serializers.CharField(max_length=200), max_length=100, required=False)
    requests_per_minute = serializers.IntegerField(required=False, allow_null=True, min_value=1,
                                                   max_value=1_000_000)
    tokens_per_minute = serializers.IntegerField(required=False, allow_null=True, min_value=1,
                                                 max_value=1_000_000_000)

    class Meta:
        model = ApiKey
        fields = ["id", "name", "display", "prefix", "created_at", "last_used_at", "revoked_at",
                  "spend_limit_usd", "spend_period", "allowed_models", "requests_per_minute",
                  "tokens_per_minute"]
        read_only_fields = ["id", "prefix", "created_at", "last_used_at", "revoked_at"]

    def get_display(self, row) -> str:
        return f"rs_{row.prefix}_…"

    def validate_spend_limit_usd(self, micros):
        # Validators see micros (UsdField converts first), so the ceiling is checked here.
        if micros is not None and micros > MAX_SPEND_LIMIT_MICROS:
            raise serializers.ValidationError("At most $1,000,000.")
        return micros

    def validate_allowed_models(self, names):
        return list(dict.fromkeys(n.strip() for n in names if n.strip()))
