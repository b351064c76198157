"""Metering and the ledger on real PostgreSQL: reserve the worst case, settle the real tokens at
the price in force when the request started, give back the rest, and let the database itself
refuse money that does not add up."""

import dataclasses
import socket
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.core.cache import cache
from django.db import DatabaseError, IntegrityError, connection, transaction

from billing import keys, ledger, metering, ratelimit
from billing.keys import KeyInfo, api_key_authenticate, api_key_create, api_key_revoke
from billing.metering import MeteringError, Usage
from billing.models import Account, Charge, Entry, Hold, KeySpend, ModelPrice, Transfer
from billing.services import credits_grant
from routing import errors
from tests.factories import price_at

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("billing_path")]

T0 = datetime(2026, 11, 2, 10, 0, tzinfo=UTC)
MODEL = "llama-3.1-8b-instruct"
IN_PER_MTOK, OUT_PER_MTOK = 150_000, 600_000  # $0.15 and $0.60 per million tokens
PROMPT, MAX_TOKENS = 1_234, 2_000
# ceil((1,234 x 150,000 + 2,000 x 600,000) / 10^6) = ceil(1,385.1)
HOLD = 1_386
# ceil((1,234 x 150,000 + 567 x 600,000) / 10^6) = ceil(525.3); fee 15% of 526 (78.9) rounded
# up, in the platform's favour
COMPLETION, COST, FEE = 567, 526, 79


def answered(exc: MeteringError) -> tuple[int, str]:
    """How /v1 answers a refusal: (status, code)."""
    api = errors.from_billing(exc)
    return api.status, api.code


@pytest.fixture(params=["sql-functions", "python"])
def billing_path(request, monkeypatch):
    """Each test runs on both paths of reserve and settle: one database function call each
    (PostgreSQL in production) and statement by statement (the path SQLite takes)."""
    monkeypatch.setattr(metering, "SQL_FUNCTIONS", request.param == "sql-functions")
    return request.param


def grant(user, micros: int) -> None:
    credits_grant(user=user, amount_micros=micros, idempotency_key=f"test:{uuid.uuid4()}")


def key_for(user, **limits) -> KeyInfo:
    row, _ = api_key_create(user=user, name="test", **limits)
    return KeyInfo.of(row)


def bal(kind: str, user=None) -> int:
    return ledger.balance(kind, user.pk if user else None)


def balances(*users) -> dict:
    """Every account the tests look at, to show that a refusal moved nothing."""
    out = {(kind, None): bal(kind) for kind in (Account.Kind.PLATFORM_REVENUE,
                                                Account.Kind.GRANTS)}
    for user in users:
        for kind in Account.USER_KINDS:
            out[(kind, user.pk)] = bal(kind, user)
    return out


def reserve(key: KeyInfo, request_id: str, *, prompt=PROMPT, max_tokens=MAX_TOKENS, now=T0,
            model=MODEL) -> metering.HoldInfo:
    """What the proxy does: price in force now, worst-case cost, hold it."""
    price = price_at(model, now)
    cost = metering.max_cost_micros(price, prompt_tokens=prompt, max_tokens=max_tokens)
    return metering.reserve(key=key, model=model, price=price, max_cost=cost,
                            request_id=request_id, tokens=prompt + max_tokens, now=now)


def used(key: KeyInfo) -> int:
    return sum(KeySpend.objects.filter(api_key_id=key.key_id).values_list("used_micros",
                                                                          flat=True))


# --- reserve, settle, release ---

def test_reserve_holds_the_worst_case_cost(carol, price):
    grant(carol, 10_000)
    key = key_for(carol)
    hold = reserve(key, "r1")
    assert hold.amount_micros == HOLD
    assert bal(Account.Kind.WALLET, carol) == 10_000 - HOLD
    assert bal(Account.Kind.HOLDS, carol) == HOLD
    row = Hold.objects.get(request_id="r1")
    assert (row.status, row.price_id, row.expires_at) == ("pending", price.pk,
                                                          T0 + metering.HOLD_TTL)


