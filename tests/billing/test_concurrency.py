"""The ledger under real concurrency: real threads (and a second process) on PostgreSQL and
Redis, released together by a barrier. What must hold: no overdraft, no double billing, no
key over its spend limit, rate limits shared by every process, one transfer per idempotency
key, and `ledger_problems()` empty afterwards (also checked by tests/conftest.py)."""

import os
import random
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from billing import ledger, metering, ratelimit
from billing.keys import KeyInfo, api_key_create
from billing.metering import MeteringError, Usage, Worker
from billing.models import Account, Charge, Hold, KeySpend, ModelPrice, Transfer
from billing.selectors import ledger_problems
from billing.services import credits_grant
from tests.billing.test_metering import billing_path, with_redis_undisturbed  # noqa: F401
from tests.factories import price_at

BASE_DIR = Path(__file__).resolve().parents[2]
MODEL = "unit-model"  # one micro-dollar a token, in and out: costs are token counts
JOIN_S = 60


@pytest.fixture
def price():
    ModelPrice.objects.create(model=MODEL, input_micros_per_mtok=1_000_000,
                              output_micros_per_mtok=1_000_000,
                              effective_at=timezone.now() - timedelta(days=1))
    return price_at(MODEL)


def grant(user, micros: int) -> None:
    credits_grant(user=user, amount_micros=micros, idempotency_key=f"test:{uuid.uuid4()}")


def key_for(user, **limits) -> KeyInfo:
    row, _ = api_key_create(user=user, name="test", **limits)
    return KeyInfo.of(row)


def connection_gate() -> int:
    """How many threads may hold a database connection at once. PostgreSQL allows
    max_connections (100 here) for everyone on the server, other test runs included, and each
    thread opens its own; past that, connecting fails with 'too many clients'. So the barrier
    releases every thread together, and right behind it a semaphore lets at most this many
    talk to the database at a time, each closing its connection before it lets the next in.
    Sixty is still far more contention than the rows under test can serve at once."""
    with connection.cursor() as cur:
        cur.execute("SELECT current_setting('max_connections')::int"
                    " - (SELECT count(*) FROM pg_stat_activity)")
        free = cur.fetchone()[0]
    return max(4, min(60, free - 15))


def run_together(n: int, work, *, gate: int | None = None) -> list:
    """Run work(i) in n real threads released at once by a barrier; return what each returned
    or raised, in thread order. Every thread closes its own connection."""
    barrier = threading.Barrier(n)
    semaphore = threading.BoundedSemaphore(gate or n)
    results: list = [None] * n

    def run(i):
        try:
            barrier.wait(JOIN_S)
            with semaphore:
                try:
                    results[i] = work(i)
                except Exception as exc:  # the caller sorts outcomes
                    results[i] = exc
                finally:
                    connection.close()  # before the next thread may open one
        except threading.BrokenBarrierError as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + JOIN_S
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "threads still running: a deadlock?"
    return results


class Watch:
    """Samples one number from its own connection while the threads run: the extremes prove
    what was true at every moment we looked, not only at the end."""

    def __init__(self, sql: str, params: list):
        self.sql, self.params, self.seen = sql, params, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            with connection.cursor() as cur:
                while not self._stop.is_set():
                    cur.execute(self.sql, self.params)
                    row = cur.fetchone()
                    if row is not None:
                        self.seen.append(row[0])
                    time.sleep(0.002)
        finally:
            connection.close()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


def outcomes(results, kind) -> list:
    return [r for r in results if isinstance(r, kind)]


def assert_only(results, *kinds) -> None:
    odd = [r for r in results if not isinstance(r, kinds)]
    assert odd == [], f"unexpected outcomes: {odd[:3]!r}"


# 1. The proof: concurrent spenders never overdraw -------------------------------------------

