from allauth.mfa.utils import is_mfa_enabled
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.shortcuts import redirect
from django.urls import reverse
from django.utils.http import urlencode


class AdminSite(admin.AdminSite):
    """The admin for staff who logged in through the site's own log-in, with a second factor.
    Django's admin log-in form would ask for a password alone, so it is never shown."""

    site_header = "Rigshare operations"

    def has_permission(self, request):
        return super().has_permission(request) and is_mfa_enabled(request.user)

    def login(self, request, extra_context=None):
        user = request.user
        if user.is_authenticated and not (user.is_active and user.is_staff):
            raise PermissionDenied("The admin is for Rigshare's operators.")
        if user.is_authenticated:
            messages.warning(request, "The admin needs two-factor authentication: turn it on "
                                      "here, then open the admin again.")
            return redirect("mfa_activate_totp")
        target = request.GET.get("next") or reverse("admin:index")
        return redirect(f"{reverse('account_login')}?{urlencode({'next': target})}")
