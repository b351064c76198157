"""Billing pages. Every page needs a login and shows only its user's own money, payments and
keys: anything else answers 404, as if it did not exist. Money moves only through services."""

import csv
from datetime import UTC, datetime, time

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from accounts import security
from billing import charts, keys, metering, payout_holds, selectors, services
from billing.forms import ApiKeyForm, PayoutDestinationForm, PayoutRequestForm, TopUpForm
from billing.gateway import (
    DECLINES,
    REQUIRES_CONFIRMATION,
    SUCCEEDS,
    GatewayError,
    TestCardGateway,
    get_gateway,
)
from billing.models import Account, ApiKey, Payment, PayoutDestination
from billing.pricing import format_usd, format_usd_exact, micros_to_usd
from config.spreadsheet import text_cell

TRANSACTIONS_PAGE_SIZE = 50
RECENT_TRANSACTIONS = 10
USAGE_DAYS = {7, 30, 90}


def _topup_key(user, form_key: str) -> str:
    # The user's id in the key: one person's form key can never name another's payment.
    return f"topup:{user.pk}:{form_key}"


@login_required
def overview(request):
    gateway = get_gateway()
    form = TopUpForm(request.POST or None, collects_card=gateway.collects_card)
    if request.method == "POST" and form.is_valid():
        key = _topup_key(request.user, form.cleaned_data["idempotency_key"])
        replay = Payment.objects.filter(idempotency_key=key, user=request.user).exists()
        try:
            payment = services.payment_create(
                user=request.user, amount_micros=form.amount_micros(),
                card_number=form.cleaned_data.get("card_number", ""), idempotency_key=key,
                return_url=request.build_absolute_uri(reverse("billing:overview")))
        except (services.BillingError, security.NeedsStrongerAccount) as exc:
            form.add_error("amount", str(exc))
        else:
            if payment.user_id != request.user.pk:
                raise Http404("No such payment.")
            if payment.status == Payment.Status.DECLINED:
                form.add_error("card_number" if gateway.collects_card else "amount",
                               payment.decline_reason or "The card was declined.")
            elif payment.status == Payment.Status.REQUIRES_CONFIRMATION:
                return redirect(_finish_url(payment))
            elif replay:
                messages.info(request, "This form was already submitted: you were charged once.")
                return redirect("billing:receipt", payment_id=payment.pk)
            else:
                messages.success(request, f"{format_usd(payment.amount_micros)} added to your "
                                          "balance.")
                return redirect("billing:receipt", payment_id=payment.pk)
    if form.is_bound:
        # A failed attempt is spent: the next try is a new payment, with a new key. The card
        # number is never sent back to the browser.
        data = form.data.copy()
        data["idempotency_key"] = TopUpForm().initial["idempotency_key"]
        data["card_number"] = ""
        form.data = data
    payments = selectors.payments_of(request.user.pk)[:5]
    for payment in payments:
        payment.finish_url = _finish_url(payment)
    return render(request, "billing/overview.html", {
        "form": form, "balances": selectors.user_balances(request.user.pk),
        "lines": selectors.user_statement(request.user.pk, limit=RECENT_TRANSACTIONS),
        "payments": payments,
        "test_cards": [(SUCCEEDS, "succeeds"), (DECLINES, "is declined"),
                       (REQUIRES_CONFIRMATION, "asks you to confirm the payment first")]
        if gateway.collects_card else [],
    })


def _finish_url(payment: Payment) -> str:
    """Where the payer finishes a payment that awaits them: the processor's page, or the test
    gateway's confirmation step."""
    if payment.checkout_url:
        return payment.checkout_url
    return reverse("billing:test_gateway", kwargs={"gateway_ref": payment.gateway_ref})


@login_required
def test_gateway(request, gateway_ref: str):
    """The test gateway's stand-in for a bank's confirmation step (3-D Secure)."""
    gateway = get_gateway()
    if not isinstance(gateway, TestCardGateway):
        raise Http404("No such page.")
    payment = get_object_or_404(Payment, gateway_ref=gateway_ref, user=request.user,
                                gateway=gateway.name)
    if request.method == "POST":
        if payment.status == Payment.Status.REQUIRES_CONFIRMATION:
            event = gateway.confirm(gateway_ref=payment.gateway_ref)
            try:
                # The same path as the processor's webhook: one way for a payment to succeed.
                services.webhook_handle(body=event["body"], headers=event["headers"])
            except services.BillingError as exc:
                messages.error(request, str(exc))
                return redirect("billing:overview")
            messages.success(request, f"Payment confirmed: {format_usd(payment.amount_micros)} "
                                      "added to your balance.")
        return redirect("billing:receipt", payment_id=payment.pk)
    return render(request, "billing/test_gateway.html", {"payment": payment})


