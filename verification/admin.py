from django.contrib import admin, messages

from billing.admin import ReadOnlyAdmin
from verification import services
from verification.models import (
    Finding,
    GpuSpec,
    Measurement,
    ProbeJob,
    ServedDrift,
    VerificationRun,
    VerifiedCapacity,
)


@admin.register(GpuSpec)
class GpuSpecAdmin(admin.ModelAdmin):
    list_display = ("name", "memory_gb", "bandwidth_gbs", "bf16_tflops", "l2_mb", "power_w",
                    "pcie_gen", "compute_capability", "bus_width_bits", "sm_count")
    search_fields = ("name",)


class FindingInline(admin.TabularInline):
    model = Finding
    extra = 0
    can_delete = False
    readonly_fields = ("card", "severity", "metric", "claimed", "expected", "measured",
                       "message")


@admin.register(VerificationRun)
class VerificationRunAdmin(admin.ModelAdmin):
    list_display = ("pk", "node", "trigger", "status", "progress_pct", "created_at",
                    "finished_at")
    list_filter = ("status", "trigger")
    list_select_related = ("node",)
    readonly_fields = ("node", "trigger", "status", "step_detail", "progress_pct", "created_at",
                       "updated_at", "finished_at", "error", "model")
    inlines = [FindingInline]
    actions = ["verify_again"]

    @admin.action(description="Verify these nodes again now")
    def verify_again(self, request, queryset):
        for node_id in set(queryset.values_list("node_id", flat=True)):
            services.run_start(node_id=node_id, trigger=VerificationRun.Trigger.OPERATOR)
        self.message_user(request, "Verification started.", messages.SUCCESS)


@admin.register(ProbeJob)
class ProbeJobAdmin(admin.ModelAdmin):
    list_display = ("pk", "node", "kind", "status", "created_at", "answered_at")
    list_filter = ("status", "kind")
    readonly_fields = ("run", "node", "kind", "params", "status", "result", "error",
                       "created_at", "answered_at")


@admin.register(Measurement)
class MeasurementAdmin(ReadOnlyAdmin):
    list_display = ("run", "card", "metric", "value", "unit")
    list_filter = ("metric",)
    list_select_related = ("run", "card")


@admin.register(Finding)
class FindingAdmin(ReadOnlyAdmin):
    list_display = ("run", "card", "severity", "metric", "message")
    list_filter = ("severity", "metric")
    list_select_related = ("run", "card")


@admin.register(VerifiedCapacity)
class VerifiedCapacityAdmin(ReadOnlyAdmin):
    list_display = ("card", "model", "tokens_per_s", "concurrency", "measured_at")
    list_select_related = ("card",)


@admin.register(ServedDrift)
class ServedDriftAdmin(ReadOnlyAdmin):
    list_display = ("opened_at", "node", "model", "band_label", "served_tps", "verified_tps",
                    "streams", "outcome", "run", "closed_at")
    list_filter = ("outcome",)
    list_select_related = ("node", "run")