def test_settle_bills_actual_tokens_and_splits_provider_and_fee(carol, bob, price, worker):
    grant(carol, 10_000)
    key = key_for(carol)
    held = reserve(key, "r1")
    charge = metering.settle(hold=held, usage=Usage(PROMPT, COMPLETION), worker=worker,
                             now=T0 + timedelta(seconds=5))
    assert (charge.cost_micros, charge.estimated, charge.capped) == (COST, False, False)
    assert bal(Account.Kind.WALLET, carol) == 10_000 - COST
    assert bal(Account.Kind.HOLDS, carol) == 0
    assert bal(Account.Kind.EARNINGS, bob) == COST - FEE == 447
    assert bal(Account.Kind.PLATFORM_REVENUE) == FEE
    row = Charge.objects.get(request_id="r1")
    assert (row.provider_id, row.worker, row.provider_micros, row.fee_micros) == (
        bob.pk, "card:7", 447, FEE)
    assert Hold.objects.get(request_id="r1").status == "settled"
    legs = dict(Entry.objects.filter(transfer_id=row.transfer_id)
                .values_list("account__kind", "amount_micros"))
    assert legs == {"holds": -HOLD, "wallet": HOLD - COST, "earnings": 447,
                    "platform_revenue": FEE}


def test_one_token_costs_one_micro_dollar_not_zero(carol, price, worker):
    grant(carol, 10_000)
    held = reserve(key_for(carol), "r1", prompt=1, max_tokens=1)  # 0.75 micro-dollars worst case
    assert Hold.objects.get(request_id="r1").amount_micros == 1
    charge = metering.settle(hold=held, usage=Usage(1, 0), worker=worker, now=T0)
    assert charge.cost_micros == 1  # 0.15 rounded up
    assert bal(Account.Kind.WALLET, carol) == 9_999


def test_served_by_the_platform_itself_all_of_it_is_revenue(carol, price):
    grant(carol, 10_000)
    held = reserve(key_for(carol), "r1")
    metering.settle(hold=held, usage=Usage(PROMPT, COMPLETION), worker=None, now=T0)
    assert bal(Account.Kind.PLATFORM_REVENUE) == COST


def test_request_pays_the_price_in_force_when_it_was_reserved(carol, price, worker):
    grant(carol, 100_000)
    key = key_for(carol)
    held = reserve(key, "r1", now=T0)
    newer = ModelPrice.objects.create(model=MODEL, input_micros_per_mtok=IN_PER_MTOK * 10,
                                      output_micros_per_mtok=OUT_PER_MTOK * 10,
                                      effective_at=T0 + timedelta(seconds=1))
    assert price_at(MODEL, T0 + timedelta(seconds=2)).price_id == newer.pk
    charge = metering.settle(hold=held, usage=Usage(PROMPT, COMPLETION), worker=worker,
                             now=T0 + timedelta(seconds=2))
    assert charge.cost_micros == COST and not charge.capped
    # A request that starts after the change pays the new price.
    assert reserve(key, "r2", now=T0 + timedelta(seconds=2)).amount_micros == 13_851


def test_settle_is_idempotent_by_request_id(carol, bob, price, worker):
    grant(carol, 10_000)
    held = reserve(key_for(carol), "r1")
    first = metering.settle(hold=held, usage=Usage(PROMPT, COMPLETION), worker=worker, now=T0)
    before = balances(carol, bob)
    again = metering.settle(hold=held, usage=Usage(PROMPT, 2 * COMPLETION), worker=worker,
                            now=T0 + timedelta(seconds=1))
    assert again == first
    assert balances(carol, bob) == before
    assert Charge.objects.count() == 1
    assert Transfer.objects.filter(kind="settle").count() == 1


def test_reserve_replayed_with_the_same_request_id_returns_the_same_hold(carol, price):
    grant(carol, 10_000)
    key = key_for(carol)
    first = reserve(key, "r1")
    before = balances(carol)
    assert reserve(key, "r1") == first
    assert balances(carol) == before
    assert Hold.objects.count() == 1 and Transfer.objects.filter(kind="reserve").count() == 1


def test_reserve_replay_does_not_count_against_the_key_spend_limit_twice(carol, price):
    """A replayed reserve moves nothing, so the key's spend must not move either."""
    grant(carol, 10_000)
    key = key_for(carol, spend_limit_micros=10 * HOLD, spend_period="daily")
    first = reserve(key, "r1")
    assert used(key) == HOLD
    assert reserve(key, "r1") == first
    assert used(key) == HOLD


def test_release_returns_everything(carol, price):
    grant(carol, 10_000)
    key = key_for(carol, spend_limit_micros=5_000, spend_period="daily")
    reserve(key, "r1")
    assert metering.release(request_id="r1", now=T0) is True
    assert bal(Account.Kind.WALLET, carol) == 10_000 and bal(Account.Kind.HOLDS, carol) == 0
    assert used(key) == 0
    assert Hold.objects.get(request_id="r1").status == "released"
    assert metering.release(request_id="r1", now=T0) is False  # already closed: nothing moves
    assert Transfer.objects.filter(kind="release").count() == 1


