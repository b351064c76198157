"""Eligibility is pure: plain values in, workers out (the order among them: routing/balancer.py,
tests/routing/test_balancer.py)."""


from routing.errors import ApiError
from routing.placement import Worker, eligible


def worker(i: int, *, capacity=100.0, verified=True, renter=None, context=32_768) -> Worker:
    return Worker(deployment_id=i, ref=f"deployment:{i}", node_id=i, provider_id=1,
                  url=f"http://w{i}", engine="vllm", engine_model="m", quantization="",
                  max_context=context, capacity_tps=capacity, verified=verified,
                  renter_id=renter)


def test_unverified_flagged_and_rented_workers_get_no_shared_traffic():
    workers = [worker(1, verified=False), worker(2, capacity=0), worker(3, renter=9),
               worker(4)]
    assert [w.deployment_id for w in eligible(workers, user_id=5, context_needed=100,
                                              model_context=32_768)] == [4]
    alone = eligible(workers[:3], user_id=5, context_needed=100, model_context=32_768)
    assert isinstance(alone, ApiError) and (alone.status, alone.code) == (503, "no_capacity")


def test_a_renters_own_card_serves_them_first_verified_or_not():
    mine = worker(3, renter=5, verified=False, capacity=0)
    found = eligible([worker(1), mine], user_id=5, context_needed=100, model_context=32_768)
    assert list(found) == [mine]


def test_a_card_rented_by_two_renters_serves_neither():
    shared = worker(3, renter=-1)
    assert isinstance(eligible([shared], user_id=5, context_needed=10, model_context=10),
                      ApiError)


def test_context_must_hold_prompt_and_completion():
    small, big = worker(1, context=4096), worker(2, context=131_072)
    assert list(eligible([small, big], user_id=5, context_needed=8000,
                         model_context=131_072)) == [big]
    refusal = eligible([small], user_id=5, context_needed=8000, model_context=131_072)
    assert (refusal.status, refusal.code) == (400, "context_length_exceeded")
    assert "4096" in refusal.message


def test_an_open_circuit_takes_a_worker_out():
    found = eligible([worker(1), worker(2)], user_id=5, context_needed=10, model_context=100,
                     open_ids={1})
    assert [w.deployment_id for w in found] == [2]