@csrf_exempt
@require_POST
def payment_webhook(request):
    """The processor's signed events. Each event id is handled once, so the processor may
    deliver as often as it likes."""
    try:
        payment = services.webhook_handle(body=request.body, headers=request.headers)
    except GatewayError as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    except Payment.DoesNotExist:
        return JsonResponse({"error": "unknown payment"}, status=400)
    except services.BillingError as exc:
        return JsonResponse({"error": str(exc)}, status=409)
    if payment is None:
        return JsonResponse({"status": "ignored"})
    return JsonResponse({"status": payment.status, "gateway_ref": payment.gateway_ref})


@login_required
def receipt(request, payment_id: int):
    payment = get_object_or_404(Payment, pk=payment_id, user=request.user)
    return render(request, "billing/receipt.html", {"payment": payment})


# --- the ledger, as the user sees it ---

@login_required
def transactions(request):
    before = request.GET.get("before", "")
    lines = selectors.user_statement(request.user.pk, limit=TRANSACTIONS_PAGE_SIZE + 1,
                                     before=before)
    more = len(lines) > TRANSACTIONS_PAGE_SIZE
    lines = lines[:TRANSACTIONS_PAGE_SIZE]
    return render(request, "billing/transactions.html", {
        "lines": lines, "newest": not before,
        "older": lines[-1].cursor if more else ""})


def _csv_response(filename: str, header: list[str], rows) -> HttpResponse:
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    writer = csv.writer(response)
    writer.writerow(header)
    writer.writerows(rows)
    return response


def _entry_rows(entries):
    for e in entries.iterator(chunk_size=2000):
        yield [e.transfer.created_at.isoformat(), e.account.kind, e.transfer.kind,
               text_cell(e.transfer.reference), text_cell(e.transfer.memo),
               micros_to_usd(e.amount_micros), micros_to_usd(e.balance_after_micros)]


ENTRY_HEADER = ["date_utc", "account", "kind", "reference", "memo", "amount_usd",
                "balance_after_usd"]


@login_required
@require_GET
def transactions_csv(request):
    return _csv_response(f"rigshare-transactions-{timezone.now():%Y%m%d}.csv", ENTRY_HEADER,
                         _entry_rows(selectors.user_entries(request.user.pk)))


# --- API keys ---

@login_required
@security.recent_proof_required
def api_keys(request):
    form = ApiKeyForm(request.POST or None)
    new_key = new_token = None
    if request.method == "POST" and form.is_valid():
        try:
            new_key, new_token = keys.api_key_create(user=request.user, **form.key_fields())
        except security.NeedsStrongerAccount as exc:
            form.add_error("spend_limit", str(exc))
        else:
            form = ApiKeyForm()
    rows = list(selectors.api_keys_of(request.user.pk))
    now = timezone.now()
    for row in rows:
        current = metering.period_start(row.spend_period, now)
        row.spent_this_period_micros = (row.spend_used_micros or 0) \
            if row.spend_period_start == current else 0
    # The token exists only in this response: a reload cannot show it again.
    return render(request, "billing/api_keys.html", {
        "form": form, "keys": rows, "new_key": new_key, "new_token": new_token,
        "unlimited_problem": security.strong_account_problem(request.user,
                                                             keys.UNLIMITED_ACTION),
        "spend_without_2fa": format_usd(settings.RIGSHARE_KEY_SPEND_WITHOUT_2FA_MICROS),
    })


@login_required
@security.recent_proof_required
def api_key_edit(request, key_id: int):
    key = get_object_or_404(ApiKey, pk=key_id, user=request.user, revoked_at__isnull=True)
    form = ApiKeyForm(request.POST or None, initial=ApiKeyForm.initial_for(key))
    if request.method == "POST" and form.is_valid():
        try:
            keys.api_key_update(user=request.user, key_id=key.pk, **form.key_fields())
        except security.NeedsStrongerAccount as exc:
            form.add_error("spend_limit", str(exc))
            return render(request, "billing/api_key_edit.html", {"key": key, "form": form})
        messages.success(request, f"Key “{form.cleaned_data['name']}” updated.")
        return redirect("billing:api_keys")
    return render(request, "billing/api_key_edit.html", {"key": key, "form": form})


