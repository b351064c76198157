"""/v1: OpenAI-compatible endpoints (async views under uvicorn; no ORM on the request path);
and the pages an API consumer meets beside it: the models served, their own activity, the
developers' page that leads to keys, tokens and docs."""

import csv
import hmac
import ipaddress

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import RequestDataTooBig
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET

from accounts import security
from billing.pricing import micros_to_usd, usd_per_token
from config.client_ip import client_ip
from config.spreadsheet import Echo, text_cell
from routing import errors, metrics, proxy, selectors, served
from routing.forms import ActivityFilterForm, cursor_text
from routing.models import Model
from routing.pool import POOL, PoolUnavailable

POOL.listeners.append(metrics.pool_changed)


def _method_not_allowed(request, allowed: str) -> JsonResponse:
    return proxy.error_response(errors.MethodNotAllowed(request.method, allowed))


async def _pool_for_get(request):
    """The pool snapshot for an authenticated GET, or the response that refuses it."""
    if request.method != "GET":
        return _method_not_allowed(request, "GET")
    try:
        await proxy.authenticate(request.headers.get("Authorization", ""))
        return await proxy.pool()
    except errors.ApiError as exc:
        return proxy.error_response(exc)
    except Exception:
        proxy.log.exception("GET %s failed", request.path)
        return proxy.error_response(proxy.unavailable())


@csrf_exempt
async def models(request):
    snap = await _pool_for_get(request)
    if isinstance(snap, HttpResponse):
        return snap
    offers = selectors.model_offers(snap, served=await served.model_figures())
    return JsonResponse({"object": "list", "data": [_model(offer) for offer in offers]})


@csrf_exempt
async def model(request, model_id: str):
    """One model, as `models` lists it (the SDK's `models.retrieve`)."""
    snap = await _pool_for_get(request)
    if isinstance(snap, HttpResponse):
        return snap
    found = next((o for o in selectors.model_offers(snap, served=await served.model_figures())
                  if o.name == model_id), None)
    if found is None:
        return proxy.error_response(errors.NotFound(
            f"The model '{model_id}' does not exist.", "model",
            code=errors.ErrorCode.MODEL_NOT_FOUND))
    return JsonResponse(_model(found))


def _model(offer: selectors.ModelOffer) -> dict:
    """OpenAI's model object (id, object, created, owned_by) and, beside it, OpenRouter's
    `context_length` and `pricing` (dollars per token, as strings) and the verified fleet
    serving it now under `x_rigshare` (docs/api.md)."""
    return {"id": offer.name, "object": "model", "created": offer.created,
            "owned_by": "rigshare", "context_length": offer.context_length,
            "available": offer.available,
            "pricing": {"prompt": usd_per_token(offer.input_micros_per_mtok),
                        "completion": usd_per_token(offer.output_micros_per_mtok)},
            "x_rigshare": {
                "description": offer.description,
                "context_length_basis": "verified_workers" if offer.served_context
                else "model",
                "model_context_length": offer.model_context,
                "verified_workers": offer.workers,
                "verified_tokens_per_s": round(offer.capacity_tps),
                # What the platform's traffic measured, per window: routing/traffic.py.
                "served": offer.served}}


async def _inference(request, endpoint: str):
    if request.method != "POST":
        return _method_not_allowed(request, "POST")
    try:
        raw = request.body
    except RequestDataTooBig:
        return proxy.error_response(errors.RequestTooLarge())
    return await proxy.handle(endpoint=endpoint, raw=raw,
                              authorization=request.headers.get("Authorization", ""),
                              session=request.headers.get("X-Session-ID") or None)


@csrf_exempt
async def chat_completions(request):
    return await _inference(request, "chat")


@csrf_exempt
async def completions(request):
    return await _inference(request, "completions")


# The /v1 endpoints, by path: the one table that routing.urls and routing.asgi both serve.
V1 = {"v1/models": models, "v1/chat/completions": chat_completions,
      "v1/completions": completions}


@csrf_exempt
async def not_found(request, rest=""):
    return proxy.error_response(errors.NotFound(
        f"Unknown endpoint: {request.method} {request.path}.", code=errors.ErrorCode.UNKNOWN_URL))


def _may_scrape(request) -> bool:
    token = settings.RIGSHARE_METRICS_TOKEN
    if token:
        sent = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(sent.encode(), token.encode())
    try:  # no token configured: only from this machine (not through a proxy on it)
        return ipaddress.ip_address(client_ip(request) or "").is_loopback
    except ValueError:
        return False