def test_settling_a_released_hold_is_refused(carol, price, worker):
    grant(carol, 10_000)
    held = reserve(key_for(carol), "r1")
    metering.release(request_id="r1", now=T0)
    before = balances(carol)
    with pytest.raises(MeteringError) as refused:
        metering.settle(hold=held, usage=Usage(PROMPT, COMPLETION), worker=worker, now=T0)
    assert answered(refused.value) == (409, "hold_closed")
    assert errors.from_billing(refused.value).body()["error"]["code"] == "hold_closed"
    assert balances(carol) == before and not Charge.objects.exists()


def test_settle_refuses_a_hold_that_does_not_match_and_moves_nothing(carol, mallory, price,
                                                                     worker):
    """settle bills from the HoldInfo it is given; the hold row must agree with it."""
    grant(carol, 10_000)
    held = reserve(key_for(carol), "r1")
    before = balances(carol)
    for wrong in (dataclasses.replace(held, amount_micros=held.amount_micros + 1),
                  dataclasses.replace(held, user_id=mallory.pk)):
        with pytest.raises(ValueError, match="does not match"):
            metering.settle(hold=wrong, usage=Usage(PROMPT, COMPLETION), worker=worker, now=T0)
    assert balances(carol) == before and not Charge.objects.exists()
    assert bal(Account.Kind.WALLET, mallory) == 0
    assert Hold.objects.get(request_id="r1").status == "pending"
    with pytest.raises(Hold.DoesNotExist):
        metering.settle(hold=dataclasses.replace(held, request_id="nope"),
                        usage=Usage(PROMPT, COMPLETION), worker=worker, now=T0)
    assert metering.settle(hold=held, usage=Usage(PROMPT, COMPLETION), worker=worker,
                           now=T0).cost_micros == COST


def test_zero_usage_is_released_not_charged(carol, price, worker):
    grant(carol, 10_000)
    held = reserve(key_for(carol), "r1")
    assert metering.settle(hold=held, usage=Usage(0, 0), worker=worker, now=T0) is None
    assert Hold.objects.get(request_id="r1").status == "released"
    assert bal(Account.Kind.WALLET, carol) == 10_000 and not Charge.objects.exists()


def test_interrupted_stream_is_billed_for_delivered_tokens_once(carol, bob, price, worker):
    """The engine never sent usage: the proxy settles with what it delivered, marked
    estimated; the real usage arriving later (a retried settle) bills nothing more."""
    grant(carol, 10_000)
    held = reserve(key_for(carol), "r1")
    charge = metering.settle(hold=held, usage=Usage(PROMPT, 40, estimated=True),
                             worker=worker, now=T0)
    # ceil((1,234 x 150,000 + 40 x 600,000) / 10^6) = ceil(209.1)
    assert (charge.cost_micros, charge.estimated) == (210, True)
    assert Charge.objects.get(request_id="r1").estimated is True
    before = balances(carol, bob)
    late = metering.settle(hold=held, usage=Usage(PROMPT, COMPLETION), worker=worker, now=T0)
    assert late == charge
    assert balances(carol, bob) == before
    assert bal(Account.Kind.WALLET, carol) == 10_000 - 210


def test_stream_cut_before_any_output_still_bills_the_prompt(carol, price, worker):
    grant(carol, 10_000)
    held = reserve(key_for(carol), "r1")
    charge = metering.settle(hold=held, usage=Usage(PROMPT, 0, estimated=True),
                             worker=worker, now=T0)
    assert charge.cost_micros == 186 and charge.estimated  # ceil(185.1), never 0


