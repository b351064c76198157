from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from accounts.models import PersonalToken
from accounts.secrets import secret_check, secret_prefix


class PersonalTokenAuthentication(authentication.BaseAuthentication):
    """`Authorization: Bearer rst_...` for the REST API."""

    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1")
        scheme, _, token = header.partition(" ")
        if scheme != self.keyword or not token.startswith("rst_"):
            return None  # not ours: let another scheme (or none) answer
        prefix = secret_prefix(token.strip(), "rst")
        row = (PersonalToken.objects.select_related("user").filter(prefix=prefix).first()
               if prefix else None)
        kept = secret_check(token.strip(), row.digest) if row is not None else None
        if kept is None or row.revoked_at:
            raise exceptions.AuthenticationFailed("Invalid or revoked API token.")
        if not row.user.is_active:
            raise exceptions.AuthenticationFailed("This account is disabled.")
        # A digest made under a SECRET_KEY since replaced is re-hashed on this use.
        PersonalToken.objects.filter(pk=row.pk).update(last_used_at=timezone.now(), digest=kept)
        return row.user, row

    def authenticate_header(self, request):
        return self.keyword


class PersonalTokenScheme(OpenApiAuthenticationExtension):
    target_class = "accounts.authentication.PersonalTokenAuthentication"
    name = "personalToken"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "rst_...",
                "description": "A personal API token from Account > API tokens."}
