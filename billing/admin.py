"""The operators' view of billing. Ledger rows (accounts, transfers, entries) and the records of
money already moved (holds, charges, payments, key spends) are read-only and never deleted;
money moves only through billing's services: the "Grant credit" page, the payout actions and
the key revocation action below."""

from decimal import Decimal

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Sum
from django.db.models.functions import Coalesce
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.http import urlencode

from billing import keys, selectors, services
from billing.forms import GrantCreditForm
from billing.models import (
    Account,
    ApiKey,
    Charge,
    Entry,
    GatewayEvent,
    Hold,
    KeySpend,
    ModelPrice,
    Payment,
    Payout,
    PayoutDestination,
    Transfer,
)
from billing.pricing import format_usd, format_usd_exact, usd_to_micros


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


def _usd_column(field: str, description: str):
    def column(obj):
        value = getattr(obj, field)
        return "" if value is None else format_usd_exact(value)

    column.short_description = description
    column.admin_order_field = field
    return column


# --- the ledger ---

@admin.register(Account)
class AccountAdmin(ReadOnlyAdmin):
    # The sum of the entries: the balance of every kind of account (only wallets and holds
    # also keep it in balance_micros).
    list_display = ("id", "kind", "owner", _usd_column("entries_total", "balance"),
                    "allow_negative", "created_at")
    list_filter = ("kind",)
    search_fields = ("owner__email",)
    list_select_related = ("owner",)
    actions = ["grant_credit"]

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(
            entries_total=Coalesce(Sum("entries__amount_micros"), 0))
    change_list_template = "billing/admin_account_change_list.html"

    def has_grant_permission(self, request):
        return request.user.has_perm("billing.add_transfer")

    def get_urls(self):
        return [path("grant/", self.admin_site.admin_view(self.grant_view),
                     name="billing_account_grant")] + super().get_urls()

    @admin.action(description="Grant credit to the owner of the selected wallet…",
                  permissions=["grant"])
    def grant_credit(self, request, queryset):
        wallets = list(queryset.filter(kind=Account.Kind.WALLET, owner__isnull=False)
                       .select_related("owner")[:2])
        if len(wallets) != 1:
            self.message_user(request, "Select exactly one wallet account.", messages.ERROR)
            return None
        return redirect(reverse("admin:billing_account_grant") + "?"
                        + urlencode({"email": wallets[0].owner.email}))

    def grant_view(self, request):
        """An operator's top-up: `services.credits_grant`, once per rendered form."""
        if not self.has_grant_permission(request):
            raise PermissionDenied
        if request.method == "POST":
            form = GrantCreditForm(request.POST)
            if form.is_valid():
                try:
                    services.credits_grant(
                        user=form.user, amount_micros=form.amount_micros(),
                        idempotency_key=f"grant:admin:{form.cleaned_data['idempotency_key']}",
                        memo=form.cleaned_data["memo"] or f"granted by {request.user.email}")
                except services.BillingError as exc:
                    form.add_error("amount", str(exc))
                else:
                    self.message_user(
                        request, f"Granted {format_usd(form.amount_micros())} to {form.user.email}"
                        f"; their balance is now {format_usd(selectors.user_balances(form.user.pk)[Account.Kind.WALLET])}.",
                        messages.SUCCESS)
                    return redirect(reverse("admin:billing_account_changelist") + "?"
                                    + urlencode({"kind": Account.Kind.WALLET}))
        else:
            form = GrantCreditForm(initial={"email": request.GET.get("email", "")})
        return TemplateResponse(request, "billing/admin_grant_credit.html", {
            **self.admin_site.each_context(request), "opts": self.model._meta, "form": form,
            "title": "Grant credit"})


