"""The client's address, one definition for everything that limits or records by address:
django-axes' failed log-ins, allauth's rate limits and its sessions list, the log-in devices in
security emails, and who may scrape /metrics without a token. And whether the client's
connection was HTTPS where a proxy terminates TLS.

Behind RIGSHARE_TRUSTED_PROXIES proxies (a load balancer, an nginx), each appends the address
it was reached from to X-Forwarded-For, so the client's is the N-th from the right: anything to
its left was written by the client and is not believed. Without trusted proxies, or when the
header holds fewer hops than the proxies (a request that did not come through them), it is the
connection's own address (REMOTE_ADDR).

Those headers are believed only on a connection from the proxy itself: one from an address in
RIGSHARE_TRUSTED_PROXY_NETWORKS (any, where that is unset outside production). A client that
reaches a replica directly has X-Forwarded-For and X-Forwarded-Proto taken off its request
before anything reads them (the middleware below comes first), so it can neither take another
address's limits nor pass for HTTPS (SECURE_PROXY_SSL_HEADER).
"""

import ipaddress
from functools import lru_cache

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.utils.decorators import sync_and_async_middleware

FORWARDED_META = ("HTTP_X_FORWARDED_FOR", "HTTP_X_FORWARDED_PROTO")


def client_ip(request) -> str | None:
    remote = request.META.get("REMOTE_ADDR") or None
    count = settings.RIGSHARE_TRUSTED_PROXIES
    if not count or not from_trusted_proxy(remote):
        return remote
    hops = [hop.strip() for hop in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")]
    hops = [hop for hop in hops if hop]
    if len(hops) < count:
        return remote
    try:
        return str(ipaddress.ip_address(hops[-count]))
    except ValueError:  # not an address: what the proxies wrote cannot be read
        return remote


def from_trusted_proxy(peer: str | None) -> bool:
    """Whether a connection from `peer` comes from the proxy in front of the site."""
    networks = _networks(settings.RIGSHARE_TRUSTED_PROXY_NETWORKS)
    if not networks:
        return True
    try:
        address = ipaddress.ip_address(peer or "")
    except ValueError:  # a Unix socket, or nothing: not a proxy of the configured networks
        return False
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address in network for network in networks)


@lru_cache(maxsize=8)
def _networks(configured: tuple[str, ...]) -> tuple:
    return tuple(ipaddress.ip_network(network, strict=False) for network in configured)


@sync_and_async_middleware
def forwarded_headers_middleware(get_response):
    """Takes the forwarding headers off a request that did not come from a trusted proxy."""

    def strip(request) -> None:
        if not from_trusted_proxy(request.META.get("REMOTE_ADDR")):
            for name in FORWARDED_META:
                request.META.pop(name, None)

    if iscoroutinefunction(get_response):
        async def middleware(request):
            strip(request)
            return await get_response(request)

        return markcoroutinefunction(middleware)

    def middleware(request):
        strip(request)
        return get_response(request)

    return middleware
