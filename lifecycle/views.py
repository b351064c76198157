import json

from django.contrib import messages
from django.contrib.auth import logout
from django.contrib.auth.decorators import login_required
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET

from accounts import security
from billing import selectors as billing_selectors
from lifecycle import services
from lifecycle.forms import CloseAccountForm


@login_required
@require_GET
def data_download(request):
    body = json.dumps(services.account_export(user=request.user), indent=2)
    response = HttpResponse(body, content_type="application/json")
    response["Content-Disposition"] = (
        f'attachment; filename="rigshare-account-{timezone.now():%Y%m%d}.json"')
    response["Cache-Control"] = "no-store"
    return response


@login_required
@security.recent_proof_required
def close(request):
    user = request.user
    credit = billing_selectors.user_balances(user.pk)["wallet"]
    form = CloseAccountForm(request.POST or None, user=user, credit_micros=credit)
    if request.method == "POST" and form.is_valid():
        try:
            services.account_close(user=user, give_up_credit=form.cleaned_data["give_up_credit"])
        except services.CannotClose as exc:
            for problem in exc.problems:
                form.add_error(None, problem)
        else:
            logout(request)
            messages.success(request, "Your account is closed. Thank you for using Rigshare.")
            return redirect("marketplace:catalog")
    return render(request, "accounts/close.html", {
        "form": form, "problems": services.account_close_problems(user=user),
        "credit_micros": credit})