@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("billing_path")
def test_200_reserves_at_once_against_a_wallet_for_100_exactly_100_win(carol, price):
    hold = 1_000
    grant(carol, 100 * hold)
    key = key_for(carol)
    wallet = ledger.account_id(Account.Kind.WALLET, carol.pk)
    # The holds account is left to be opened by the racing threads themselves, as a new
    # user's first requests would.
    now = timezone.now()
    gate = connection_gate()

    def reserve(i):
        return metering.reserve(key=key, model=MODEL, price=price, max_cost=hold,
                                request_id=f"r{i}", tokens=hold, now=now)

    started = time.monotonic()
    with Watch("SELECT balance_micros FROM billing_account WHERE id = %s", [wallet]) as watch:
        results = run_together(200, reserve, gate=gate)
    elapsed = time.monotonic() - started

    assert_only(results, metering.HoldInfo, MeteringError)
    wins, refusals = outcomes(results, metering.HoldInfo), outcomes(results, MeteringError)
    assert len(wins) == 100 and len(refusals) == 100
    assert {type(e) for e in refusals} == {metering.InsufficientBalance}
    assert len({w.hold_id for w in wins}) == 100
    assert watch.seen and min(watch.seen) >= 0
    assert ledger.balance(Account.Kind.WALLET, carol.pk) == 0
    assert ledger.balance(Account.Kind.HOLDS, carol.pk) == 100 * hold
    assert Hold.objects.count() == 100 and Transfer.objects.filter(kind="reserve").count() == 100
    assert ledger_problems() == []
    assert elapsed < 30, f"200 reserves took {elapsed:.1f}s (gate {gate})"


# 2. Settle races ---------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("billing_path")
def test_same_request_settled_by_10_threads_is_billed_once(carol, bob, price):
    grant(carol, 1_000_000)
    key = key_for(carol)
    worker = Worker(provider_id=bob.pk, reference="card:1")
    for round_ in range(5):
        request_id = f"r{round_}"
        held = metering.reserve(key=key, model=MODEL, price=price, max_cost=1_000,
                                request_id=request_id, tokens=1_000)
        wallet_before = ledger.balance(Account.Kind.WALLET, carol.pk)
        # Each thread reports different usage: only one of them may be believed.
        results = run_together(10, lambda i, held=held: metering.settle(
            hold=held, usage=Usage(100, 200 + i), worker=worker))
        assert_only(results, metering.ChargeInfo)
        charge = Charge.objects.get(request_id=request_id)
        assert all(r.cost_micros == charge.cost_micros for r in results)
        assert len(set(results)) == 1
        assert Transfer.objects.filter(idempotency_key=f"settle:{request_id}").count() == 1
        # The hold of 1,000 was already out of the wallet: the unused part comes back.
        assert ledger.balance(Account.Kind.WALLET, carol.pk) == \
            wallet_before + 1_000 - charge.cost_micros
    assert Charge.objects.count() == 5
    assert ledger.balance(Account.Kind.HOLDS, carol.pk) == 0
    assert ledger_problems() == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("billing_path")
def test_settle_and_release_racing_close_the_hold_exactly_once(carol, bob, price):
    grant(carol, 1_000_000)
    key = key_for(carol)
    worker = Worker(provider_id=bob.pk, reference="card:1")
    for round_ in range(5):
        request_id = f"r{round_}"
        held = metering.reserve(key=key, model=MODEL, price=price, max_cost=1_000,
                                request_id=request_id, tokens=1_000)
        wallet_before = ledger.balance(Account.Kind.WALLET, carol.pk)

        def close(i, held=held):
            if i % 2:
                return metering.release(request_id=held.request_id)
            return metering.settle(hold=held, usage=Usage(100, 300), worker=worker)

        results = run_together(10, close)
        hold = Hold.objects.get(request_id=request_id)
        closers = Transfer.objects.filter(reference=f"request:{request_id}").exclude(
            kind="reserve")
        assert closers.count() == 1
        if hold.status == "settled":
            assert ledger.balance(Account.Kind.WALLET, carol.pk) == wallet_before + 1_000 - 400
            assert all(r is False or isinstance(r, metering.ChargeInfo) for r in results)
        else:
            assert hold.status == "released" and not Charge.objects.filter(
                request_id=request_id).exists()
            assert ledger.balance(Account.Kind.WALLET, carol.pk) == wallet_before + 1_000
            assert all(r in (True, False) or isinstance(r, metering.HoldClosed)
                       for r in results)
            assert results.count(True) == 1
    assert ledger.balance(Account.Kind.HOLDS, carol.pk) == 0
    assert ledger_problems() == []


