from django.conf import settings

from accounts import devices


class DeviceCookieMiddleware:
    """Gives a browser that just logged in without a device cookie its id (accounts/devices.py)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        device_id = getattr(request, "rigshare_new_device_id", None)
        if device_id:
            response.set_cookie(devices.COOKIE, devices.signed_cookie_value(device_id),
                                max_age=devices.COOKIE_MAX_AGE_S, httponly=True,
                                samesite="Lax", secure=settings.SESSION_COOKIE_SECURE)
        return response
