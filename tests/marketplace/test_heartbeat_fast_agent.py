"""The heartbeat fast path with the real node agent (`python -m fleetsim agent ... run`): its
engine supervised, engine versions, NVLink and GPU power in its reports. Once its machine is
verified and nothing changes, its repeated heartbeats are answered at the ASGI front from
Redis, not by the full path: a report that turns new every time (a field that moves, a key
order, a timestamp) would cost the platform ~60x the CPU per agent, silently."""

import json
import time

import pytest

from config import redis as config_redis
from marketplace import heartbeat_fast
from marketplace.models import Node
from tests.agents import Agents, verify, wait_for
from tests.marketplace.test_heartbeat_fast import platform  # noqa: F401
from verification import loadtest
from verification import yardstick as ys

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

LEVELS = (1, 8)


def fast_beats(node_id: int) -> int:
    """Heartbeats of this node the fast path answered and has not flushed yet."""
    beats = config_redis.redis_client().hgetall(heartbeat_fast.BEATS)
    return sum(int(n) for field, n in beats.items()
               if field.decode().split(":")[0] == str(node_id))


def test_the_agents_repeated_report_takes_the_fast_path(platform, settings, monkeypatch,  # noqa: F811
                                                          bob, tmp_path, gpu_specs):
    settings.RIGSHARE_HEARTBEAT_INTERVAL_S = 1
    settings.RIGSHARE_LOAD_TEST_LEVELS = LEVELS
    monkeypatch.setattr(ys, "LEVELS", LEVELS)
    monkeypatch.setattr(loadtest, "OUTPUT_TOKENS", 48)
    monkeypatch.setattr(loadtest, "PREFIX_WORDS", 400)
    with Agents(platform.url, bob, tmp_path) as agents:
        # An H200 (NVLink, power read by the probes), an engine the agent runs.
        node_id = agents.start("h200", "h200-1")
        run = verify(node_id)
        assert run.status == "done", run.error
        node = wait_for("the provider's engine back from the yardstick", lambda: (
            n if (n := Node.objects.get(pk=node_id)).engine_takes_work
            and not n.engine_on_yardstick else None))
        # What the report carries that a repeat must carry the same way.
        assert node.engine_process["state"] == "ready" and node.engine_process["argv"]
        assert node.engine_versions, "the agent reports the engines installed"
        card = node.cards.get()
        assert card.nvlink_links and card.power_limit_w

        # Quiet from here on: every heartbeat but the full one that stores the entry comes
        # back from Redis, and PostgreSQL's copy of the node does not move.
        wait_for("a repeat answered from Redis", lambda: fast_beats(node_id), timeout=30)
        stored = Node.objects.get(pk=node_id).last_heartbeat_at
        before = fast_beats(node_id)
        time.sleep(5)
        answered = fast_beats(node_id) - before
        assert answered >= 3, f"{answered} fast heartbeats in 5 s at a 1 s interval"
        assert Node.objects.get(pk=node_id).last_heartbeat_at == stored, "a full heartbeat"
        entry = json.loads(config_redis.redis_client().get(
            heartbeat_fast.entry_key(node.credential_prefix)))
        assert entry["node"] == node_id
