from allauth.account.models import EmailAddress
from allauth.mfa.models import Authenticator
from allauth.usersessions.models import UserSession
from django.contrib import messages
from django.contrib.auth import logout
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from accounts import security
from accounts.forms import PersonalTokenForm
from accounts.services import personal_token_create, personal_token_revoke


@login_required
def settings_page(request):
    user = request.user
    return render(request, "accounts/settings.html", {
        "emails": EmailAddress.objects.filter(user=user).order_by("-primary", "email"),
        "verified": security.has_verified_email(user),
        "two_factor": security.has_two_factor(user),
        "recovery_codes": Authenticator.objects.filter(
            user=user, type=Authenticator.Type.RECOVERY_CODES).exists(),
        "session_count": UserSession.objects.filter(user=user).count(),
        "token_count": user.personal_tokens.filter(revoked_at__isnull=True).count(),
    })


@login_required
@require_POST
def logout_everywhere(request):
    """Every session of the account ends, this one too; REST tokens too when asked."""
    user = request.user
    revoke = request.POST.get("revoke_tokens") == "on"
    revoked = security.revoke_personal_tokens(user) if revoke else 0
    security.end_sessions(user)
    logout(request)
    messages.success(request, "You are logged out everywhere"
                     + (f", and {revoked} REST token(s) were revoked." if revoke else "."))
    return redirect("account_login")


@login_required
@security.recent_proof_required
def tokens(request):
    form = PersonalTokenForm(request.POST or None)
    new_token = None
    if request.method == "POST" and form.is_valid():
        _, new_token = personal_token_create(user=request.user, name=form.cleaned_data["name"])
        form = PersonalTokenForm()
    rows = request.user.personal_tokens.all()
    return render(request, "accounts/tokens.html",
                  {"form": form, "tokens": rows, "new_token": new_token})


@login_required
@require_POST
def token_revoke(request, token_id: int):
    if personal_token_revoke(user=request.user, token_id=token_id):
        messages.success(request, "Token revoked.")
    else:
        messages.error(request, "No such active token.")
    return redirect("accounts:tokens")
