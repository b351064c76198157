"""The client's address (config/client_ip.py): what a limit, a lockout or a security email
counts by. Behind N trusted proxies it is the N-th hop from the right of X-Forwarded-For;
whatever a client writes to the left of it is not believed."""

import pytest
from django.test import RequestFactory

from config.client_ip import client_ip
from routing.views import _may_scrape


def request(remote="10.0.0.5", forwarded=None):
    extra = {"HTTP_X_FORWARDED_FOR": forwarded} if forwarded is not None else {}
    return RequestFactory().get("/", REMOTE_ADDR=remote, **extra)


@pytest.mark.parametrize("proxies, remote, forwarded, seen", [
    (0, "10.0.0.5", "203.0.113.9", "10.0.0.5"),  # no proxy trusted: the header is the client's
    (1, "10.0.0.5", "203.0.113.9", "203.0.113.9"),
    (1, "10.0.0.5", "198.51.100.7, 203.0.113.9", "203.0.113.9"),  # a forged hop on the left
    (2, "10.0.0.5", "198.51.100.7, 203.0.113.9, 10.0.0.9", "203.0.113.9"),
    (2, "10.0.0.5", "203.0.113.9", "10.0.0.5"),  # fewer hops than proxies: not through them
    (1, "10.0.0.5", None, "10.0.0.5"),
    (1, "10.0.0.5", " 2001:db8::7 ", "2001:db8::7"),
    (1, "10.0.0.5", "not-an-address", "10.0.0.5"),
    (1, "10.0.0.5", ",,", "10.0.0.5"),
])
def test_the_client_is_the_hop_the_farthest_trusted_proxy_saw(settings, proxies, remote,
                                                               forwarded, seen):
    settings.RIGSHARE_TRUSTED_PROXIES = proxies
    assert client_ip(request(remote, forwarded)) == seen


def test_metrics_without_a_token_are_for_this_machine_not_for_whoever_a_proxy_on_it_serves(
        settings):
    settings.RIGSHARE_METRICS_TOKEN = ""
    settings.RIGSHARE_TRUSTED_PROXIES = 0
    assert _may_scrape(request("127.0.0.1"))
    # An nginx on this machine passes a stranger's request on: it comes from 127.0.0.1.
    settings.RIGSHARE_TRUSTED_PROXIES = 1
    assert not _may_scrape(request("127.0.0.1", "203.0.113.9"))
    assert _may_scrape(request("127.0.0.1", "127.0.0.1"))


@pytest.mark.parametrize("remote, forwarded, seen", [
    ("10.0.0.5", "203.0.113.9", "203.0.113.9"),  # the proxy
    ("::ffff:10.0.0.5", "203.0.113.9", "203.0.113.9"),  # the proxy, over an IPv6 socket
    ("198.51.100.7", "203.0.113.9", "198.51.100.7"),  # a client past the proxy: not believed
    ("10.0.1.5", "203.0.113.9", "10.0.1.5"),
    ("", "203.0.113.9", None),
])
def test_only_the_proxys_own_connection_says_who_the_client_is(settings, remote, forwarded,
                                                                seen):
    settings.RIGSHARE_TRUSTED_PROXIES = 1
    settings.RIGSHARE_TRUSTED_PROXY_NETWORKS = ("10.0.0.0/24",)
    assert client_ip(request(remote, forwarded)) == seen


@pytest.mark.django_db
def test_https_is_what_the_proxy_says_never_what_a_client_past_it_says(settings, client):
    settings.RIGSHARE_TRUSTED_PROXY_NETWORKS = ("10.0.0.0/24",)
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    settings.SECURE_SSL_REDIRECT = True
    through_the_proxy = client.get("/healthz", REMOTE_ADDR="10.0.0.5",
                                   HTTP_X_FORWARDED_PROTO="https")
    assert through_the_proxy.status_code == 200
    # A client that reaches a replica directly claims HTTPS over plain HTTP: sent to HTTPS.
    past_it = client.get("/healthz", REMOTE_ADDR="198.51.100.7", HTTP_X_FORWARDED_PROTO="https")
    assert past_it.status_code == 301 and past_it.headers["location"].startswith("https://")

