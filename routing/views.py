"""/v1: OpenAI-compatible endpoints (async views under uvicorn; no ORM on the request path)."""

import hmac
import ipaddress

from django.conf import settings
from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import RequestDataTooBig
from django.http import HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.csrf import csrf_exempt

from routing import errors, metrics, proxy
from routing.pool import POOL

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
    data = [_model(m, snap) for m in snap.models.values() if m.prices]
    return JsonResponse({"object": "list", "data": data})


@csrf_exempt
async def model(request, model_id: str):
    """One model, as `models` lists it (the SDK's `models.retrieve`)."""
    snap = await _pool_for_get(request)
    if isinstance(snap, HttpResponse):
        return snap
    found = snap.models.get(model_id)
    if found is None or not found.prices:
        return proxy.error_response(errors.NotFound(
            f"The model '{model_id}' does not exist.", "model",
            code=errors.ErrorCode.MODEL_NOT_FOUND))
    return JsonResponse(_model(found, snap))


def _model(m, snap) -> dict:
    return {"id": m.name, "object": "model", "created": m.created, "owned_by": "rigshare",
            "context_length": m.context_length, "available": bool(snap.workers.get(m.name))}


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
    try:  # no token configured: only from this machine
        return ipaddress.ip_address(request.META.get("REMOTE_ADDR", "")).is_loopback
    except ValueError:
        return False


async def prometheus(request):
    if not _may_scrape(request):
        return HttpResponse("Forbidden: set RIGSHARE_METRICS_TOKEN and send it as a bearer "
                            "token.\n", status=403, content_type="text/plain")
    await POOL.current()
    return HttpResponse(metrics.render(), content_type="text/plain; version=0.0.4")


POOL_PAGE_REFRESH_S = 5


@staff_member_required
def pool_page(request):
    """Staff only: the workers a router places on now, live (routing/selectors.py)."""
    from routing import selectors

    return render(request, "routing/pool.html", {"pool": selectors.pool_overview(),
                                                  "refresh_s": POOL_PAGE_REFRESH_S})