def test_usage_beyond_the_hold_is_capped_at_the_hold(carol, bob, price, worker):
    grant(carol, 10_000)
    held = reserve(key_for(carol), "r1")
    charge = metering.settle(hold=held, usage=Usage(PROMPT, 5 * MAX_TOKENS),
                             worker=worker, now=T0)
    assert (charge.cost_micros, charge.capped) == (HOLD, True)
    assert bal(Account.Kind.WALLET, carol) == 10_000 - HOLD
    fee = -(-HOLD * 1500 // 10_000)
    assert bal(Account.Kind.EARNINGS, bob) == HOLD - fee
    assert bal(Account.Kind.PLATFORM_REVENUE) == fee


# --- refusals: each one moves nothing ---

def test_insufficient_balance_is_402_insufficient_quota_and_moves_nothing(carol, price):
    grant(carol, HOLD - 1)
    key = key_for(carol, spend_limit_micros=10 * HOLD, spend_period="daily")
    before = balances(carol)
    with pytest.raises(MeteringError) as refused:
        reserve(key, "r1")
    assert answered(refused.value) == (402, "insufficient_quota")
    body = errors.from_billing(refused.value).body()
    assert body == {"error": {"message": refused.value.message, "type": "insufficient_quota",
                              "param": None, "code": "insufficient_quota"}}
    assert "top up" in body["error"]["message"]
    assert balances(carol) == before
    assert not Hold.objects.exists() and not Transfer.objects.filter(kind="reserve").exists()
    assert used(key) == 0


def test_revoked_key_no_longer_authenticates(carol):
    row, token = api_key_create(user=carol, name="laptop")
    assert api_key_authenticate(token) == KeyInfo.of(row)
    assert api_key_authenticate(token) == KeyInfo.of(row)  # now from the cache
    assert api_key_revoke(user=carol, key_id=row.pk) is True
    assert api_key_authenticate(token) is None
    forged = token[:-4] + ("aaaa" if not token.endswith("aaaa") else "bbbb")
    assert api_key_authenticate(forged) is None
    assert api_key_authenticate("rs_nope") is None


def test_the_event_loops_cache_read_agrees_with_authenticate(carol):
    """api_key_cached reads what api_key_authenticate cached, on an event loop; anything it
    cannot answer (not cached, or changed since) goes back to api_key_authenticate."""
    import asyncio

    from billing.keys import api_key_cached

    row, token = api_key_create(user=carol, name="laptop")
    assert asyncio.run(api_key_cached(token)) == (False, None)  # not cached yet
    api_key_authenticate(token)
    assert asyncio.run(api_key_cached(token)) == (True, KeyInfo.of(row))
    forged = token[:-4] + ("aaaa" if not token.endswith("aaaa") else "bbbb")
    assert asyncio.run(api_key_cached(forged)) == (False, None)
    assert api_key_authenticate(forged) is None
    assert asyncio.run(api_key_cached(forged)) == (True, None)  # a known-bad key, cached
    assert asyncio.run(api_key_cached("not-a-key")) == (True, None)
    api_key_revoke(user=carol, key_id=row.pk)
    assert asyncio.run(api_key_cached(token)) == (False, None)  # changed: ask again
    assert api_key_authenticate(token) is None


@pytest.fixture
def on_loop():
    """An event loop in a thread of its own, as uvicorn's: `on_loop(coro)` runs a coroutine
    there and returns its result, while this thread keeps the test's database transaction."""
    import asyncio
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro, timeout=10.0):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    yield run

    async def shutdown():
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    run(shutdown())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


async def _until(check, what: str, within: float = 5.0) -> None:
    """Until check() (a coroutine function) is true."""
    import asyncio
    import time

    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, f"not {what} within {within} s"
        await asyncio.sleep(0.005)


def _listening(token, info):
    from billing.keys import api_key_cached

    async def check():
        assert await api_key_cached(token) == (True, info)  # from Redis until then
        return keys._NEAR.listening
    return check


def test_the_near_cache_answers_from_memory_and_forgets_a_key_the_moment_it_changes(
        carol, on_loop):
    """While the process listens for key changes, a key read from Redis is kept in memory: it
    answers even when Redis no longer has it. A change made in this process drops it at once;
    one announced by another process, as the announcement arrives."""
    import redis
    from django.conf import settings

    from billing.keys import api_key_cached

    row, token = api_key_create(user=carol, name="laptop")
    other, other_token = api_key_create(user=carol, name="server")
    api_key_authenticate(token)
    api_key_authenticate(other_token)
    info, other_info = KeyInfo.of(row), KeyInfo.of(other)
    redis_key = keys._cache_key(keys.secret_digest(token))

    on_loop(_until(_listening(token, info), "listening"))
    assert on_loop(api_key_cached(token)) == (True, info)  # read from Redis and kept
    assert on_loop(api_key_cached(other_token)) == (True, other_info)
    cache.delete(redis_key)
    assert on_loop(api_key_cached(token)) == (True, info)  # from memory alone
    # Another process changes the key: Redis's entry marked, the change announced.
    cache.set(redis_key, keys._CHANGED, 30)
    redis.Redis.from_url(settings.REDIS_URL).publish(keys.CHANNEL, keys.secret_digest(token))

    async def forgotten():
        return await api_key_cached(token) == (False, None)
    on_loop(_until(forgotten, "forgotten", within=1.0))
    # A revoke in this process: gone before the next lookup, no waiting.
    assert on_loop(api_key_cached(other_token)) == (True, other_info)
    assert api_key_revoke(user=carol, key_id=other.pk) is True
    assert on_loop(api_key_cached(other_token)) == (False, None)
    assert api_key_authenticate(other_token) is None


