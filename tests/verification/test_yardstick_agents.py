"""The yardstick through the whole pipeline: real node agents (`python -m fleetsim agent ... run`)
that run their simulated engines as their children report to the live platform; the platform
probes them, load-tests each provider's engine, has the agent switch its engine to the
yardstick and back, load-tests that, judges and publishes. The engines run in real time: what
is judged is tokens/s, and a faster clock would inflate them.

The machines are liars of kinds the verification benchmark plants too (fleetsim/profiles.py),
each beside the honest machines that must stay verified.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from marketplace.models import Card, Node
from tests.agents import Agents, verify, wait_for
from verification import loadtest
from verification import yardstick as ys
from verification.models import Finding, Measurement, VerificationRun

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

LEVELS = (1, 8)  # enough for one stream and a batch; 32 streams of the Mac would take minutes


@pytest.fixture
def fleet(live_server, settings, monkeypatch, bob, tmp_path, gpu_specs):
    """fleet(profile key, machine id, own_engine=True) enrols a simulated machine of bob's and
    starts its agent; every agent is stopped at the end (its log shown when a test fails)."""
    settings.RIGSHARE_HEARTBEAT_INTERVAL_S = 1
    settings.RIGSHARE_LOAD_TEST_LEVELS = LEVELS
    settings.RIGSHARE_YARDSTICK_READY = timedelta(seconds=60)
    monkeypatch.setattr(ys, "LEVELS", LEVELS)
    monkeypatch.setattr(loadtest, "OUTPUT_TOKENS", 48)
    monkeypatch.setattr(loadtest, "PREFIX_WORDS", 400)
    with Agents(live_server.url, bob, tmp_path) as agents:
        yield agents.start


def verdict(node_id: int) -> str:
    return Card.objects.filter(node_id=node_id).first().verification_status


def findings(node_id: int) -> dict[str, Finding]:
    run = VerificationRun.objects.filter(node_id=node_id, status="done").first()
    card = Card.objects.filter(node_id=node_id).first()
    return {f.metric: f for f in Finding.objects.filter(run=run, card=card)}


def test_the_engine_serves_the_yardstick_and_comes_back(fleet):
    honest = fleet("2x-rtx-5090", "pair-1")
    run = verify(honest)
    assert run.yardstick_state == "done", run.yardstick_note
    assert run.yardstick == "meta-llama/Llama-3.1-8B-Instruct/fp8/vllm"
    assert set(Measurement.objects.filter(run=run, metric__startswith="ytps@")
               .values_list("metric", flat=True)) == {f"ytps@{n}" for n in LEVELS}
    # The provider's engine is back, with its own command, and takes work again; its return
    # is no new configuration to verify.
    node = wait_for("the provider's engine back", lambda: (
        n if (n := Node.objects.get(pk=honest)).engine_takes_work
        and not n.engine_on_yardstick else None))
    assert node.engine_models == ["Qwen/Qwen3-27B"]
    assert VerificationRun.objects.filter(node_id=honest).count() == 1
    found = findings(honest)
    assert found["yardstick"].severity == "ok", found["yardstick"].message
    assert found["serving"].severity == "ok", found["serving"].message
    assert verdict(honest) == "verified"


def test_liars_that_only_the_yardstick_can_catch(fleet):
    """Verified in the order that is hardest: the liars before the honest machines they could
    be compared with, each twin before the other."""
    machines = {
        "nosize": fleet("liar-nosize-5090x2", "nosize-1"),
        "twin-1": fleet("liar-twin-5090-24b", "twin-1"),
        "twin-2": fleet("liar-twin-5090-24b", "twin-2"),
        "slow-mac": fleet("liar-slow-m4", "slow-mac-1"),
        "three": fleet("liar-3x4090", "three-1"),
        "mac": fleet("m4-max-llamacpp", "mac-1"),
        "pair": fleet("2x-rtx-5090", "pair-1"),
        "by-hand": fleet("2x-rtx-4090", "by-hand-1", own_engine=False),
    }
    for node_id in machines.values():
        verify(node_id)
    found = {name: findings(node_id) for name, node_id in machines.items()}
    status = {name: verdict(node_id) for name, node_id in machines.items()}

    # The honest: verified (a Mac has no probes: its serving is what is verified).
    assert status["pair"] == "verified", found["pair"]["serving"].message
    assert status["mac"] == "serving_verified", found["mac"]["serving"].message
    # The engine its provider runs by hand served no yardstick: never plain "verified".
    assert status["by-hand"] == "not_judged"
    assert found["by-hand"]["yardstick"].severity == "not_measured"
    assert "by hand" in found["by-hand"]["serving"].message

    # The model whose name states no size: sized from its files, judged on its own model
    # against what its yardstick says the pair turns into tokens.
    assert status["nosize"] == "flagged"
    assert found["nosize"]["yardstick"].severity == "ok"
    nosize = found["nosize"]["serving"]
    assert nosize.severity == "mismatch" and nosize.basis == "calibrated", nosize.message
    assert "config.json" in nosize.message
    # Two slow twins with only each other: both flagged, on their own model.
    for twin in ("twin-1", "twin-2"):
        assert status[twin] == "flagged"
        assert found[twin]["serving"].severity == "mismatch", found[twin]["serving"].message
        assert found[twin]["serving"].basis == "calibrated"
    # A GPU count nobody else has, slow at everything: its yardstick gives it away.
    assert status["three"] == "flagged"
    assert found["three"]["yardstick"].severity == "mismatch", found["three"]["yardstick"].message
    # The slow Mac, beside an honest one: flagged on its yardstick, the honest Mac its peer.
    assert status["slow-mac"] == "flagged"
    assert found["slow-mac"]["yardstick"].severity == "mismatch"
    assert found["slow-mac"]["yardstick"].basis == "peers", found["slow-mac"]["yardstick"].message