async def prometheus(request):
    if not _may_scrape(request):
        return HttpResponse("Forbidden: set RIGSHARE_METRICS_TOKEN and send it as a bearer "
                            "token.\n", status=403, content_type="text/plain")
    await POOL.current()
    return HttpResponse(metrics.render(), content_type="text/plain; version=0.0.4")


POOL_PAGE_REFRESH_S = 5


@security.staff_required
def pool_page(request):
    """Staff only: the workers a router places on now, live (routing/selectors.py)."""
    return render(request, "routing/pool.html", {"pool": selectors.pool_overview(),
                                                  "refresh_s": POOL_PAGE_REFRESH_S})


# --- the API consumer's pages ---

@require_GET
async def models_page(request):
    """Public: every model the platform serves, its price, and the verified fleet serving it
    now, from this process's pool snapshot (the one /v1 places requests with): no query."""
    try:
        offers = selectors.model_offers(await POOL.current(),
                                        served=await served.model_figures())
    except PoolUnavailable:
        offers = None
    return await sync_to_async(render)(
        request, "routing/models.html",
        {"offers": offers, "v1_url": request.build_absolute_uri("/v1")},
        status=200 if offers is not None else 503)


@require_GET
def developers(request):
    """Public: where a developer finds each way in (API keys, REST tokens, docs, models,
    activity)."""
    return render(request, "routing/developers.html", {
        "v1_url": request.build_absolute_uri("/v1"),
        "api_url": request.build_absolute_uri("/api/"),
        "example_model": Model.objects.filter(is_active=True).values_list("name", flat=True)
        .first()})


ACTIVITY_PAGE_SIZE = 50
ACTIVITY_CSV_CHUNK = 2000  # rows per query while a download streams
ACTIVITY_HEADER = ["time_utc", "model", "input_tokens", "output_tokens", "cost_usd",
                   "cost_estimated", "ttft_ms", "latency_ms", "worker", "status", "api_key",
                   "request_id"]


def _activity_page(request, form, rows=(), older: str = "", newest: bool = True, status=200):
    return render(request, "routing/activity.html", {
        "form": form, "rows": rows, "older": older, "newest": newest,
        "csv_query": form.query() if form.is_valid() else "",
        "model_names": Model.objects.filter(is_active=True).values_list("name", flat=True),
    }, status=status)


@login_required
@require_GET
def activity(request):
    """The user's own /v1 requests, newest first, a page at a time (keyset)."""
    form = ActivityFilterForm(request.GET, user_id=request.user.pk)
    if not form.is_valid():
        return _activity_page(request, form, status=400)
    before = form.cleaned_data["before"]
    rows, cursor = selectors.activity_page(request.user.pk, form.filters(),
                                           size=ACTIVITY_PAGE_SIZE, before=before)
    return _activity_page(request, form, rows,
                          older=form.query(before=cursor_text(cursor)) if cursor else "",
                          newest=before is None)


@login_required
@require_GET
def activity_csv(request):
    """Every row the filters select (the page's cursor aside), streamed as it is read."""
    form = ActivityFilterForm(request.GET, user_id=request.user.pk)
    if not form.is_valid():
        return _activity_page(request, form, status=400)
    response = StreamingHttpResponse(_activity_lines(request.user.pk, form.filters()),
                                     content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = (
        f'attachment; filename="rigshare-activity-{timezone.now():%Y%m%d}.csv"')
    return response


async def _activity_lines(user_id: int, filters: selectors.ActivityFilters):
    """Asynchronous, so that an ASGI server sends each chunk as it is read (it would read a
    synchronous iterator whole first)."""
    writer = csv.writer(Echo())
    yield writer.writerow(ACTIVITY_HEADER)
    before = None
    while True:
        rows, before = await sync_to_async(selectors.activity_page)(
            user_id, filters, size=ACTIVITY_CSV_CHUNK, before=before)
        if rows:
            yield "".join(writer.writerow(_activity_cells(row)) for row in rows)
        if before is None:
            return


def _activity_cells(row: selectors.ActivityRow) -> list:
    return [row.created_at.isoformat(), text_cell(row.model), row.prompt_tokens,
            row.completion_tokens,
            "" if row.cost_micros is None else micros_to_usd(row.cost_micros),
            "yes" if row.estimated else "", "" if row.ttft_ms is None else round(row.ttft_ms),
            round(row.latency_ms), text_cell(row.worker), row.status, text_cell(row.api_key),
            row.request_id]