def test_the_near_cache_is_off_while_the_process_cannot_hear_changes(carol, on_loop):
    """The listener's Redis connection killed: the near cache empties and goes unused (every
    lookup reads Redis) until the process listens again."""
    import redis
    from django.conf import settings

    from billing.keys import api_key_cached

    row, token = api_key_create(user=carol, name="laptop")
    api_key_authenticate(token)
    info = KeyInfo.of(row)
    redis_key = keys._cache_key(keys.secret_digest(token))
    admin = redis.Redis.from_url(settings.REDIS_URL)

    on_loop(_until(_listening(token, info), "listening"))
    assert on_loop(api_key_cached(token)) == (True, info)  # kept in memory
    killed = [c for c in admin.client_list(_type="pubsub") if c.get("name") == keys.LISTENER_NAME]
    assert killed
    for client in killed:
        admin.client_kill_filter(_id=client["id"])

    async def deaf():
        return not keys._NEAR.listening
    on_loop(_until(deaf, "deaf to changes"))
    cache.delete(redis_key)
    assert on_loop(api_key_cached(token)) == (False, None)  # not from the emptied memory
    api_key_authenticate(token)
    on_loop(_until(_listening(token, info), "listening again"))  # it subscribes again itself
    assert on_loop(api_key_cached(token)) == (True, info)  # read while listening: kept
    cache.delete(redis_key)
    assert on_loop(api_key_cached(token)) == (True, info)


def test_a_key_revoked_while_it_is_being_authenticated_stays_revoked(carol, monkeypatch):
    """Authenticate reads the row, then caches what it read for 30 s; revoke updates the row,
    then deletes the cache entry. A revoke landing between the read and the cache write is
    undone by that stale write, and the revoked key keeps working for up to 30 s."""
    row, token = api_key_create(user=carol, name="laptop")
    real = keys.secret_check

    def revoked_meanwhile(token_, digest):
        monkeypatch.setattr(keys, "secret_check", real)
        assert api_key_revoke(user=carol, key_id=row.pk)
        return real(token_, digest)

    monkeypatch.setattr(keys, "secret_check", revoked_meanwhile)
    api_key_authenticate(token)  # the request in flight as the key is revoked may pass
    assert api_key_authenticate(token) is None  # the next one must not


def test_someone_else_cannot_revoke_my_key(carol, mallory):
    row, token = api_key_create(user=carol, name="laptop")
    assert api_key_revoke(user=mallory, key_id=row.pk) is False
    assert api_key_authenticate(token) is not None


def test_key_daily_spend_limit_is_429_and_settle_gives_back_the_unused_hold(carol, price,
                                                                            worker):
    grant(carol, 100_000)
    key = key_for(carol, spend_limit_micros=3_000, spend_period="daily")
    a = reserve(key, "a")
    b = reserve(key, "b")
    assert used(key) == 2 * HOLD
    before = balances(carol)
    with pytest.raises(MeteringError) as refused:
        reserve(key, "c")
    assert answered(refused.value) == (429, "key_limit_reached")
    assert errors.from_billing(refused.value).body()["error"]["type"] == "insufficient_quota"
    assert balances(carol) == before and used(key) == 2 * HOLD
    metering.settle(hold=a, usage=Usage(PROMPT, COMPLETION), worker=worker, now=T0)
    assert used(key) == COST + HOLD
    with pytest.raises(MeteringError):  # 526 + 1,386 + 1,386 > 3,000
        reserve(key, "c")
    metering.settle(hold=b, usage=Usage(PROMPT, COMPLETION), worker=worker, now=T0)
    assert used(key) == 2 * COST
    reserve(key, "c")  # 2 x 526 + 1,386 <= 3,000
    assert used(key) == 2 * COST + HOLD
    # A new day is a new period.
    reserve(key, "d", now=T0 + timedelta(days=1))
    assert KeySpend.objects.get(api_key_id=key.key_id,
                                period_start=datetime(2026, 11, 3, tzinfo=UTC)).used_micros \
        == HOLD


def test_model_allow_list_is_403(carol, price):
    grant(carol, 10_000)
    ModelPrice.objects.create(model="other", input_micros_per_mtok=1, output_micros_per_mtok=1,
                              effective_at=T0 - timedelta(days=1))
    key = key_for(carol, allowed_models=[MODEL])
    with pytest.raises(MeteringError) as refused:
        reserve(key, "r1", model="other")
    assert answered(refused.value) == (403, "model_not_allowed")
    assert not Hold.objects.exists() and bal(Account.Kind.WALLET, carol) == 10_000
    reserve(key, "r2")


