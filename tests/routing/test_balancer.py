"""The balancer (routing/balancer.py) with plain values: weighted rendezvous hashing gives each
worker its weight's share of keys, moves only the keys it must when the fleet changes, bounds
every worker's load, and two processes that never talk rank alike."""

import json
import os
import random
import subprocess
import sys
from collections import Counter
from dataclasses import replace

from routing import balancer
from routing.balancer import Affinity
from routing.placement import Fleet, Worker

PRO_6000, PAIR_4090 = 1342.0, 435.0  # tok/s at 32 concurrent (published fleet figures)


def worker(deployment_id: int, capacity: float) -> Worker:
    return Worker(deployment_id=deployment_id, ref=f"deployment:{deployment_id}",
                  node_id=deployment_id, provider_id=1, url="http://engine", engine="vllm",
                  engine_model="m", quantization="fp8", max_context=32_768,
                  capacity_tps=capacity, verified=True, renter_id=None)


def keys(n: int, seed: int = 7) -> list[Affinity]:
    rng = random.Random(seed)
    return [Affinity(rng.randbytes(16), True) for _ in range(n)]


def first(workers, key) -> int:
    return balancer.place(workers, key, {}).workers[0].deployment_id


def test_each_worker_gets_its_weights_share_of_keys_within_2_percent():
    fleet = [worker(1, PRO_6000), worker(2, PAIR_4090), worker(3, 900.0), worker(4, 96.0)]
    weights = {w.deployment_id: balancer.weight(w) for w in fleet}
    total = sum(weights.values())
    n = 200_000
    got = Counter(first(fleet, k) for k in keys(n))
    for deployment_id, wt in weights.items():
        expected = wt / total
        assert abs(got[deployment_id] / n - expected) / expected < 0.02, (deployment_id, got)


def test_a_weight_change_moves_only_the_keys_it_must():
    fleet = [worker(i, 400.0 + 100 * i) for i in range(1, 6)]
    sample = keys(20_000)
    before = {k.key: first(fleet, k) for k in sample}
    heavier = [replace(w, capacity_tps=w.capacity_tps * 2) if w.deployment_id == 3 else w
               for w in fleet]
    after = {k.key: first(heavier, k) for k in sample}
    moved = [k for k in before if before[k] != after[k]]
    assert moved and all(after[k] == 3 for k in moved)  # only towards the heavier worker
    w3_before = sum(1 for v in before.values() if v == 3)
    # It gains what its doubled share says, nothing more: 2w/(W+w) of the keys after.
    total = sum(balancer.weight(w) for w in fleet)
    w3 = balancer.weight(fleet[2])
    expected = 2 * w3 / (total + w3) * len(sample) - w3_before
    assert abs(len(moved) - expected) / expected < 0.1


def test_a_worker_removed_moves_only_its_own_keys_and_one_added_takes_only_its_share():
    fleet = [worker(i, 500.0) for i in range(1, 9)]
    sample = keys(20_000)
    before = {k.key: first(fleet, k) for k in sample}
    without_5 = [w for w in fleet if w.deployment_id != 5]
    after = {k.key: first(without_5, k) for k in sample}
    assert {k for k in before if before[k] != after[k]} == {k for k in before if before[k] == 5}
    added = fleet + [worker(9, 500.0)]
    after = {k.key: first(added, k) for k in sample}
    moved = [k for k in before if before[k] != after[k]]
    assert all(after[k] == 9 for k in moved)
    assert abs(len(moved) / len(sample) - 1 / 9) < 0.01


def test_a_remeasurement_a_few_percent_off_changes_no_weight():
    steps = {balancer.weight(worker(1, c)) for c in (1342.0, 1342.0 * 1.03, 1342.0 * 0.97)}
    assert len(steps) <= 2  # at most one grid step, and mostly none
    unchanged = sum(balancer.weight(worker(1, c)) == balancer.weight(worker(1, c * 1.02))
                    for c in range(100, 5000, 7))
    assert unchanged / len(range(100, 5000, 7)) > 0.7


