"""A real agent runs its engine over HTTPS with the certificate it made and reports it; the
platform pins it, renters' requests reach the engine over TLS through the real server, and
where TLS is required (production) an engine reached in clear text gets no shared traffic and
its machine page says so."""

import hashlib
import ssl

import httpx
import pytest
from django.test import Client

from agent import engine_tls as agent_tls
from marketplace.models import Card, Node
from routing.models import Deployment, RequestLog
from routing.pool import POOL
from tests.agents import Agents, wait_for
from tests.routing.conftest import MODEL
from verification.models import VerificationRun, VerifiedCapacity

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def asked(v1: str, key: str, n: int = 0) -> int:
    """A new conversation each `n` (one conversation stays on its worker)."""
    return httpx.post(f"{v1}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "max_tokens": 8,
                            "messages": [{"role": "user", "content": f"Hello, {n}"}]},
                      timeout=60).status_code


def verified(node_id: int) -> None:
    run = VerificationRun.objects.create(node_id=node_id, trigger="enrolment", status="done",
                                         model="Qwen/Qwen3-27B")
    for card in Card.objects.filter(node_id=node_id):
        VerifiedCapacity.objects.create(card=card, model="Qwen/Qwen3-27B", tokens_per_s=1000.0,
                                        run=run)
    Card.objects.filter(node_id=node_id).update(verification_status="verified")


def test_renters_requests_reach_the_engine_over_tls_pinned_to_the_agents_certificate(
        v1, rigshare_server, model, carol_key, settings, bob, tmp_path, settled):
    settings.RIGSHARE_HEARTBEAT_INTERVAL_S = 1
    settings.RIGSHARE_ENGINE_TLS_REQUIRED = True
    with Agents(rigshare_server.url, bob, tmp_path) as agents:
        sealed = agents.start("rtx-pro-6000", "sealed-1", engine_key=True, engine_tls=True)
        clear = agents.start("rtx-pro-6000", "clear-1", engine_key=True)
        wait_for("both engines serving, the sealed one's certificate pinned", lambda: (
            Deployment.objects.filter(node_id__in=[sealed, clear]).count() == 2
            and Node.objects.get(pk=sealed).engine_encrypted
            and all(n.engine_key_fingerprint for n in Node.objects.filter(
                pk__in=[sealed, clear]))), timeout=90)
        node = Node.objects.get(pk=sealed)
        made = (tmp_path / "sealed-1.engine" / agent_tls.CERT_FILE).read_text()
        assert node.engine_url.startswith("https://") and node.engine_tls_certificate == made
        assert node.engine_tls_fingerprint == hashlib.sha256(
            ssl.PEM_cert_to_DER_cert(made)).hexdigest()
        assert not Node.objects.get(pk=clear).engine_encrypted
        for node_id in (sealed, clear):
            verified(node_id)
        POOL.invalidate()
        for n in range(8):
            assert asked(v1, carol_key, n) == 200
        settled()
        served = set(RequestLog.objects.values_list("deployment_id", flat=True))
        assert served == set(Deployment.objects.filter(node_id=sealed)
                             .values_list("pk", flat=True))
        # The engine speaks TLS only: in clear text it answers nothing.
        with pytest.raises(httpx.HTTPError):
            httpx.get(node.engine_url.replace("https://", "http://") + "/v1/models", timeout=5)

        # The machine pages say which is which.
        page = Client()
        page.force_login(bob)
        sealed_page = page.get(f"/provider/machines/{sealed}/").content.decode()
        clear_page = page.get(f"/provider/machines/{clear}/").content.decode()
        assert "Encrypted: the platform reaches the engine over TLS" in sealed_page
        assert node.engine_tls_fingerprint in sealed_page
        assert "Not encrypted" in clear_page and "It gets no shared traffic" in clear_page

        # Without the requirement (outside production), the clear one serves too.
        settings.RIGSHARE_ENGINE_TLS_REQUIRED = False
        POOL.invalidate()
        for n in range(8, 32):
            assert asked(v1, carol_key, n) == 200
        settled()
        assert set(RequestLog.objects.values_list("deployment_id", flat=True)) == set(
            Deployment.objects.filter(node_id__in=[sealed, clear]).values_list("pk", flat=True))
