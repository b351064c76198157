"""Verification that never stops, through the whole pipeline: a real node agent runs its simulated
engine as its child and reports to the platform (uvicorn on a thread, serving /v1 too); the
machine is verified, then swaps in an engine at 30% of its speed. With traffic flowing through
/v1, the minute's refresh of the live figures sees it: routing weighs it by what it serves, a
run starts, and the run's own measurement confirms it: the card is flagged with the served
figures. The engine runs in real time: what is judged is tokens/s."""

import time
from datetime import timedelta

import httpx
import pytest

from marketplace.models import Card, ProviderAlert
from routing import placement, pool, served
from routing.pool import POOL
from tests.agents import Agents, verify, wait_for
from tests.routing.conftest import MODEL
from tests.routing.test_drift import traffic_for
from verification import loadtest
from verification.models import ServedDrift, VerificationRun, VerifiedCapacity

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

# From the switch to the card flagged: traffic enough to be sure (MIN_STREAMS slow streams,
# ~30 s), one refresh, the run's probes, load test and yardstick (~2 minutes here).
BOUND_S = 300


def test_an_engine_that_slows_after_it_was_verified_is_flagged_on_its_served_traffic(
        v1, rigshare_server, model, carol_key, settings, monkeypatch, bob, tmp_path,
        gpu_specs, settled):
    settings.RIGSHARE_HEARTBEAT_INTERVAL_S = 1
    settings.RIGSHARE_YARDSTICK_READY = timedelta(seconds=60)
    monkeypatch.setattr(loadtest, "OUTPUT_TOKENS", 48)
    monkeypatch.setattr(loadtest, "PREFIX_WORDS", 400)
    with Agents(rigshare_server.url, bob, tmp_path) as agents:
        node_id = agents.start("2x-rtx-5090", "pair-1")
        verify(node_id)
        cards = Card.objects.filter(node_id=node_id)
        assert {c.verification_status for c in cards} == {"verified"}
        wait_for("its engine back in the pool, verified", lambda: (
            (fleet := pool.build().workers.get(MODEL)) is not None
            and placement.shares(fleet).any()), timeout=30)
        POOL.invalidate()  # the server's routers read it now (in production: within 2 s)
        before = sum(pool.build().workers[MODEL].cols["capacity"])

        # Honest traffic first: nothing to act on.
        traffic_for(v1, carol_key, concurrency=4, streams=12)
        settled()
        assert served.served_figures_refresh()["drifts"] == 0

        engine = f"http://127.0.0.1:{agents.machines[node_id].port}"
        assert httpx.post(f"{engine}/fleetsim/speed", json={"factor": 0.3}).status_code == 200
        switched = time.monotonic()
        traffic_for(v1, carol_key, concurrency=4, streams=32)
        settled()
        assert served.served_figures_refresh()["drifts"] == 1
        episode = ServedDrift.objects.get(node_id=node_id)
        assert (episode.band, episode.level) == (2, 8)
        # What routing weighs it by drops to what it serves; the run and the alert are out.
        after = sum(pool.build().workers[MODEL].cols["capacity"])
        assert after < 0.7 * before
        assert sum(VerifiedCapacity.objects.filter(card__node_id=node_id)
                   .values_list("routing_tps", flat=True)) == pytest.approx(after)
        run = VerificationRun.objects.get(node_id=node_id, trigger="served_traffic")
        assert ProviderAlert.objects.filter(node_id=node_id, kind="served_slow").exists()

        verify(node_id, run)
        assert {c.verification_status for c in cards.all()} == {"flagged"}
        finding = run.findings.get(metric="served", card=cards.first())
        assert finding.severity == "mismatch", finding.message
        assert "Confirmed" in finding.message and "per stream" in finding.measured
        episode.refresh_from_db()
        assert episode.outcome == "confirmed" and episode.closed_at is not None
        assert time.monotonic() - switched < BOUND_S