def test_the_load_bound_spills_a_busy_worker_and_retries_in_ranking_order():
    fleet = [worker(1, PRO_6000), worker(2, PAIR_4090), worker(3, 900.0)]
    key = keys(1)[0]
    ranking = balancer.rank(fleet, key.key)
    idle = balancer.place(fleet, key, {}, limit=3)
    assert idle.workers == tuple(ranking) and idle.affinity == balancer.HIT
    busy = {ranking[0].deployment_id: 40}
    spilled = balancer.place(fleet, key, busy, limit=3)
    assert spilled.affinity == balancer.SPILL
    assert spilled.workers == (ranking[1], ranking[2], ranking[0])


def test_no_worker_ever_exceeds_its_bound_under_a_hot_key():
    """One key with 10x the traffic of the others: placed one request at a time as they
    arrive (each stays in flight), no worker's load passes LOAD_FACTOR x its share + slack."""
    fleet = [worker(1, PRO_6000), worker(2, PAIR_4090), worker(3, 900.0), worker(4, 300.0)]
    weights = {w.deployment_id: balancer.weight(w) for w in fleet}
    hot, others = keys(1, seed=1)[0], keys(30, seed=2)
    load: Counter = Counter()
    rng = random.Random(3)
    for _ in range(600):
        key = hot if rng.random() < 10 / 40 else rng.choice(others)
        share = (sum(load.values()) + 1) / sum(weights.values())
        chosen = balancer.place(fleet, key, load).workers[0].deployment_id
        assert load[chosen] + 1 <= balancer.LOAD_FACTOR * share * weights[chosen] + \
            balancer.LOAD_SLACK
        load[chosen] += 1
        if rng.random() < 0.3 and load:  # some finish
            done = rng.choice(list(load.elements()))
            load[done] -= 1


def test_past_its_verified_concurrency_a_worker_yields_to_any_free_slot():
    """32 slots each (the concurrency their capacity was verified at): the PRO 6000 full, the
    pair over its load bound but with slots free: the pair answers sooner than the PRO's
    queue. Every worker full: the load bound decides again."""
    pro, pair = replace(worker(1, PRO_6000), slots=32), replace(worker(2, PAIR_4090), slots=32)
    key = next(k for k in keys(100) if balancer.rank([pro, pair], k.key)[0] == pro)
    assert first([pro, pair], key) == 1
    assert balancer.place([pro, pair], key, {1: 32, 2: 21}).workers[0] == pair
    assert balancer.place([pro, pair], key, {1: 32, 2: 32}).workers[0] == pro
    unverified = replace(pro, slots=0)  # no verified concurrency: no slot limit
    assert balancer.place([unverified, pair], key, {1: 40, 2: 21}).workers[0] == unverified


def test_router_processes_split_the_free_slots_they_cannot_see_each_other_fill():
    """Two equal workers of 32 slots; as two processes last exchanged it, A runs 30 and B 20.
    Each process may fill half of A's two free slots before the next exchange: its first
    request for A's key goes to A, its second to B. Alone, it may fill both."""
    a, b = replace(worker(1, 435.0), slots=32), replace(worker(2, 435.0), slots=32)
    key = next(k for k in keys(100) if balancer.rank([a, b], k.key)[0] == a)
    for routers, second in ((2, b), (1, a)):
        fleet = Fleet([a, b]).with_load({1: 30, 2: 20}, routers)
        assert balancer.place(fleet, key).workers[0] == a
        assert balancer.place(fleet, key, {1: 1}).workers[0] == second