class EntryInline(admin.TabularInline):
    model = Entry
    fields = ("account", "amount_micros", "amount_usd")
    readonly_fields = fields
    extra = 0
    can_delete = False

    @admin.display(description="amount")
    def amount_usd(self, obj):
        return format_usd_exact(obj.amount_micros)

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("account__owner")

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(Transfer)
class TransferAdmin(ReadOnlyAdmin):
    list_display = ("id", "kind", "reference", "memo", "created_at")
    list_filter = ("kind",)
    search_fields = ("idempotency_key", "reference", "memo")
    date_hierarchy = "created_at"
    inlines = [EntryInline]


@admin.register(Entry)
class EntryAdmin(ReadOnlyAdmin):
    list_display = ("id", "transfer", "account", _usd_column("amount_micros", "amount"))
    list_select_related = ("transfer", "account__owner")
    search_fields = ("transfer__reference", "account__owner__email")
    raw_id_fields = ("transfer", "account")


# --- prices, keys, metering ---

class ModelPriceForm(forms.ModelForm):
    """Operators think in dollars per million tokens; the table keeps micro-dollars."""

    input_usd_per_mtok = forms.DecimalField(label="Input ($ per 1M tokens)", min_value=Decimal("0"),
                                            max_digits=14, decimal_places=6)
    output_usd_per_mtok = forms.DecimalField(label="Output ($ per 1M tokens)", min_value=Decimal("0"),
                                             max_digits=14, decimal_places=6)

    class Meta:
        model = ModelPrice
        fields = ["model", "effective_at"]

    def save(self, commit=True):
        self.instance.input_micros_per_mtok = usd_to_micros(
            self.cleaned_data["input_usd_per_mtok"])
        self.instance.output_micros_per_mtok = usd_to_micros(
            self.cleaned_data["output_usd_per_mtok"])
        return super().save(commit)


@admin.register(ModelPrice)
class ModelPriceAdmin(admin.ModelAdmin):
    """A new price is a new row from its `effective_at` on; a request already holding credit keeps
    the price it started with, so rows are added, never edited or deleted."""

    form = ModelPriceForm
    list_display = ("model", "input_per_mtok", "output_per_mtok", "effective_at")
    search_fields = ("model",)

    @admin.display(description="input per 1M tokens", ordering="input_micros_per_mtok")
    def input_per_mtok(self, obj):
        return format_usd_exact(obj.input_micros_per_mtok)

    @admin.display(description="output per 1M tokens", ordering="output_micros_per_mtok")
    def output_per_mtok(self, obj):
        return format_usd_exact(obj.output_micros_per_mtok)

    def get_fields(self, request, obj=None):
        if obj is None:
            return ["model", "input_usd_per_mtok", "output_usd_per_mtok", "effective_at"]
        return ["model", "input_per_mtok", "output_per_mtok", "effective_at"]

    def get_readonly_fields(self, request, obj=None):
        return [] if obj is None else self.get_fields(request, obj)

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(ApiKey)
class ApiKeyAdmin(ReadOnlyAdmin):
    list_display = ("name", "user", "shown_as", "created_at", "last_used_at", "revoked_at",
                    _usd_column("spend_limit_micros", "spend limit"), "spend_period")
    list_filter = ("spend_period", ("revoked_at", admin.EmptyFieldListFilter))
    search_fields = ("user__email", "name", "prefix")
    list_select_related = ("user",)
    exclude = ("digest",)  # an HMAC, but still nothing an operator needs to see
    actions = ["revoke"]

    @admin.display(description="key")
    def shown_as(self, obj):
        return f"rs_{obj.prefix}_…"

    def has_revoke_permission(self, request):
        return request.user.has_perm("billing.change_apikey")

    @admin.action(description="Revoke the selected keys", permissions=["revoke"])
    def revoke(self, request, queryset):
        # Through the service, so the cached copy of each key goes too.
        done = sum(keys.api_key_revoke(user=row.user, key_id=row.pk)
                   for row in queryset.filter(revoked_at__isnull=True).select_related("user"))
        self.message_user(request, f"{done} key(s) revoked.", messages.SUCCESS)


