"""Affinity through the real server: every turn of a conversation goes to the worker that
answered its first, conversations spread over the workers by verified capacity, a client's
session header names its own conversation, and the answer says what happened."""

from collections import Counter

import httpx
import pytest

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
