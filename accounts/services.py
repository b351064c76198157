from django.db import transaction
from django.utils import timezone

from accounts import security
from accounts.models import PersonalToken, User
from accounts.secrets import secret_issue


@transaction.atomic
def personal_token_create(*, user: User, name: str) -> tuple[PersonalToken, str]:
    """A REST token, its secret returned this once; the holder is emailed of it."""
    issued = secret_issue("rst")
    row = PersonalToken.objects.create(
        user=user, name=name, prefix=issued.prefix, digest=issued.digest)
    security.security_email_on_commit(
        user, "new_api_key", {"key_name": row.name, "key_prefix": f"rst_{row.prefix}_",
                              "rest_token": True})
    return row, issued.token


def personal_token_revoke(*, user: User, token_id: int) -> bool:
    """Revoke one of the user's own tokens; False when it is not theirs or already revoked."""
    return bool(PersonalToken.objects.filter(
        pk=token_id, user=user, revoked_at__isnull=True).update(revoked_at=timezone.now()))
