"""What an account must have proven before it moves money, and what happens when its proofs
change.

Two proofs guard the actions that could drain an account whose password leaked: a verified
email address, and a second factor (TOTP, with recovery codes). They are required to request a
payout, to change where payouts go, and to create an API key with no spend limit; staff need
the second factor for /admin/. The checks live here, below billing and marketplace, so that a
service refuses the action whichever door it came through (page, REST API).

When the proofs change, what was opened with the old ones closes: turning two-factor on, or
changing or resetting the password, ends every other session and revokes every REST token.
"""

from __future__ import annotations

import functools
import logging
from urllib.parse import urlsplit

from allauth.account.adapter import get_adapter as account_adapter
from allauth.account.decorators import reauthentication_required
from allauth.account.internal.flows import reauthentication
from allauth.account.models import EmailAddress
from allauth.core import context as allauth_context
from allauth.mfa.utils import is_mfa_enabled
from allauth.usersessions.models import UserSession
from django.conf import settings
from django.contrib import messages
from django.contrib.auth import update_session_auth_hash
from django.contrib.auth.views import redirect_to_login
from django.db import transaction
from django.db.models import F
from django.shortcuts import redirect
from django.test import RequestFactory
from django.urls import reverse
from django.utils import timezone
from rest_framework import permissions
from rest_framework.authentication import SessionAuthentication

from accounts.models import PersonalToken, User

log = logging.getLogger(__name__)


class NeedsStrongerAccount(Exception):
    """An action refused until the account has verified its email and turned on 2FA."""

    def __init__(self, message: str, missing: str):
        super().__init__(message)
        self.missing = missing  # "email" or "mfa": which page fixes it


def has_verified_email(user) -> bool:
    return EmailAddress.objects.filter(user=user, verified=True).exists()


def has_two_factor(user) -> bool:
    return is_mfa_enabled(user)


def strong_account_problem(user, action: str) -> NeedsStrongerAccount | None:
    """Why `user` may not do `action` (a phrase such as "request a payout") yet, or None."""
    if not has_verified_email(user):
        return NeedsStrongerAccount(
            f"Verify your email address before you {action}: follow the link we emailed you, "
            "or send it again from Account settings.", "email")
    if not has_two_factor(user):
        return NeedsStrongerAccount(
            f"Turn on two-factor authentication before you {action} "
            "(Account settings > Two-factor).", "mfa")
    return None


def require_strong_account(user, action: str) -> None:
    problem = strong_account_problem(user, action)
    if problem is not None:
        raise problem


def strong_account_required(action: str):
    """A page decorator: an account that lacks a proof is sent to its account settings, told
    what is missing and where to add it."""

    def decorate(view):
        @functools.wraps(view)
        def wrapped(request, *args, **kwargs):
            problem = strong_account_problem(request.user, action)
            if problem is None:
                return view(request, *args, **kwargs)
            messages.warning(request, str(problem))
            return redirect(reverse("accounts:settings"))
        return wrapped

    return decorate


# Moves of money, secrets or the account's addresses ask for the password (or a second-factor
# code) again when the session's last proof is older than ACCOUNT_REAUTHENTICATION_TIMEOUT: a
# stolen session alone cannot take the account or its money. allauth's reauthentication: the
# page asks, then replays the request that was asked for.
recent_proof_required = reauthentication_required(allow_get=True)


class RecentProof(permissions.BasePermission):
    """The REST API's side of recent_proof_required: a request made with the session (a
    browser's) that changes something needs a recent re-authentication; one made with a REST
    token is the token holder's, which the token itself proves."""

    message = ("Confirm it is you first: re-authenticate at /accounts/reauthenticate/ (your "
               "password or a two-factor code), then send this again, or use a REST token.")

    def has_permission(self, request, view) -> bool:
        if request.method in permissions.SAFE_METHODS:
            return True
        if not isinstance(request.successful_authenticator, SessionAuthentication):
            return True
        return not reauthentication.is_reauthentication_required(request._request, app="")


def staff_required(view):
    """Operators' pages outside the admin ask what the admin asks: staff, with two-factor on.
    Anyone else is sent to the admin's log-in, which says what is missing."""

    @functools.wraps(view)
    def wrapped(request, *args, **kwargs):
        user = request.user
        if user.is_active and user.is_staff and has_two_factor(user):
            return view(request, *args, **kwargs)
        return redirect_to_login(request.get_full_path(), reverse("admin:login"))

    return wrapped


def security_email(user, template_prefix: str, context: dict | None = None,
                   request=None) -> None:
    """Tell the account's holder, at their primary address, of something done in their name
    (templates/accounts/email/<prefix>_subject.txt and _message.txt), with the address and
    browser it came from."""
    request = request or allauth_context.request or _request_outside_a_request()
    try:
        with allauth_context.request_context(request):
            account_adapter(request).send_notification_mail(
                f"accounts/email/{template_prefix}", user, context or {})
    except Exception:  # a mail server that is away must not undo what was done
        log.exception("security email %s to user %s not sent", template_prefix, user.pk)


def security_email_on_commit(user, template_prefix: str, context: dict | None = None) -> None:
    """security_email once the current transaction commits (nothing is told of what a
    rollback undid), about the request that did it."""
    request = allauth_context.request
    transaction.on_commit(
        lambda: security_email(user, template_prefix, context, request=request))


def _request_outside_a_request():
    """For mail sent from a task or a command: a request on the platform's public address."""
    url = urlsplit(settings.RIGSHARE_PUBLIC_URL or "http://localhost")
    return RequestFactory().get("/", HTTP_HOST=url.netloc, secure=url.scheme == "https",
                                REMOTE_ADDR="127.0.0.1", HTTP_USER_AGENT="Rigshare")


def end_sessions(user, *, keep=None) -> int:
    """End every session of the user but the request `keep`'s (if given): their generation is
    raised, so that Django refuses every session it signed before, listed or not, and the
    sessions list forgets them. Returns how many listed sessions ended."""
    User.objects.filter(pk=user.pk).update(session_generation=F("session_generation") + 1)
    user.refresh_from_db(fields=["session_generation"])
    keep_key = keep.session.session_key if keep is not None else None
    ended = 0
    for row in UserSession.objects.filter(user=user):
        if keep_key and row.session_key == keep_key:
            continue
        row.end()
        ended += 1
    if keep is not None and keep.user.is_authenticated and keep.user.pk == user.pk:
        keep.user.session_generation = user.session_generation
        update_session_auth_hash(keep, keep.user)  # this session goes on
    return ended


def revoke_personal_tokens(user) -> int:
    return PersonalToken.objects.filter(user=user, revoked_at__isnull=True).update(
        revoked_at=timezone.now())


def close_old_doors(request, user) -> dict:
    """After a change of password or second factor: every other session ends and every REST
    token stops working, so that nothing opened with the old proofs outlives them."""
    return {"sessions_ended": end_sessions(user, keep=request),
            "tokens_revoked": revoke_personal_tokens(user)}


def axes_username(request, credentials=None) -> str | None:
    """The email a log-in attempt is for, as django-axes counts failures: allauth passes it as
    `email` in the credentials; its form posts it as `login`."""
    value = (credentials or {}).get("email") or (credentials or {}).get("username")
    if not value and request is not None:
        data = getattr(request, "data", None) or request.POST
        value = data.get("login") or data.get("username")
    return value.strip().lower() if isinstance(value, str) else value
