from django import forms
from django.contrib import admin

from billing.admin import ReadOnlyAdmin
from marketplace import engine_config, selectors, services
from marketplace.models import (
    Card,
    EngineOverride,
    EnrolmentToken,
    Listing,
    Node,
    NodeStatusChange,
    NodeUptimeHour,
    ProviderAlert,
    Rental,
    UuidConflict,
)

# Hardware facts are the agent's word: operators read them here but do not edit them.
_CARD_FACTS = ("uuid", "name", "memory_total_mib", "compute_capability", "pcie_gen_current",
               "pcie_gen_max", "pcie_width_current", "pcie_width_max", "nvlink_links",
               "power_limit_w", "present", "first_seen_at", "last_seen_at")


class CardInline(admin.TabularInline):
    model = Card
    extra = 0
    can_delete = False
    fields = ("index",) + _CARD_FACTS[:4] + ("verification_status",)
    readonly_fields = fields
    show_change_link = True

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    """Nodes come from enrolment and heartbeats: staff may hold one for review, rename it or
    delete it, never add one."""

    list_display = ("name", "owner", "status", "last_heartbeat_at", "reliability_pct", "region",
                    "needs_review", "uuid_conflict", "simulated")
    list_filter = ("status", "needs_review", "uuid_conflict", "simulated", "region")
    search_fields = ("name", "hostname", "owner__email", "cards__uuid")
    list_select_related = ("owner",)
    readonly_fields = ("credential_prefix", "credential_digest", "hostname", "os",
                       "agent_version", "driver_version", "cuda_version", "has_nvidia",
                       "simulated", "engine_url", "engine_reachable", "engine_models",
                       "engine_error", "hardware_changed_at", "status", "status_changed_at",
                       "last_heartbeat_at", "reliability_pct", "created_at", "uuid_conflict",
                       "engine_state", "engine_state_since", "engine_process",
                       "engine_ready_digest", "engine_restarts_requested",
                       "engine_restart_requested_at", "engine_key_fingerprint",
                       "engine_key_enforced")
    # The sealed engine keys are nobody's to read or type: a rotation issues a new one.
    exclude = ("engine_key_sealed", "engine_key_next")
    inlines = [CardInline]
    actions = ["rotate_engine_keys"]

    @admin.action(description="Rotate the engine key (the agent restarts the engine with it)")
    def rotate_engine_keys(self, request, queryset):
        rotated = sum(services.node_engine_key_rotate(node_id=pk)
                      for pk in queryset.values_list("pk", flat=True))
        self.message_user(request, f"New engine key issued to {rotated} machine(s); each "
                                   "agent drains its engine and restarts it with the key.")

    def has_add_permission(self, request):
        return False

    # A hold put or lifted, or a node deleted, changes what its agent's next heartbeat is told.
    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        if change and "needs_review" in form.changed_data:
            services.node_heartbeat_forget(node_ids=[obj.pk])

    def delete_model(self, request, obj):
        services.node_heartbeat_forget(node_ids=[obj.pk])
        super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        services.node_heartbeat_forget(node_ids=list(queryset.values_list("pk", flat=True)))
        super().delete_queryset(request, queryset)


@admin.register(UuidConflict)
class UuidConflictAdmin(admin.ModelAdmin):
    """Where staff see every GPU UUID reported by two machines: open ones first. The heartbeats
    open and close them; staff read, and act on the nodes if a conflict lasts."""

    list_display = ("uuid", "node", "incumbent", "opened_at", "closed_at", "closed_because")
    list_filter = (("closed_at", admin.EmptyFieldListFilter),)
    search_fields = ("uuid", "node__name", "incumbent__name")
    list_select_related = ("node", "incumbent")
    readonly_fields = ("uuid", "node", "incumbent", "opened_at", "closed_at", "closed_because")

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Card)
class CardAdmin(ReadOnlyAdmin):
    """Cards come from heartbeats and their verdicts from runs: staff read them here. A card
    to be kept out is held through its node (Needs review)."""

    list_display = ("__str__", "uuid", "memory_total_mib", "present", "verification_status")
    list_filter = ("name", "present", "verification_status")
    search_fields = ("uuid", "name", "node__name")
    list_select_related = ("node",)
    readonly_fields = ("node", "index") + _CARD_FACTS