def with_redis_undisturbed(scenario, tries: int = 5) -> None:
    """Run scenario(); run it again if the Redis database was cleared meanwhile. Every test
    run on the machine shares REDIS_URL's database, and tests/conftest.py clears it before
    each test: another run's clear in the middle of a scenario resets its counters. A sentinel
    key that disappears tells us so; in a run of its own this never retries."""
    for _ in range(tries):
        sentinel = f"test-sentinel:{uuid.uuid4()}"
        cache.set(sentinel, 1, 600)
        try:
            scenario()
            return
        except (AssertionError, MeteringError, pytest.fail.Exception):
            if cache.get(sentinel) is not None:
                raise
    pytest.fail(f"the shared Redis database was cleared during each of {tries} tries")


@pytest.fixture
def one_window(monkeypatch):
    """Every take() in this test falls in the same minute, whatever the clock says."""
    monkeypatch.setattr(ratelimit, "_window", lambda now: 29_000_000)


def test_requests_per_minute_limit_is_429(carol, price, one_window):
    grant(carol, 100_000)

    def scenario():
        key = key_for(carol, requests_per_minute=2)
        run = uuid.uuid4().hex
        reserve(key, f"{run}-1")
        reserve(key, f"{run}-2")
        before = balances(carol)
        with pytest.raises(MeteringError) as refused:
            reserve(key, f"{run}-3")
        assert answered(refused.value) == (429, "rate_limit_exceeded")
        assert "requests-per-minute" in refused.value.message
        assert errors.from_billing(refused.value).body()["error"]["type"] == "rate_limit_error"
        assert balances(carol) == before
        assert Hold.objects.filter(api_key_id=key.key_id).count() == 2

    with_redis_undisturbed(scenario)


def test_tokens_per_minute_limit_is_429_and_a_refusal_uses_none(carol, price, one_window):
    grant(carol, 100_000)

    def scenario():
        key = key_for(carol, requests_per_minute=10, tokens_per_minute=5_000)
        run = uuid.uuid4().hex
        reserve(key, f"{run}-1", prompt=1_000, max_tokens=2_000)  # 3,000 tokens
        with pytest.raises(MeteringError) as refused:
            reserve(key, f"{run}-2", prompt=1_000, max_tokens=2_000)
        assert answered(refused.value) == (429, "rate_limit_exceeded")
        assert "tokens-per-minute" in refused.value.message
        # The refused 3,000 tokens were given back: 2,000 more fit, then nothing.
        reserve(key, f"{run}-3", prompt=1_000, max_tokens=1_000)
        with pytest.raises(MeteringError):
            reserve(key, f"{run}-4", prompt=1, max_tokens=1)
        assert Hold.objects.filter(api_key_id=key.key_id).count() == 2

    with_redis_undisturbed(scenario)


def test_rate_limit_survives_redis_forgetting_its_script_and_a_broken_connection(one_window):
    """take() talks to Redis on a connection of its own: a script Redis no longer knows
    (restart, SCRIPT FLUSH) is sent in full, and a dead connection is replaced, counting once."""
    def scenario():
        key_id = int(uuid.uuid4().int % 10**9) + 10**9  # counters no other test shares

        def take():
            return ratelimit.take(key_id=key_id, requests_limit=3, tokens_limit=None, tokens=1)

        assert take() is None
        script = ratelimit._script()
        sha, script.sha = script.sha, "0" * 40  # a script Redis does not know
        try:
            assert take() is None
        finally:
            script.sha = sha
        ratelimit._own.conn._sock.shutdown(socket.SHUT_RDWR)  # the server went away
        assert take() is None
        assert ratelimit.used(key_id=key_id, name="requests") == 3
        assert take() == "requests"

    with_redis_undisturbed(scenario)


# --- the ledger and the database's own checks ---

def test_ledger_refuses_legs_that_do_not_sum_to_zero(carol):
    wallet = ledger.account_id(Account.Kind.WALLET, carol.pk)
    grants = ledger.account_id(Account.Kind.GRANTS)
    with pytest.raises(ledger.LedgerError, match="sum to 1"):
        ledger.post(kind="grant", idempotency_key="bad", legs=[(grants, -100), (wallet, 101)])
    with pytest.raises(ledger.LedgerError, match="moves no money"):
        ledger.post(kind="grant", idempotency_key="none", legs=[(wallet, 5), (wallet, -5)])
    assert not Transfer.objects.exists()


