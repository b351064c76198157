"""The platform reaches engines over TLS pinned to the certificate the agent reports
(agent/engine_tls.py, marketplace/engine_tls.py): a real engine serving HTTPS (fleetsim's, on
uvicorn, as vLLM serves it), the proxy's transport, the health check and the load test's
client against it, and an engine whose certificate is not the pinned one refused before a byte
of the request is sent."""

import asyncio
import os
import socket
import stat
import subprocess
import sys
import time

import httpx
import pytest

from agent import engine_tls as agent_tls
from marketplace import engine_tls
from marketplace.serializers import EngineReportSerializer
from routing import services, upstream
from tests.deployment import free_port
from verification import loadtest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tls_engine(tmp_path_factory):
    """A simulated engine serving HTTPS with a certificate an agent made: (url, its PEM)."""
    state = tmp_path_factory.mktemp("engine-state")
    key, cert = agent_tls.ensure_certificate(state)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "fleetsim", "serve", "--profile", "rtx-pro-6000", "--port",
         str(port), "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--time-scale",
         "0.05"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            break
        except OSError:
            assert time.monotonic() < deadline and process.poll() is None, "no engine"
            time.sleep(0.1)
    yield f"https://127.0.0.1:{port}", cert.read_text()
    process.terminate()
    process.wait(10)


@pytest.fixture(scope="module")
def impostor_pem(tmp_path_factory):
    """Another agent's certificate: what a machine on the path would present."""
    _, cert = agent_tls.ensure_certificate(tmp_path_factory.mktemp("impostor"))
    return cert.read_text()


async def _get(url: str, pin: str = "") -> httpx.Response:
    async with httpx.AsyncClient(transport=upstream.Transport(), timeout=10) as client:
        return await client.get(url, extensions=engine_tls.extensions(pin))


def test_the_agent_makes_its_certificate_once_and_keeps_its_key_to_itself(tmp_path):
    argv = ["vllm", "serve", "m", "--ssl-keyfile", agent_tls.TLS_KEY, "--ssl-certfile",
            agent_tls.TLS_CERT]
    filled = agent_tls.argv_with_tls(argv, tmp_path)
    assert filled[-3:] == [str(tmp_path / agent_tls.KEY_FILE), "--ssl-certfile",
                           str(tmp_path / agent_tls.CERT_FILE)]
    assert stat.S_IMODE((tmp_path / agent_tls.KEY_FILE).stat().st_mode) == 0o600
    made = (tmp_path / agent_tls.CERT_FILE).read_bytes()
    assert agent_tls.argv_with_tls(argv, tmp_path) == filled
    assert (tmp_path / agent_tls.CERT_FILE).read_bytes() == made  # made once
    assert agent_tls.argv_with_tls(["llama-server"], tmp_path) == ["llama-server"]


def test_the_agent_reads_the_certificate_the_engine_presents(tls_engine):
    url, pem = tls_engine
    assert agent_tls.presented_certificate(url + "/v1") == pem
    assert agent_tls.presented_certificate(url.replace("https", "http")) is None


def test_the_proxys_transport_speaks_tls_to_the_pinned_certificate_only(tls_engine,
                                                                         impostor_pem):
    url, pem = tls_engine
    assert asyncio.run(_get(url + "/v1/models", pem)).status_code == 200
    # Another certificate at that address: refused at the handshake, nothing sent.
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        asyncio.run(_get(url + "/v1/models", impostor_pem))
    # No certificate to pin to: not sent at all, rather than sent unchecked.
    with pytest.raises(httpx.ConnectError, match="no certificate to pin"):
        asyncio.run(_get(url + "/v1/models"))


def test_health_checks_and_load_tests_pin_it_too(tls_engine, impostor_pem):
    url, pem = tls_engine

    async def health(certificate):
        async with httpx.AsyncClient(transport=upstream.Transport()) as client:
            return await services._check(client, url, "", certificate)

    assert asyncio.run(health(pem))[0] == ""
    assert "CERTIFICATE_VERIFY_FAILED" in asyncio.run(health(impostor_pem))[0]
    result = asyncio.run(loadtest.run_load_test(url, levels=(1,), caches=False,
                                                tls_certificate=pem))
    assert result.levels and result.levels[0].tokens_per_s > 0
    with pytest.raises(httpx.ConnectError):
        asyncio.run(loadtest.run_load_test(url, levels=(1,), caches=False,
                                           tls_certificate=impostor_pem))
    with pytest.raises(httpx.ConnectError):  # an https:// engine with no certificate reported
        asyncio.run(loadtest.run_load_test(url, levels=(1,), caches=False))


@pytest.mark.parametrize("pem, valid", [
    (None, True),
    ("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n",
     False),
    ("a certificate, believe me", False),
])
def test_a_reported_certificate_must_be_one(pem, valid):
    report = {"url": "https://203.0.113.7:8000", "reachable": True, "tls_certificate": pem}
    assert EngineReportSerializer(data=report).is_valid() is valid


def test_a_reported_certificate_is_kept_in_one_form(tls_engine):
    _, pem = tls_engine
    report = {"url": "https://203.0.113.7:8000", "reachable": True,
              "tls_certificate": "\n\n" + pem.replace("\n", "\r\n") + "  \n"}
    serializer = EngineReportSerializer(data=report)
    assert serializer.is_valid(), serializer.errors
    assert serializer.validated_data["tls_certificate"] == pem


def test_a_certificate_asked_for_at_once_is_made_once_key_and_certificate_a_pair(tmp_path):
    """The agent's heartbeat thread (which shows the command) and its supervisor (which starts
    the engine) ask at the same moment; so may two agents on one state directory."""
    import threading

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    barrier = threading.Barrier(8)

    def ask():
        barrier.wait()
        agent_tls.ensure_certificate(tmp_path)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    key = serialization.load_pem_private_key((tmp_path / agent_tls.KEY_FILE).read_bytes(), None)
    cert = x509.load_pem_x509_certificate((tmp_path / agent_tls.CERT_FILE).read_bytes())
    assert cert.public_key().public_numbers() == key.public_key().public_numbers()
