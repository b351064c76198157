"""The client's address, one definition for everything that limits or records by address:
django-axes' failed log-ins, allauth's rate limits and its sessions list, the log-in devices in
security emails, and who may scrape /metrics without a token.

Behind RIGSHARE_TRUSTED_PROXIES proxies (a load balancer, an nginx), each appends the address
it was reached from to X-Forwarded-For, so the client's is the N-th from the right: anything to
its left was written by the client and is not believed. Without trusted proxies, or when the
header holds fewer hops than the proxies (a request that did not come through them), it is the
connection's own address (REMOTE_ADDR).
"""

import ipaddress

from django.conf import settings


def client_ip(request) -> str | None:
    remote = request.META.get("REMOTE_ADDR") or None
    count = settings.RIGSHARE_TRUSTED_PROXIES
    if not count:
        return remote
    hops = [hop.strip() for hop in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")]
    hops = [hop for hop in hops if hop]
    if len(hops) < count:
        return remote
    try:
        return str(ipaddress.ip_address(hops[-count]))
    except ValueError:  # not an address: what the proxies wrote cannot be read
        return remote
