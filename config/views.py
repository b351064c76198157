import logging
import sys

from django.conf import settings
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.db import InterfaceError, OperationalError, connection
from django.http import HttpResponse, JsonResponse
from django.views import defaults

from config.redis import REDIS_ERRORS

log = logging.getLogger(__name__)


def healthz(request):
    """For load balancers: answers 200 only when this replica can reach its database."""
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:  # any database failure means: take this replica out
        return JsonResponse({"status": "error", "database": str(exc)[:200]}, status=503)
    return JsonResponse({"status": "ok"})


# A database or Redis that is away for a moment: the client should come back, not give up.
RETRY_AFTER_S = 2


def server_error(request):
    """Django's 500 handler. A failure of the database or of Redis (a restart, a failover) is
    a 503 with Retry-After, as JSON under /api/, as a plain page elsewhere; anything else is
    the 500 it is."""
    exc = sys.exc_info()[1]
    outage = isinstance(exc, (OperationalError, InterfaceError, *REDIS_ERRORS))
    status = 503 if outage else 500
    message = ("Rigshare is briefly unable to answer: retry in a few seconds." if outage else
               "Something went wrong on our side; it has been logged.")
    if outage:
        log.warning("%s %s answered 503: %s", request.method, request.path, exc)
    if request.path.startswith("/api/"):
        response = JsonResponse({"detail": message}, status=status)
    else:
        response = HttpResponse(
            f"<!doctype html><title>{status}</title><h1>{'Back in a moment' if outage else 'Error'}"
            f"</h1><p>{message}</p>", status=status, content_type="text/html; charset=utf-8")
    if outage:
        response["Retry-After"] = str(RETRY_AFTER_S)
    return response


def bad_request(request, exception):
    """Django's 400 handler, for a request Django refuses before a view can answer. Under
    /api/ it answers in the REST API's JSON: a body over DATA_UPLOAD_MAX_MEMORY_SIZE is a 413,
    too many form fields or files a 400. Elsewhere Django's page."""
    if not request.path.startswith("/api/"):
        return defaults.bad_request(request, exception)
    if isinstance(exception, RequestDataTooBig):
        limit_mb = settings.DATA_UPLOAD_MAX_MEMORY_SIZE / (1024 * 1024)
        return JsonResponse({"detail": f"The body is over the limit of {limit_mb:g} MB."},
                            status=413)
    detail = ("The body has too many fields or files."
              if isinstance(exception, TooManyFieldsSent | TooManyFilesSent)
              else "The request could not be read.")
    return JsonResponse({"detail": detail}, status=400)


def not_found(request, exception):
    """Django's 404 handler: a URL under /api/ that no route matches (`/api/nodes/abc/`)
    answers in the REST API's JSON, as DRF's own 404s do; elsewhere Django's page."""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": "Not found."}, status=404)
    return defaults.page_not_found(request, exception)
