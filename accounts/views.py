from django.contrib import messages
from django.contrib.auth import login
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from accounts.forms import LoginForm, PersonalTokenForm, SignUpForm
from accounts.services import personal_token_create, personal_token_revoke


def signup(request):
    form = SignUpForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        user = form.save()
        login(request, user, backend="django.contrib.auth.backends.ModelBackend")
        messages.success(request, "Welcome to Rigshare.")
        target = request.GET.get("next", "")
        if not url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()},
                                               require_https=request.is_secure()):
            target = "marketplace:catalog"  # never send a new user off-site
        return redirect(target)
    return render(request, "accounts/signup.html", {"form": form})


class LoginView(auth_views.LoginView):
    template_name = "accounts/login.html"
    authentication_form = LoginForm


@login_required
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
