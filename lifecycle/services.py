"""Data download and closure of one account, across the apps."""

from allauth.account.models import EmailAddress
from allauth.mfa.models import Authenticator
from allauth.usersessions.models import UserSession
from django.db import transaction
from django.utils import timezone

from accounts import security
from accounts.models import LoginDevice, User
from billing import selectors as billing_selectors
from billing import services as billing_services
from marketplace import selectors as marketplace_selectors
from marketplace import services as marketplace_services

EXPORT_VERSION = 1


def _when(value):
    return value.isoformat() if value else None


def account_export(*, user: User) -> dict:
    """Everything Rigshare keeps about the person, as JSON values. Secrets never appear:
    keys and tokens are stored as a prefix and an HMAC, and only the prefix is exported."""
    return {
        "format": f"rigshare-account-export/{EXPORT_VERSION}",
        "exported_at": _when(timezone.now()),
        "account": {
            "id": user.pk, "email": user.email, "first_name": user.first_name,
            "last_name": user.last_name, "date_joined": _when(user.date_joined),
            "last_login": _when(user.last_login),
            "two_factor": security.has_two_factor(user),
            "email_addresses": [
                {"email": e.email, "verified": e.verified, "primary": e.primary}
                for e in EmailAddress.objects.filter(user=user).order_by("email")],
            "sessions": [
                {"ip": s.ip, "user_agent": s.user_agent, "created_at": _when(s.created_at),
                 "last_seen_at": _when(s.last_seen_at)}
                for s in UserSession.objects.filter(user=user).order_by("created_at")],
            "login_devices": [
                {"user_agent": d.user_agent, "ip": d.ip, "first_seen_at": _when(d.first_seen_at),
                 "last_seen_at": _when(d.last_seen_at)}
                for d in LoginDevice.objects.filter(user=user).order_by("first_seen_at")],
            "rest_tokens": [
                {"name": t.name, "prefix": f"rst_{t.prefix}_", "created_at": _when(t.created_at),
                 "last_used_at": _when(t.last_used_at), "revoked_at": _when(t.revoked_at)}
                for t in user.personal_tokens.order_by("created_at", "id")],
        },
        "billing": billing_selectors.personal_data(user.pk),
        "marketplace": marketplace_selectors.personal_data(user),
    }


def account_close_problems(*, user: User) -> list[str]:
    """Why the account cannot close now; empty when it can."""
    return (marketplace_selectors.closure_problems(user)
            + billing_selectors.closure_problems(user.pk))


class CannotClose(Exception):
    def __init__(self, problems: list[str]):
        super().__init__(" ".join(problems))
        self.problems = problems


def account_close(*, user: User, give_up_credit: bool) -> dict:
    """Close the account: refused while a rental runs or money is in motion or owed to the
    holder; credit left in the wallet must be given up explicitly. The ledger, payments,
    payouts and rentals stay intact (they are the platform's books and the providers'); the
    person is anonymized: their email addresses, names, password, second factor, sessions,
    devices, tokens, keys and bank details go, and the account can never log in again."""
    credit = billing_selectors.user_balances(user.pk)["wallet"]
    problems = account_close_problems(user=user)
    if credit > 0 and not give_up_credit:
        problems.append("You have credit left: confirm that you give it up.")
    if problems:
        raise CannotClose(problems)
    address = user.email
    security.security_email(user, "account_closed", {"credit_micros": credit})
    with transaction.atomic():
        user = User.objects.select_for_update().get(pk=user.pk)
        given_up = billing_services.account_close_billing(user=user)
        machines = marketplace_services.provider_leave(owner=user)
        security.revoke_personal_tokens(user)
        Authenticator.objects.filter(user=user).delete()
        EmailAddress.objects.filter(user=user).delete()
        LoginDevice.objects.filter(user=user).delete()
        now = timezone.now()
        user.email = f"closed-{user.pk}@closed.invalid"
        user.first_name = user.last_name = ""
        user.set_unusable_password()
        user.is_active = user.is_staff = user.is_superuser = False
        user.closed_at = now
        user.save()
    security.end_sessions(user)
    return {"former_email": address, "credit_given_up_micros": given_up,
            "machines_removed": machines}
