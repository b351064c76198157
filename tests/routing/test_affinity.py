"""Affinity through the real server: every turn of a conversation goes to the worker that
answered its first, conversations spread over the workers by verified capacity, a client's
session header names its own conversation, and the answer says what happened."""

from collections import Counter

import httpx
import pytest

from routing.retry import BREAKER, POLICY
from tests.routing.conftest import MODEL

pytestmark = pytest.mark.django_db(transaction=True)

SYSTEM = {"role": "system", "content": "You are a careful assistant for GPU buyers."}


def turn(v1, key, messages, **headers):
    response = httpx.post(f"{v1}/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": messages, "max_tokens": 4},
                          headers={"Authorization": f"Bearer {key}", **headers})
    assert response.status_code == 200, response.text
    return response


def test_follow_ups_stay_on_the_worker_that_holds_the_conversation(v1, engine, deploy,
                                                                     carol_key, settled):
    pro = deploy(engine("rtx-pro-6000"), "rtx-pro-6000")
    pair = deploy(engine("2x-rtx-4090"), "2x-rtx-4090")
    firsts: Counter = Counter()
    for c in range(40):
        messages = [SYSTEM, {"role": "user", "content": f"Conversation {c}: compare cards."}]
        first = turn(v1, carol_key, messages)
        assert first.headers["X-Rigshare-Affinity"] == "new"
        worker = first.headers["X-Rigshare-Worker"]
        firsts[worker] += 1
        for t in range(2):
            messages += [{"role": "assistant", "content": "An answer."},
                         {"role": "user", "content": f"Follow-up {t}."}]
            later = turn(v1, carol_key, messages)
            assert later.headers["X-Rigshare-Worker"] == worker
            assert later.headers["X-Rigshare-Affinity"] == "hit"
    # Both take conversations, the PRO 6000 (1,342 tok/s at 32) most of them.
    assert set(firsts) == {f"deployment:{pro.pk}", f"deployment:{pair.pk}"}
    assert firsts[f"deployment:{pro.pk}"] > firsts[f"deployment:{pair.pk}"]
    settled()


def test_a_session_header_keeps_unrelated_requests_together(v1, engine, deploy, carol_key,
                                                            settled):
    deploy(engine("rtx-pro-6000"), "rtx-pro-6000")
    deploy(engine("2x-rtx-4090"), "2x-rtx-4090")
    workers = {turn(v1, carol_key, [{"role": "user", "content": f"Question {i}"}],
                    **{"X-Session-ID": "agent-run-42"}).headers["X-Rigshare-Worker"]
               for i in range(8)}
    assert len(workers) == 1
    settled()


def test_a_turn_answered_elsewhere_takes_the_conversation_with_it(v1, engine, deploy,
                                                                   carol_key, settled):
    # Two workers alike; the conversation's own worker is held out for one turn (its circuit
    # open after failures), so another answers it and holds the longer history from then on.
    deployments = [deploy(engine("rtx-pro-6000"), "rtx-pro-6000") for _ in range(2)]
    messages = [SYSTEM, {"role": "user", "content": "Which card for a 70B model at 32k?"}]
    own = turn(v1, carol_key, messages).headers["X-Rigshare-Worker"]
    own_id = int(own.split(":")[1])
    other = next(f"deployment:{d.pk}" for d in deployments if d.pk != own_id)
    for _ in range(POLICY.breaker_failures):
        BREAKER.failure(own_id)
    messages += [{"role": "assistant", "content": "An answer."},
                 {"role": "user", "content": "And at 128k?"}]
    assert turn(v1, carol_key, messages).headers["X-Rigshare-Worker"] == other
    settled()
    BREAKER.success(own_id)  # back, and the key still ranks it first
    for t in range(3):
        messages += [{"role": "assistant", "content": "Another answer."},
                     {"role": "user", "content": f"Follow-up {t}."}]
        later = turn(v1, carol_key, messages)
        assert (later.headers["X-Rigshare-Worker"], later.headers["X-Rigshare-Affinity"]) == (
            other, "hit")
        settled()
    # A new conversation that starts the same way (the same key) has no history to follow: it
    # starts on its key's own worker.
    fresh = [SYSTEM, {"role": "user", "content": "Which card for a 70B model at 32k?"}]
    assert turn(v1, carol_key, fresh).headers["X-Rigshare-Worker"] == own
