from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect
from django.utils.http import url_has_allowed_host_and_scheme
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
    target = request.POST.get("next", "")
    if not url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()},
                                           require_https=request.is_secure()):
        target = "marketplace:provider"  # never off-site
    return redirect(target)