# 3. Spend limits under load -----------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("billing_path")
def test_32_threads_of_reserve_settle_pairs_never_pass_the_key_spend_limit(carol, bob, price):
    limit, hold, cost = 20_000, 1_000, 400
    grant(carol, 10_000_000)  # the wallet never runs out: only the key's limit may refuse
    key = key_for(carol, spend_limit_micros=limit, spend_period="daily")
    worker = Worker(provider_id=bob.pk, reference="card:1")

    def pairs(i):
        done = []
        for n in range(8):
            request_id = f"t{i}-{n}"
            try:
                held = metering.reserve(key=key, model=MODEL, price=price, max_cost=hold,
                                        request_id=request_id, tokens=hold)
            except MeteringError as exc:
                done.append(exc)
                continue
            done.append(metering.settle(hold=held, usage=Usage(200, 200), worker=worker))
        return done

    with Watch("SELECT used_micros FROM billing_keyspend WHERE api_key_id = %s",
               [key.key_id]) as watch:
        results = [r for thread in run_together(32, pairs) for r in
                   (thread if isinstance(thread, list) else [thread])]

    assert_only(results, metering.ChargeInfo, MeteringError)
    charges, refusals = outcomes(results, metering.ChargeInfo), outcomes(results, MeteringError)
    assert {type(e) for e in refusals} == {metering.KeySpendLimitReached}
    assert all(c.cost_micros == cost for c in charges)
    # Refused only when held + spent could not take another hold: at least 20 pairs went in.
    assert len(charges) >= limit // hold and refusals
    spent = KeySpend.objects.get(api_key_id=key.key_id).used_micros
    assert spent == len(charges) * cost == sum(Charge.objects.values_list("cost_micros",
                                                                          flat=True))
    assert spent <= limit
    assert watch.seen and max(watch.seen) <= limit
    assert ledger.balance(Account.Kind.WALLET, carol.pk) == 10_000_000 - spent
    assert ledger.balance(Account.Kind.HOLDS, carol.pk) == 0
    assert ledger_problems() == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("billing_path")
def test_reserves_and_settles_of_one_user_at_once_do_not_deadlock(carol, bob, price):
    """The same race as above without any spend limit: one user's requests starting and
    finishing at the same time, as a busy API consumer's do."""
    grant(carol, 10_000_000)
    key = key_for(carol)
    worker = Worker(provider_id=bob.pk, reference="card:1")

    def pairs(i):
        for n in range(8):
            held = metering.reserve(key=key, model=MODEL, price=price, max_cost=1_000,
                                    request_id=f"t{i}-{n}", tokens=1_000)
            metering.settle(hold=held, usage=Usage(200, 200), worker=worker)
        return "done"

    results = run_together(16, pairs)
    assert results == ["done"] * 16, [r for r in results if r != "done"][:3]
    assert Charge.objects.count() == 16 * 8
    assert ledger.balance(Account.Kind.WALLET, carol.pk) == 10_000_000 - 16 * 8 * 400
    assert ledger_problems() == []


# 4. Rate limits shared by two processes -----------------------------------------------------

OTHER_PROCESS = """
import os, sys, threading, time
import django
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django.setup()
from django.conf import settings
from billing import ratelimit

key_id, attempts, requests_limit, tokens_limit, tokens = (int(a) if a != "-" else None
                                                          for a in sys.argv[1:6])
now = float(sys.argv[6])
assert "Redis" in settings.CACHES["default"]["BACKEND"], "the limit is shared through Redis"
admitted, stamps = [], []

def take(n):
    for _ in range(n):
        admitted.append(ratelimit.take(key_id=key_id, requests_limit=requests_limit,
                                       tokens_limit=tokens_limit, tokens=tokens, now=now) is None)
        stamps.append(time.time())

def half():
    threads = [threading.Thread(target=take, args=(attempts // 8,)) for _ in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()

ratelimit.used(key_id=key_id, name="requests", now=now)  # connect before the start
print("ready", flush=True)
start_at = float(sys.stdin.readline())
time.sleep(max(0, start_at - time.time()))
half()
print("half", flush=True)  # the other process's first half is done too before we go on
assert sys.stdin.readline().strip() == "go"
half()
print(sum(admitted), min(stamps), max(stamps), flush=True)
"""