def test_ledger_refuses_an_overdraft_and_rolls_back(carol):
    grant(carol, 100)
    wallet = ledger.account_id(Account.Kind.WALLET, carol.pk)
    platform = ledger.account_id(Account.Kind.PLATFORM_REVENUE)
    with pytest.raises(ledger.InsufficientFunds):
        ledger.post(kind="settle", idempotency_key="over", legs=[(wallet, -101), (platform, 101)])
    assert not Transfer.objects.filter(idempotency_key="over").exists()
    assert bal(Account.Kind.WALLET, carol) == 100


def _raw_unbalanced_transfer(cur, key: str, wallet: int) -> None:
    cur.execute("INSERT INTO billing_transfer (kind, idempotency_key, reference, memo, created_at)"
                " VALUES ('grant', %s, '', '', now()) RETURNING id", [key])
    transfer_id = cur.fetchone()[0]
    cur.execute("INSERT INTO billing_entry (transfer_id, account_id, amount_micros)"
                " VALUES (%s, %s, 1000)", [transfer_id, wallet])


def test_database_refuses_an_unbalanced_transfer_checked_at_commit(carol):
    """Inside the test's transaction the trigger is deferred to a commit that never comes;
    SET CONSTRAINTS ... IMMEDIATE runs the deferred checks now, as COMMIT would."""
    wallet = ledger.account_id(Account.Kind.WALLET, carol.pk)
    try:
        with pytest.raises(IntegrityError, match="not a balanced transfer"):
            with transaction.atomic(), connection.cursor() as cur:
                _raw_unbalanced_transfer(cur, "raw", wallet)
                # Deferred: both statements were accepted; the check waits for commit.
                cur.execute("SET CONSTRAINTS ALL IMMEDIATE")
        with pytest.raises(IntegrityError, match="0 legs"):
            with transaction.atomic(), connection.cursor() as cur:
                cur.execute("INSERT INTO billing_transfer (kind, idempotency_key, reference,"
                            " memo, created_at) VALUES ('grant', 'empty', '', '', now())")
                cur.execute("SET CONSTRAINTS ALL IMMEDIATE")
    finally:
        with connection.cursor() as cur:
            cur.execute("SET CONSTRAINTS ALL DEFERRED")
    assert not Transfer.objects.exists() and not Entry.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_database_refuses_an_unbalanced_transfer_at_a_real_commit(carol):
    wallet = ledger.account_id(Account.Kind.WALLET, carol.pk)
    with pytest.raises(IntegrityError, match="not a balanced transfer"):
        with transaction.atomic(), connection.cursor() as cur:
            _raw_unbalanced_transfer(cur, "raw", wallet)
    with pytest.raises(IntegrityError, match="0 legs"):
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("INSERT INTO billing_transfer (kind, idempotency_key, reference, memo,"
                        " created_at) VALUES ('grant', 'empty', '', '', now())")
    assert not Transfer.objects.exists() and not Entry.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_database_refuses_an_entry_added_to_a_committed_transfer(carol):
    """Even two entries that sum to zero: a committed transfer never changes."""
    grant(carol, 1_000)
    wallet = ledger.account_id(Account.Kind.WALLET, carol.pk)
    grants = ledger.account_id(Account.Kind.GRANTS)
    old = Transfer.objects.get()
    with pytest.raises(DatabaseError, match="created in the same transaction"):
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("INSERT INTO billing_entry (transfer_id, account_id, amount_micros)"
                        " VALUES (%s, %s, 500), (%s, %s, -500)", [old.pk, wallet, old.pk, grants])
    with pytest.raises(DatabaseError, match="created in the same transaction"):
        with transaction.atomic(), connection.cursor() as cur:  # no such transfer at all
            cur.execute("INSERT INTO billing_entry (transfer_id, account_id, amount_micros)"
                        " VALUES (%s, %s, 500)", [old.pk + 1000, wallet])
    assert Entry.objects.filter(transfer=old).count() == 2