@admin.register(KeySpend)
class KeySpendAdmin(ReadOnlyAdmin):
    list_display = ("api_key", "period_start", _usd_column("used_micros", "used"))
    list_select_related = ("api_key",)
    search_fields = ("api_key__user__email", "api_key__prefix")


@admin.register(Hold)
class HoldAdmin(ReadOnlyAdmin):
    list_display = ("request_id", "user", "model", _usd_column("amount_micros", "amount"),
                    "status", "created_at", "expires_at", "closed_at")
    list_filter = ("status",)
    search_fields = ("request_id", "user__email", "model")
    list_select_related = ("user",)


@admin.register(Charge)
class ChargeAdmin(ReadOnlyAdmin):
    list_display = ("request_id", "user", "model", "prompt_tokens", "completion_tokens",
                    _usd_column("cost_micros", "cost"), _usd_column("provider_micros", "provider"),
                    _usd_column("fee_micros", "fee"), "estimated", "capped", "created_at")
    list_filter = ("estimated", "capped")
    search_fields = ("request_id", "user__email", "model", "worker")
    list_select_related = ("user",)
    date_hierarchy = "created_at"


# --- money in and out ---

@admin.register(Payment)
class PaymentAdmin(ReadOnlyAdmin):
    list_display = ("id", "user", _usd_column("amount_micros", "amount"), "status",
                    _usd_column("refunded_micros", "refunded"),
                    _usd_column("disputed_micros", "disputed"), "card_last4", "receipt_number",
                    "gateway_ref", "created_at")
    list_filter = ("status", "gateway")
    search_fields = ("user__email", "gateway_ref", "processor_ref", "receipt_number")
    list_select_related = ("user",)


@admin.register(GatewayEvent)
class GatewayEventAdmin(ReadOnlyAdmin):
    """Every processor event handled once: what arrived, when, for which payment."""

    list_display = ("event_id", "gateway", "type", "payment", "received_at")
    list_filter = ("gateway", "type")
    search_fields = ("event_id", "payment__gateway_ref", "payment__processor_ref")
    list_select_related = ("payment",)


@admin.register(Payout)
class PayoutAdmin(ReadOnlyAdmin):
    list_display = ("id", "provider", _usd_column("amount_micros", "amount"), "destination",
                    "status", "requested_at", "held_until", "held_because", "decided_at",
                    "decided_by")
    list_filter = ("status",)
    search_fields = ("provider__email",)
    list_select_related = ("provider", "decided_by")
    actions = ["approve_and_pay", "reject"]

    def has_decide_permission(self, request):
        return request.user.has_perm("billing.change_payout")

    def _decide(self, request, queryset, *, approve: bool):
        done = 0
        for payout_id in queryset.filter(status=Payout.Status.REQUESTED).values_list(
                "pk", flat=True):
            try:
                services.payout_decide(payout_id=payout_id, operator=request.user,
                                       approve=approve)
            except services.BillingError as exc:
                self.message_user(request, f"Payout #{payout_id}: {exc}", messages.ERROR)
            else:
                done += 1
        verb = "paid" if approve else "rejected"
        self.message_user(request, f"{done} payout(s) {verb}.", messages.SUCCESS)

    @admin.action(description="Approve and pay", permissions=["decide"])
    def approve_and_pay(self, request, queryset):
        self._decide(request, queryset, approve=True)

    @admin.action(description="Reject", permissions=["decide"])
    def reject(self, request, queryset):
        self._decide(request, queryset, approve=False)



@admin.register(PayoutDestination)
class PayoutDestinationAdmin(ReadOnlyAdmin):
    """Set by providers only: a payout copies it when requested (Payout.destination)."""

    list_display = ("provider", "method", "holder_name", "updated_at")
    search_fields = ("provider__email", "holder_name")
    list_select_related = ("provider",)