@pytest.mark.parametrize("requests_limit, tokens_limit, tokens, admitted", [
    (500, None, 1, 500),  # 800 requests of 1 token: the requests limit bites
    (None, 5_000, 10, 500),  # 800 requests of 10 tokens: the tokens limit bites
    (2_000, 5_000, 10, 500),  # both limits set: the tighter one bites
])
def test_rate_limit_is_shared_by_two_processes(requests_limit, tokens_limit, tokens, admitted):
    """Each process alone tries 400 (fewer than the limit of 500), both together 800: the sum
    admitted must be exactly the limit, and neither process can take it all."""
    assert "Redis" in settings.CACHES["default"]["BACKEND"], \
        "set REDIS_URL: a per-process cache cannot share a limit between processes"

    def scenario():
        key_id = random.randrange(10**9, 2 * 10**9)  # no other test run shares these counters
        now = time.time()  # one window for both, even if the minute turns during the test
        attempts = 400  # in each process
        argv = [str(v) if v is not None else "-" for v in
                (key_id, attempts, requests_limit, tokens_limit, tokens)] + [repr(now)]
        other = subprocess.Popen([sys.executable, "-c", OTHER_PROCESS, *argv], cwd=BASE_DIR,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True,
                                 env={**os.environ,
                                      "DJANGO_SETTINGS_MODULE": "config.settings"})
        mine, stamps = [], []

        def take(n):
            for _ in range(n):
                mine.append(ratelimit.take(key_id=key_id, requests_limit=requests_limit,
                                           tokens_limit=tokens_limit, tokens=tokens,
                                           now=now) is None)
                stamps.append(time.time())

        def half():
            threads = [threading.Thread(target=take, args=(attempts // 8,)) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(JOIN_S)

        try:
            ratelimit.used(key_id=key_id, name="requests", now=now)  # connect before the start
            assert other.stdout.readline().strip() == "ready", other.stderr.read()
            start_at = time.time() + 0.3  # both processes start taking at this instant
            other.stdin.write(f"{start_at!r}\n")
            other.stdin.flush()
            time.sleep(max(0, start_at - time.time()))
            # Each process takes half, waits for the other's half, then takes the rest: their
            # spans overlap by construction, however the machine schedules them (a busy
            # machine can start one process's threads after the other's have all finished).
            half()
            assert other.stdout.readline().strip() == "half", other.stderr.read()
            other.stdin.write("go\n")
            other.stdin.flush()
            half()
            out, err = other.communicate(timeout=JOIN_S)
        finally:
            if other.poll() is None:
                other.kill()
        assert other.returncode == 0, err
        theirs, their_first, their_last = out.split()
        theirs = int(theirs)
        assert len(mine) == attempts
        assert sum(mine) + theirs == admitted
        assert float(their_first) < max(stamps) and min(stamps) < float(their_last), \
            "the two processes did not take at the same time"
        # Refused requests gave back what they took: the counters hold what was admitted.
        if requests_limit is not None:
            assert ratelimit.used(key_id=key_id, name="requests", now=now) == admitted
        if tokens_limit is not None:
            assert ratelimit.used(key_id=key_id, name="tokens", now=now) == admitted * tokens
        assert ratelimit.take(key_id=key_id, requests_limit=requests_limit,
                              tokens_limit=tokens_limit, tokens=tokens, now=now) is not None
        # The next minute is a new window.
        assert ratelimit.take(key_id=key_id, requests_limit=requests_limit,
                              tokens_limit=tokens_limit, tokens=tokens, now=now + 60) is None

    with_redis_undisturbed(scenario)


# 5. Idempotency keys replayed at once --------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_idempotency_key_replayed_by_many_threads_moves_money_once(carol):
    wallet = ledger.account_id(Account.Kind.WALLET, carol.pk)
    grants = ledger.account_id(Account.Kind.GRANTS)
    for round_ in range(5):
        key = f"grant:{round_}"
        results = run_together(40, lambda i, key=key: ledger.post(
            kind=Transfer.Kind.GRANT, idempotency_key=key, legs=[(grants, -1_000),
                                                                 (wallet, 1_000)]))
        assert_only(results, ledger.Posted)
        assert sum(r.created for r in results) == 1
        assert len({r.transfer_id for r in results}) == 1
        assert Transfer.objects.filter(idempotency_key=key).count() == 1
        assert ledger.balance(Account.Kind.WALLET, carol.pk) == 1_000 * (round_ + 1)
    assert ledger.balance(Account.Kind.GRANTS) == -5_000
    assert ledger_problems() == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("billing_path")
def test_reserve_replayed_by_many_threads_holds_once(carol, price):
    grant(carol, 100_000)
    key = key_for(carol, spend_limit_micros=50_000, spend_period="daily")
    for round_ in range(5):
        request_id = f"r{round_}"
        results = run_together(20, lambda i, request_id=request_id: metering.reserve(
            key=key, model=MODEL, price=price, max_cost=1_000, request_id=request_id,
            tokens=1_000))
        assert_only(results, metering.HoldInfo)
        assert len(set(results)) == 1
        assert Hold.objects.filter(request_id=request_id).count() == 1
        assert ledger.balance(Account.Kind.WALLET, carol.pk) == 100_000 - 1_000 * (round_ + 1)
        # Counted against the key's limit once, too.
        assert KeySpend.objects.get(api_key_id=key.key_id).used_micros == 1_000 * (round_ + 1)
    assert ledger_problems() == []
