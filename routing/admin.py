from django.contrib import admin
from django.utils import timezone
from django.utils.html import format_html

from billing.admin import ReadOnlyAdmin
from billing.models import ModelPrice
from billing.pricing import format_usd_exact
from routing.models import (
    Deployment,
    EngineModel,
    Model,
    RequestLog,
    TrafficBucket,
    UnannouncedCheck,
)


class EngineModelInline(admin.TabularInline):
    """The engine ids that serve this public model (one name spans several engines)."""

    model = EngineModel
    extra = 1


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    list_display = ("name", "context_length", "is_active", "price_now", "deployments")
    list_filter = ("is_active",)
    search_fields = ("name", "engine_models__engine_model_id")
    inlines = [EngineModelInline]

    @admin.display(description="price now (in / out per 1M tokens)")
    def price_now(self, obj):
        # Prices are billing.ModelPrice rows under the model's name, added there.
        row = (ModelPrice.objects.filter(model=obj.name, effective_at__lte=timezone.now())
               .order_by("-effective_at").first())
        if row is None:
            return format_html('<a href="{}?model={}">none: add one</a>',
                               "/admin/billing/modelprice/add/", obj.name)
        return f"{format_usd_exact(row.input_micros_per_mtok)} / {format_usd_exact(row.output_micros_per_mtok)}"

    @admin.display(description="deployments reporting it")
    def deployments(self, obj):
        ids = [obj.name, *obj.engine_models.values_list("engine_model_id", flat=True)]
        return Deployment.objects.filter(engine_model_id__in=ids, reported=True).count()


@admin.register(EngineModel)
class EngineModelAdmin(admin.ModelAdmin):
    list_display = ("engine_model_id", "model")
    search_fields = ("engine_model_id", "model__name")
    autocomplete_fields = ("model",)


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    """Written by the agents' heartbeats and the health checks; the operator only maps engine
    ids to public models (Engine models)."""

    list_display = ("id", "node", "engine_model_id", "public_model", "engine", "max_context",
                    "quantization", "reported", "healthy", "health_checked_at")
    list_filter = ("engine", "reported", "healthy")
    search_fields = ("engine_model_id", "node__name", "node__hostname")
    list_select_related = ("node",)

    @admin.display(description="public model")
    def public_model(self, obj):
        mapped = EngineModel.objects.filter(engine_model_id=obj.engine_model_id).first()
        if mapped:
            return mapped.model.name
        if Model.objects.filter(name=obj.engine_model_id).exists():
            return obj.engine_model_id
        return format_html('<a href="{}?engine_model_id={}">not mapped: map it</a>',
                           "/admin/routing/enginemodel/add/", obj.engine_model_id)

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(RequestLog)
class RequestLogAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "request_id", "endpoint", "model", "deployment_id", "stream",
                    "status", "error_code", "prompt_tokens", "completion_tokens", "estimated",
                    "ttft_ms", "latency_ms", "concurrency")
    list_filter = ("status", "endpoint", "stream", "estimated")
    search_fields = ("request_id", "model", "error_code")
    date_hierarchy = "created_at"


@admin.register(TrafficBucket)
class TrafficBucketAdmin(ReadOnlyAdmin):
    list_display = ("start", "span_s", "deployment_id", "band", "requests", "errors", "streams",
                    "decode_tokens", "decode_ms")
    list_filter = ("span_s", "band")
    date_hierarchy = "start"


@admin.register(UnannouncedCheck)
class UnannouncedCheckAdmin(ReadOnlyAdmin):
    list_display = ("at", "node", "deployment_id", "model", "requests", "errors", "concurrency",
                    "tokens_per_s", "ttft_ms")
    list_select_related = ("node",)
    date_hierarchy = "at"
