"""Where allauth's flows tell accounts what happened (it offers signals, not hooks)."""

from allauth.account import signals as account_signals
from allauth.mfa import signals as mfa_signals
from allauth.mfa.models import Authenticator
from django.contrib import messages
from django.dispatch import receiver

from accounts import devices, security


@receiver(account_signals.password_changed)
@receiver(account_signals.password_reset)
def _password_changed(sender, request, user, **kwargs):
    # allauth emails the holder itself (its templates say what else ended).
    security.close_old_doors(request if request.user.is_authenticated else None, user)


@receiver(mfa_signals.authenticator_added)
def _two_factor_on(sender, request, user, authenticator, **kwargs):
    if authenticator.type == Authenticator.Type.TOTP:
        security.close_old_doors(request, user)


@receiver(account_signals.user_signed_up)
def _signed_up(sender, request, user, **kwargs):
    messages.success(request, "Welcome to Rigshare.")


@receiver(account_signals.user_logged_in)
def _logged_in(sender, request, user, **kwargs):
    device = devices.login_seen(request, user)
    if device is not None:
        security.security_email(user, "new_login", {"device": device})
