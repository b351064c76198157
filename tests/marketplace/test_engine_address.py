"""The platform calls only real engines: a reported engine URL that resolves to loopback,
link-local, private or metadata addresses is refused (unless an operator allows the network),
the platform connects to the address it checked, and never calls an offline node."""

import http.server
import threading

import pytest

from marketplace import engine_address
from marketplace.engine_address import EngineAddressRefused, check
from marketplace.models import Node
from routing import services as routing
from tests.marketplace.test_agent_api import beat, enroll, report
from verification import services as verification

PUBLIC = "93.184.215.14"


def resolver(*addresses):
    return lambda host, port: list(addresses)


@pytest.mark.parametrize("url, kind", [
    ("http://127.0.0.1:8399/internal-admin", "loopback"),
    ("http://[::1]:8000", "loopback"),
    ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ("http://10.0.0.5:8000", "private"),
    ("http://192.168.1.20:8000", "private"),
    ("http://172.16.3.4:8000", "private"),
    ("http://0.0.0.0:8000", "unspecified"),
    ("http://[::ffff:127.0.0.1]:8000", "loopback"),
    ("http://100.64.1.2:8000", "not a public address"),  # carrier-grade NAT
    # IPv6 forms that lead to an IPv4 address through a translator on the path.
    ("http://[64:ff9b::169.254.169.254]:80", "169.254.169.254 .*link-local"),  # NAT64
    ("http://[64:ff9b::10.0.0.5]:8000", "private"),
    ("http://[64:ff9b:1::a00:5]:8000", "private"),  # NAT64, local-use prefix
    ("http://[2002:a00:5::1]:8000", "10.0.0.5 .*private"),  # 6to4
    ("http://[2002:7f00:1::]:8000", "loopback"),
    ("http://[::127.0.0.1]:8000", "loopback"),  # IPv4-compatible
    ("http://[::169.254.169.254]:8000", "link-local"),
])
def test_addresses_that_are_not_public_are_refused(url, kind):
    with pytest.raises(EngineAddressRefused, match=kind):
        check(url)


def test_a_translated_ipv6_address_to_a_public_ipv4_one_is_public():
    for address in ("64:ff9b::5db8:d70e", "2002:5db8:d70e::1"):  # 93.184.215.14
        assert check(f"http://[{address}]:8000").address == address


def test_a_name_is_judged_by_every_address_it_resolves_to():
    with pytest.raises(EngineAddressRefused, match="loopback"):
        check("http://engine.example:8000", resolve=resolver("127.0.0.1"))
    with pytest.raises(EngineAddressRefused, match="private"):
        check("http://engine.example:8000", resolve=resolver(PUBLIC, "10.1.2.3"))
    checked = check("http://engine.example:8000/", resolve=resolver(PUBLIC))
    assert checked.connect_url == f"http://{PUBLIC}:8000" and checked.address == PUBLIC


@pytest.mark.parametrize("url", ["ftp://engine.example/", "http://", "engine.example:8000",
                                 "http://user:pw@engine.example/"])
def test_urls_that_are_not_plain_http_are_refused(url):
    with pytest.raises(EngineAddressRefused):
        check(url, resolve=resolver(PUBLIC))


def test_an_operator_may_allow_a_network():
    assert check("http://10.0.0.5:8000", allowed_networks=("10.0.0.0/8",)).connect_url \
        == "http://10.0.0.5:8000"
    with pytest.raises(EngineAddressRefused):
        check("http://10.0.0.5:8000", allowed_networks=("192.168.0.0/16",))


class _Counting(http.server.BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self):  # noqa: N802 (http.server's name)
        type(self).hits += 1
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"data": []}')

    do_POST = do_GET  # noqa: N815

    def log_message(self, *args):
        pass


@pytest.fixture
def internal_service():
    """A service on the platform's own machine that a provider would like it to call."""
    _Counting.hits = 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/internal-admin", _Counting
    server.shutdown()


@pytest.mark.django_db
def test_a_provider_cannot_point_the_platform_at_its_own_network(api, bob, settings,
                                                                 internal_service):
    settings.RIGSHARE_ENGINE_NETWORKS = ()  # production: no private network allowed
    url, service = internal_service
    enrolled = enroll(api, bob)
    engine = {"url": url, "reachable": True, "models": ["Qwen/Qwen3-27B"], "error": None}
    assert beat(api, enrolled["credential"], report(engine=engine)).status_code == 200
    node = Node.objects.get(pk=enrolled["node_id"])
    assert not node.engine_reachable and node.engine_connect_url == ""
    assert node.engine_error.startswith("refused:") and "loopback" in node.engine_error
    # The next heartbeat keeps the refusal and its reason.
    beat(api, enrolled["credential"], report(engine=engine))
    node.refresh_from_db()
    assert "loopback" in node.engine_error and not node.engine_reachable
    # Nothing the platform runs calls it: health checks, the load test.
    routing.deployments_check_health()
    run = verification.run_start(node_id=node.pk, trigger="enrolment")
    from verification.models import VerificationRun
    VerificationRun.objects.filter(pk=run.pk).update(status="probing")
    verification.run_load_test(run_id=run.pk)
    assert service.hits == 0
    run.refresh_from_db()
    assert "loopback" in run.error


@pytest.mark.django_db
def test_the_platform_connects_to_the_address_it_checked(api, bob, settings, monkeypatch):
    """DNS rebinding: a name checked as public and later answering loopback is still called at
    the public address, until it is checked again."""
    settings.RIGSHARE_ENGINE_NETWORKS = ()
    answers = [[PUBLIC], ["127.0.0.1"]]
    monkeypatch.setattr(engine_address, "_resolve", lambda host, port: answers.pop(0))
    enrolled = enroll(api, bob)
    engine = {"url": "http://engine.example:8000", "reachable": True, "models": [],
              "error": None}
    beat(api, enrolled["credential"], report(engine=engine))
    beat(api, enrolled["credential"], report(engine=engine))
    node = Node.objects.get(pk=enrolled["node_id"])
    assert node.engine_connect_url == f"http://{PUBLIC}:8000" and node.engine_reachable
    assert answers == [["127.0.0.1"]]  # looked up once: the stored check stands


@pytest.mark.django_db
def test_an_offline_node_is_not_load_tested(bob, internal_service):
    from tests.factories import NodeFactory
    from verification.models import VerificationRun

    url, service = internal_service
    node = NodeFactory(owner=bob, engine_url=url, engine_reachable=True,
                       status=Node.Status.OFFLINE)
    run = VerificationRun.objects.create(node=node, trigger="schedule", status="probing")
    verification.run_load_test(run_id=run.pk)
    run.refresh_from_db()
    assert service.hits == 0 and "offline" in run.error
