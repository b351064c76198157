"""allauth's account adapter: the client's address as the rest of the platform reads it
(config/client_ip.py), for allauth's rate limits and its sessions list; and the /v1 API keys
still active named in the emails about a password reset or change (they survive both)."""

from allauth.account.adapter import DefaultAccountAdapter
from django.core.exceptions import PermissionDenied

from config.client_ip import client_ip

# The notifications that say the API keys survive what was done.
NAMES_THE_KEYS = {"account/email/password_reset", "account/email/password_changed"}


class AccountAdapter(DefaultAccountAdapter):
    def send_notification_mail(self, template_prefix, user, context=None, email=None):
        if template_prefix in NAMES_THE_KEYS:
            from billing.keys import api_keys_active
            context = {**(context or {}), "api_keys": api_keys_active(user)}
        super().send_notification_mail(template_prefix, user, context, email)

    def get_client_ip(self, request) -> str:
        ip = client_ip(request)
        if not ip:
            raise PermissionDenied("Unable to determine the client's address.")
        return ip