@pytest.mark.django_db(transaction=True)
def test_entries_may_join_a_transfer_of_the_same_transaction_across_savepoints(carol):
    """Legs inserted one by one, in savepoints or not, are checked together at commit."""
    wallet = ledger.account_id(Account.Kind.WALLET, carol.pk)
    grants = ledger.account_id(Account.Kind.GRANTS)
    with transaction.atomic(), connection.cursor() as cur:
        with transaction.atomic():  # the transfer is created in a savepoint...
            cur.execute("INSERT INTO billing_transfer (kind, idempotency_key, reference, memo,"
                        " created_at) VALUES ('grant', 'legs', '', '', now()) RETURNING id")
            transfer_id = cur.fetchone()[0]
        with transaction.atomic():  # ... and its legs in others
            cur.execute("INSERT INTO billing_entry (transfer_id, account_id, amount_micros)"
                        " VALUES (%s, %s, -700)", [transfer_id, grants])
        with pytest.raises(DatabaseError):  # a savepoint rolled back takes its leg with it
            with transaction.atomic():
                cur.execute("INSERT INTO billing_entry (transfer_id, account_id, amount_micros)"
                            " VALUES (%s, %s, 5)", [transfer_id, wallet])
                cur.execute("SELECT 1/0")
        cur.execute("INSERT INTO billing_entry (transfer_id, account_id, amount_micros)"
                    " VALUES (%s, %s, 700)", [transfer_id, wallet])
    assert bal(Account.Kind.WALLET, carol) == 0  # a raw insert moves no kept balance
    assert sorted(Entry.objects.filter(transfer_id=transfer_id)
                  .values_list("amount_micros", flat=True)) == [-700, 700]
    with connection.cursor() as cur:  # put the kept balance right for ledger_problems()
        cur.execute("UPDATE billing_account SET balance_micros = 700 WHERE id = %s", [wallet])


def test_entries_are_append_only(carol):
    grant(carol, 1_000)
    entry = Entry.objects.filter(account__kind="wallet").get()
    for sql in ("UPDATE billing_entry SET amount_micros = 5 WHERE id = %s",
                "DELETE FROM billing_entry WHERE id = %s"):
        with pytest.raises(DatabaseError, match="append-only"):
            with transaction.atomic(), connection.cursor() as cur:
                cur.execute(sql, [entry.pk])
    entry.refresh_from_db()
    assert entry.amount_micros == 1_000


@pytest.mark.django_db(transaction=True)
def test_database_refuses_a_leg_on_an_account_that_does_not_exist(carol):
    """No foreign key on entries (migration 0006): the commit-time check counts them instead."""
    grants = ledger.account_id(Account.Kind.GRANTS)
    missing = Account.objects.order_by("-pk").values_list("pk", flat=True).first() + 1000
    with pytest.raises(IntegrityError, match="accounts that do not exist"):
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("INSERT INTO billing_transfer (kind, idempotency_key, reference, memo,"
                        " created_at) VALUES ('grant', 'ghost', '', '', now()) RETURNING id")
            transfer_id = cur.fetchone()[0]
            cur.execute("INSERT INTO billing_entry (transfer_id, account_id, amount_micros)"
                        " VALUES (%s, %s, -500), (%s, %s, 500)",
                        [transfer_id, grants, transfer_id, missing])
    assert not Transfer.objects.exists() and not Entry.objects.exists()


def test_ledger_rows_are_never_deleted(carol, price, worker):
    """What entries, holds and charges point at stays: deletes are refused by the database."""
    grant(carol, 10_000)
    metering.settle(hold=reserve(key_for(carol), "r1"), usage=Usage(PROMPT, COMPLETION),
                    worker=worker, now=T0)
    charge = Charge.objects.get()
    rows = {"billing_account": ledger.account_id(Account.Kind.WALLET, carol.pk),
            "billing_transfer": charge.transfer_id, "billing_hold": charge.hold_id,
            "billing_charge": charge.pk, "billing_modelprice": price.pk,
            "billing_apikey": charge.api_key_id}
    for table, pk in rows.items():
        with pytest.raises(DatabaseError, match=f"rows of {table} are never deleted"):
            with transaction.atomic(), connection.cursor() as cur:
                cur.execute(f"DELETE FROM {table} WHERE id = %s", [pk])
    assert Charge.objects.filter(pk=charge.pk, hold__pk=charge.hold_id).exists()


def test_a_non_negative_account_cannot_go_below_zero_even_by_raw_sql(carol):
    grant(carol, 1_000)
    wallet = ledger.account_id(Account.Kind.WALLET, carol.pk)
    with pytest.raises(IntegrityError, match="account_no_overdraft"):
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("UPDATE billing_account SET balance_micros = balance_micros - 1001"
                        " WHERE id = %s", [wallet])
    assert bal(Account.Kind.WALLET, carol) == 1_000
    # Where money enters the ledger, the account may go negative.
    assert bal(Account.Kind.GRANTS) == -1_000