@admin.register(Listing)
class ListingAdmin(admin.ModelAdmin):
    list_display = ("card", "is_listed", "price_per_hour_micros", "updated_at")
    list_filter = ("is_listed",)
    list_select_related = ("card", "card__node")
    search_fields = ("card__name", "card__node__name")
    raw_id_fields = ("card",)
    readonly_fields = ("cost_per_mtok_micros",)  # follows the price and the verified tok/s

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        services.listing_costs_refresh(card_ids=[obj.card_id])


@admin.register(Rental)
class RentalAdmin(admin.ModelAdmin):
    list_display = ("pk", "card", "renter", "started_at", "ends_at", "stopped_at",
                    "stop_reason")
    list_filter = ("stop_reason",)
    list_select_related = ("card", "card__node", "renter")
    search_fields = ("renter__email", "card__name")
    raw_id_fields = ("card", "renter")


@admin.register(EnrolmentToken)
class EnrolmentTokenAdmin(admin.ModelAdmin):
    list_display = ("prefix", "owner", "created_at", "expires_at", "used_at", "revoked_at")
    search_fields = ("prefix", "owner__email")
    readonly_fields = ("prefix", "digest", "created_at", "used_at", "node")
    list_select_related = ("owner",)


@admin.register(NodeStatusChange)
class NodeStatusChangeAdmin(ReadOnlyAdmin):
    list_display = ("node", "status", "at")
    list_filter = ("status",)
    list_select_related = ("node",)


@admin.register(NodeUptimeHour)
class NodeUptimeHourAdmin(ReadOnlyAdmin):
    list_display = ("node", "hour", "heartbeats")
    list_select_related = ("node",)


@admin.register(ProviderAlert)
class ProviderAlertAdmin(ReadOnlyAdmin):
    """Raised by the offline sweep, heartbeats and verdicts (marketplace/alerts.py)."""

    list_display = ("created_at", "owner", "kind", "node", "card", "read_at", "emailed_at")
    list_filter = ("kind",)
    search_fields = ("owner__email", "node__name")
    list_select_related = ("owner", "node", "card")


class EngineOverrideAdminForm(forms.ModelForm):
    """The same check as the machine page's form: a known flag, a value in range, and one the
    node can still serve the model with."""

    class Meta:
        model = EngineOverride
        fields = ("node", "flag", "value", "reason")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "flag" in self.fields:  # read-only once the row exists
            self.fields["flag"] = forms.ChoiceField(
                choices=[(flag, flag) for flag in engine_config.override_flags()])

    def clean(self):
        cleaned = super().clean()
        existing = self.instance if self.instance.pk else None
        node = cleaned.get("node") or (existing.node if existing else None)
        flag = cleaned.get("flag") or (existing.flag if existing else None)
        value = cleaned.get("value")
        if not node or not flag or value is None:
            return cleaned
        engine = selectors.node_engine(node)
        if not engine.inputs:
            raise forms.ValidationError("The node's engine reports no model yet.")
        others = {k: v for k, v in engine.override_map().items() if k != flag}
        try:
            engine_config.check_override(flag=flag, value=value, overrides=others,
                                         **engine.inputs)
        except engine_config.OverrideError as exc:
            self.add_error("value", str(exc))
        return cleaned


@admin.register(EngineOverride)
class EngineOverrideAdmin(admin.ModelAdmin):
    """Staff set a node's engine flag here (its owner does on the machine page); saved and
    deleted through the services, so the node's agent hears of it."""

    form = EngineOverrideAdminForm
    list_display = ("node", "flag", "value", "reason", "set_by", "set_at")
    list_filter = ("flag",)
    search_fields = ("node__name", "flag", "reason")
    list_select_related = ("node", "set_by")
    raw_id_fields = ("node",)
    readonly_fields = ("set_by", "set_at")

    def get_readonly_fields(self, request, obj=None):
        # A row is one flag of one node: another flag is another row.
        return self.readonly_fields + (("node", "flag") if obj else ())

    def save_model(self, request, obj, form, change):
        row = services.engine_override_set(node_id=obj.node_id, flag=obj.flag, value=obj.value,
                                           reason=obj.reason, set_by=request.user)
        obj.pk, obj.value, obj.set_by, obj.set_at = row.pk, row.value, row.set_by, row.set_at

    def delete_model(self, request, obj):
        services.engine_override_clear(node_id=obj.node_id, flag=obj.flag)

    def delete_queryset(self, request, queryset):
        for row in list(queryset):
            services.engine_override_clear(node_id=row.node_id, flag=row.flag)
