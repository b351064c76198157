"""SECRET_KEY rotates under a live agent (a real agent process reporting every second, its
engine run with the engine key the platform sealed) and a live API key calling /v1 through the
real server: neither notices, through the rotation, the re-seal and the fallback's removal."""

import json
import time

import httpx
import pytest
from django.core.cache import cache
from django.core.management import call_command

from accounts.secrets import secret_digest
from billing import keys
from billing.models import ApiKey
from marketplace import engine_keys
from marketplace.models import Card, Node
from routing.models import Deployment
from routing.pool import POOL
from tests.agents import Agents, wait_for
from tests.routing.conftest import MODEL
from verification.models import VerificationRun, VerifiedCapacity

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

NEW = "the-secret-key-after-the-rotation-9876543210zyxwvutsrqp"


def answered(v1: str, key: str, model: str = MODEL) -> int:
    return httpx.post(f"{v1}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "max_tokens": 8,
                            "messages": [{"role": "user", "content": "Hello"}]},
                      timeout=60).status_code


def reported_since(node_id: int, moment: float) -> bool:
    """A heartbeat from the node was taken (by either path) after `moment`."""
    from config.redis import redis_client
    from marketplace import heartbeat_fast
    node = Node.objects.get(pk=node_id)
    fast = redis_client().hget(heartbeat_fast.LIVE, node_id)
    return bool((node.last_heartbeat_at and node.last_heartbeat_at.timestamp() > moment)
                or (fast and float(fast) > moment))


def test_secret_key_rotates_under_a_live_agent_and_a_live_key(
        v1, rigshare_server, model, carol_key, settings, bob, tmp_path, settled):
    settings.RIGSHARE_HEARTBEAT_INTERVAL_S = 1
    with Agents(rigshare_server.url, bob, tmp_path) as agents:
        node_id = agents.start("rtx-pro-6000", "rotating-1", engine_key=True)
        credential = json.loads((tmp_path / "rotating-1.json").read_text())["credential"]
        wait_for("its engine running with the key the platform sends", lambda: (
            (n := Node.objects.get(pk=node_id)).engine_key_fingerprint
            and not n.engine_key_next
            and Deployment.objects.filter(node_id=node_id).exists()), timeout=60)
        run = VerificationRun.objects.create(node_id=node_id, trigger="enrolment",
                                             status="done", model="Qwen/Qwen3-27B")
        for card in Card.objects.filter(node_id=node_id):
            VerifiedCapacity.objects.create(card=card, model="Qwen/Qwen3-27B",
                                            tokens_per_s=1000.0, run=run)
        Card.objects.filter(node_id=node_id).update(verification_status="verified")
        POOL.invalidate()
        assert answered(v1, carol_key) == 200
        node = Node.objects.get(pk=node_id)
        fingerprint = node.engine_key_fingerprint
        engine_key = engine_keys.unseal(node.engine_key_sealed)
        direct = f"{node.engine_url}/v1"
        assert answered(direct, "not-the-key", "Qwen/Qwen3-27B") == 401  # the engine holds it
        assert answered(direct, engine_key, "Qwen/Qwen3-27B") == 200

        # The new secret, the old one as its fallback; the routers read the engine key again.
        settings.SECRET_KEY_FALLBACKS = [settings.SECRET_KEY]
        settings.SECRET_KEY = NEW
        POOL.invalidate()
        assert answered(v1, carol_key) == 200
        key_row = ApiKey.objects.get()
        assert key_row.digest == secret_digest(carol_key, NEW)
        wait_for("its credential re-hashed on a heartbeat", lambda: (
            Node.objects.get(pk=node_id).credential_digest == secret_digest(credential, NEW)))

        out = call_command("secrets_reseal") or ""
        node = Node.objects.get(pk=node_id)
        assert engine_keys.reseal(node.engine_key_sealed) is None, out

        # The fallback goes: the agent keeps reporting, the key keeps answering, the engine
        # keeps its key (no new one issued, so no restart).
        settings.SECRET_KEY_FALLBACKS = []
        POOL.invalidate()
        cache.delete(keys._cache_key(key_row.digest))
        keys._NEAR.drop(key_row.digest)
        dropped = time.time()
        wait_for("a heartbeat taken after the fallback went", lambda: (
            reported_since(node_id, dropped + 1)), timeout=30)
        assert answered(v1, carol_key) == 200
        node = Node.objects.get(pk=node_id)
        assert node.engine_key_fingerprint == fingerprint and node.engine_key_next == ""
        assert node.credential_revoked_at is None and node.status == Node.Status.ONLINE
        settled()