@login_required
@require_POST
def api_key_revoke(request, key_id: int):
    if not keys.api_key_revoke(user=request.user, key_id=key_id):
        raise Http404("No such active key.")
    messages.success(request, "Key revoked: requests with it are refused from now on.")
    return redirect("billing:api_keys")


# --- usage ---

@login_required
@require_GET
def usage(request):
    key = None
    if request.GET.get("key"):
        try:
            key_id = int(request.GET["key"])
        except ValueError:
            raise Http404("No such key.") from None
        key = get_object_or_404(ApiKey, pk=key_id, user=request.user)
    try:
        days = int(request.GET.get("days", 30))
    except ValueError:
        days = 30
    days = days if days in USAGE_DAYS else 30
    today = timezone.now().date()
    span = charts.days_ending(today, days)
    since = datetime.combine(span[0], time.min, tzinfo=UTC)
    rows = list(selectors.usage_by_day_and_model(request.user.pk, since=since,
                                                 api_key_id=key.pk if key else None))
    cost_by_day: dict = {}
    for row in rows:  # per (day, model) group, not per request
        cost_by_day[row["day"]] = cost_by_day.get(row["day"], 0) + row["cost_micros"]
    totals = {name: sum(r[name] for r in rows)
              for name in ("requests", "prompt_tokens", "completion_tokens", "cost_micros")}
    return render(request, "billing/usage.html", {
        "rows": rows, "totals": totals, "key": key, "days": days, "day_choices": sorted(USAGE_DAYS),
        "keys": selectors.api_keys_of(request.user.pk),
        "chart": charts.cost_per_day_chart(span, cost_by_day, fmt=format_usd_exact),
    })


# --- provider payouts ---

@login_required
@security.recent_proof_required
def payouts(request):
    form = PayoutRequestForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            payout = services.payout_request(provider=request.user,
                                             amount_micros=form.amount_micros())
        except (services.BillingError, security.NeedsStrongerAccount) as exc:
            form.add_error("amount", str(exc))
        else:
            messages.success(request, f"Payout of {format_usd(payout.amount_micros)} requested: "
                                      "an operator will review it.")
            return redirect("billing:payouts")
    earnings = selectors.user_balances(request.user.pk)[Account.Kind.EARNINGS]
    pending = selectors.pending_payouts_micros(request.user.pk)
    card = payout_holds.card_credit_held(request.user.pk)
    return render(request, "billing/payouts.html", {
        "destination": PayoutDestination.objects.filter(provider=request.user).first(),
        "form": form, "earnings_micros": earnings, "pending_micros": pending,
        "card_hold": card, "wait": payout_holds.payout_wait(request.user),
        "dispute_window_days": settings.RIGSHARE_CARD_DISPUTE_WINDOW_DAYS,
        "available_micros": max(earnings - pending - card.amount_micros, 0),
        "min_payout_micros": settings.RIGSHARE_MIN_PAYOUT_MICROS,
        "payouts": selectors.payouts_of(request.user.pk)[:100],
        "account_problem": security.strong_account_problem(request.user, "request a payout"),
    })


@login_required
@security.strong_account_required("change where payouts go")
@security.recent_proof_required
def payout_destination(request):
    current = PayoutDestination.objects.filter(provider=request.user).first()
    initial = {} if current is None else {
        "method": current.method, "holder_name": current.holder_name, "bic": current.bic,
        "paypal_email": current.paypal_email}  # the full IBAN is not sent back
    form = PayoutDestinationForm(request.POST or None, initial=initial)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            destination = services.payout_destination_set(
                provider=request.user, method=data["method"], holder_name=data["holder_name"],
                iban=data["iban"], bic=data["bic"], paypal_email=data["paypal_email"])
        except services.InvalidDestination as exc:
            form.add_error(exc.field, str(exc))
        except security.NeedsStrongerAccount as exc:  # lost the proof since the page loaded
            form.add_error(None, str(exc))
        else:
            messages.success(request, f"Payouts will go by {destination.masked()}.")
            return redirect("billing:payouts")
    return render(request, "billing/payout_destination.html",
                  {"form": form, "current": current})


@login_required
@require_GET
def statement_csv(request):
    entries = selectors.user_entries(request.user.pk, kinds=[Account.Kind.EARNINGS])
    return _csv_response(f"rigshare-earnings-{timezone.now():%Y%m%d}.csv", ENTRY_HEADER,
                         _entry_rows(entries))