def test_two_independent_processes_agree_on_10000_keys():
    fleet = [worker(i, c) for i, c in enumerate((PRO_6000, PAIR_4090, 900.0, 250.0, 1700.0),
                                                start=11)]
    sample = keys(10_000)
    mine = [first(fleet, k) for k in sample]
    program = (
        "import json, sys\n"
        "from routing import balancer\n"
        "from tests.routing.test_balancer import fleet_from, first\n"
        "data = json.load(sys.stdin)\n"
        "fleet = fleet_from(data['fleet'])\n"
        "keys = [balancer.Affinity(bytes.fromhex(k), True) for k in data['keys']]\n"
        "print(json.dumps([first(fleet, k) for k in keys]))\n")
    theirs = subprocess.run(
        [sys.executable, "-c", program], check=True, capture_output=True, text=True,
        input=json.dumps({"fleet": [[w.deployment_id, w.capacity_tps] for w in fleet],
                          "keys": [k.key.hex() for k in sample]}),
        env=os.environ | {"PYTHONHASHSEED": "12345"},
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert json.loads(theirs.stdout) == mine


def fleet_from(rows) -> list[Worker]:
    return [worker(deployment_id, capacity) for deployment_id, capacity in rows]


def _chat(*turns, system="You are a helpful assistant.", user=None):
    body = {"model": "m", "messages": [{"role": "system", "content": system}]}
    for role, content in turns:
        body["messages"].append({"role": role, "content": content})
    if user:
        body["user"] = user
    return body


def test_every_turn_of_a_conversation_shares_its_key_and_only_it():
    first_turn = _chat(("user", "Summarise this long report ..."))
    later = _chat(("user", "Summarise this long report ..."), ("assistant", "It says ..."),
                  ("user", "And the figures?"))
    other = _chat(("user", "Translate this other text ..."))
    a, b, c = (balancer.affinity(x, "chat") for x in (first_turn, later, other))
    assert a.key == b.key != c.key  # the same system prompt is not the same conversation
    assert (a.follow_up, b.follow_up) == (False, True)


def test_a_session_or_user_the_client_names_is_the_key():
    one = _chat(("user", "hello"), user="alice-session-1")
    two = _chat(("user", "something else entirely"), user="alice-session-1")
    assert balancer.affinity(one, "chat").key == balancer.affinity(two, "chat").key
    assert balancer.affinity(one, "chat", session="s-9").key == \
        balancer.affinity(two, "chat", session="s-9").key != balancer.affinity(one, "chat").key


def test_a_completion_is_keyed_by_the_start_of_its_prompt():
    head = "x" * balancer.PROMPT_KEY_CHARS
    a = balancer.affinity({"prompt": head + "one ending"}, "completions")
    b = balancer.affinity({"prompt": head + "another ending"}, "completions")
    c = balancer.affinity({"prompt": "a different start"}, "completions")
    assert a.key == b.key != c.key and a.follow_up and not c.follow_up


def test_routing_keeps_a_cards_weight_while_re_measurements_stay_within_10_percent():
    from verification.services import routing_capacity

    assert routing_capacity(None, 1342.0) == 1342.0  # first measurement
    assert routing_capacity(1342.0, 1300.0) == 1342.0  # noise: nothing moves
    assert routing_capacity(1342.0, 1420.0) == 1342.0
    assert routing_capacity(1342.0, 1100.0) == 1100.0  # a real change moves what it must
    assert routing_capacity(1342.0, 1700.0) == 1700.0


def test_a_worker_new_to_traffic_ramps_up_in_quarters_never_from_zero():
    assert [balancer.ramp(s) for s in (0, 59, 60, 125, 180, 10**6)] == [
        0.25, 0.25, 0.5, 0.75, 1.0, 1.0]
    old, new = worker(1, 500.0), replace(worker(2, 500.0), ramp=balancer.ramp(0))
    n = 40_000
    got = Counter(first([old, new], k) for k in keys(n))
    assert abs(got[2] / n - 0.25 / 1.25) < 0.01  # a quarter of its weight


def test_a_follow_up_goes_back_to_the_worker_that_served_its_latest_turn():
    fleet = [worker(i, 400.0) for i in range(1, 5)]
    key = keys(1)[0]
    own = first(fleet, key)
    other = next(w.deployment_id for w in fleet if w.deployment_id != own)
    placed = balancer.place(fleet, key, {}, holder=other)
    assert placed.workers[0].deployment_id == other and placed.affinity == balancer.HIT
    assert placed.expected == other  # served there again: nothing to record
    # Its retry is the ranking's own worker, not the holder twice.
    assert placed.workers[1].deployment_id == own
    # Without a holder the next turn is expected on the key's own worker.
    assert balancer.place(fleet, key, {}).expected == own


def test_a_busy_or_vanished_holder_leaves_the_choice_to_the_ranking():
    fleet = [replace(worker(i, 400.0), slots=4) for i in range(1, 5)]
    key = keys(1)[0]
    own = first(fleet, key)
    other = next(w.deployment_id for w in fleet if w.deployment_id != own)
    busy = balancer.place(fleet, key, {other: 4}, holder=other)  # its slots are full
    assert busy.workers[0].deployment_id == own and busy.expected == other
    gone = balancer.place([w for w in fleet if w.deployment_id != other], key, {},
                          holder=other)
    assert gone.workers[0].deployment_id == own and gone.expected == other
