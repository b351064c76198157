from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from marketplace.models import Node
from verification import services


@login_required
@require_POST
def reverify(request, node_id: int):
    try:
        services.run_request_by_provider(owner=request.user, node_id=node_id)
    except Node.DoesNotExist:
        raise Http404("No such machine.") from None
    except services.VerificationRefused as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, "Verification started: the rent page shows its progress.")
    return redirect(request.POST.get("next") or "marketplace:provider")
