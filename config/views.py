from django.db import connection
from django.http import JsonResponse


def healthz(request):
    """For load balancers: answers 200 only when this replica can reach its database."""
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:  # any database failure means: take this replica out
        return JsonResponse({"status": "error", "database": str(exc)[:200]}, status=503)
    return JsonResponse({"status": "ok"})
