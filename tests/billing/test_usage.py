"""The usage journal on real PostgreSQL and Redis: delivered usage reaches the ledger exactly
once, whether the settle lands at once, after the database comes back (drain), or when the
hold expires; and a hold expires into a settle at its recorded usage, never into a refund of
tokens that were delivered."""

from datetime import timedelta

import pytest

from billing import ledger, metering, usage
from billing.metering import Usage
from billing.models import Account, Charge, Hold
from billing.selectors import ledger_problems
from tests.billing.test_metering import (
    COMPLETION,
    COST,
    HOLD,
    PROMPT,
    T0,
    bal,
    grant,
    key_for,
    reserve,
)

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("price")]

LATER = T0 + metering.HOLD_TTL + timedelta(seconds=1)


@pytest.fixture
def held(carol):
    grant(carol, 10_000)
    return reserve(key_for(carol), "r1")


def _record(hold, worker, *, completion=COMPLETION, final=True) -> None:
    assert usage.record(hold=hold, usage=Usage(PROMPT, completion, estimated=not final),
                        worker=worker, final=final)


def test_an_expired_hold_with_delivered_usage_is_settled_not_released(carol, bob, held,
                                                                       worker):
    _record(held, worker)
    assert usage.holds_expire(now=LATER) == 1
    charge = Charge.objects.get(request_id="r1")
    assert (charge.cost_micros, charge.completion_tokens, charge.provider_id) == (
        COST, COMPLETION, bob.pk)
    assert Hold.objects.get(request_id="r1").status == "settled"
    assert bal(Account.Kind.WALLET, carol) == 10_000 - COST
    assert bal(Account.Kind.EARNINGS, bob) > 0
    assert usage.recorded(["r1"]) == {}
    assert ledger_problems() == []


def test_a_hold_whose_server_died_mid_stream_bills_the_last_checkpoint(held, worker):
    _record(held, worker, completion=100, final=False)
    assert usage.holds_expire(now=LATER) == 1
    charge = Charge.objects.get(request_id="r1")
    assert (charge.completion_tokens, charge.estimated) == (100, True)


def test_only_a_hold_with_nothing_recorded_is_released(carol, held):
    assert usage.holds_expire(now=LATER) == 1
    assert Hold.objects.get(request_id="r1").status == "expired"
    assert bal(Account.Kind.WALLET, carol) == 10_000
    assert not Charge.objects.exists()


def test_fresh_holds_do_not_expire(carol, held, worker):
    reserve(key_for(carol), "fresh", now=T0 + timedelta(hours=1))
    assert usage.holds_expire(now=LATER) == 1
    assert Hold.objects.get(request_id="fresh").status == "pending"
    assert bal(Account.Kind.HOLDS, carol) == HOLD


def test_nothing_expires_while_the_journal_cannot_be_read(settings, held, worker):
    _record(held, worker)
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    from config.redis import redis_client

    redis_client.cache_clear()
    try:
        assert usage.holds_expire(now=LATER) == 0
    finally:
        redis_client.cache_clear()
    assert Hold.objects.get(request_id="r1").status == "pending"


def test_drain_settles_final_records_once(carol, held, worker):
    _record(held, worker)
    assert usage.drain() == 1
    assert Charge.objects.filter(request_id="r1").count() == 1
    assert usage.drain() == 0
    # The request's own settle, late: the same charge, not a second one.
    again = metering.settle(hold=held, usage=Usage(PROMPT, COMPLETION), worker=worker)
    assert again.cost_micros == COST
    assert Charge.objects.count() == 1
    assert bal(Account.Kind.WALLET, carol) == 10_000 - COST
    assert ledger_problems() == []


def test_drain_leaves_a_running_stream_alone(held, worker):
    _record(held, worker, completion=10, final=False)
    assert usage.drain() == 0
    assert Hold.objects.get(request_id="r1").status == "pending"
    assert list(usage.recorded(["r1"])) == ["r1"]


def test_drain_drops_records_of_settled_requests(held, worker):
    _record(held, worker, completion=10, final=False)
    metering.settle(hold=held, usage=Usage(PROMPT, COMPLETION), worker=worker)
    assert usage.drain() == 0
    assert usage.recorded(["r1"]) == {}
    assert Charge.objects.get(request_id="r1").completion_tokens == COMPLETION


def test_with_redis_away_the_record_is_spooled_and_moves_back(settings, carol, held, worker):
    from config.redis import redis_client

    real = settings.REDIS_URL
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    redis_client.cache_clear()
    try:
        _record(held, worker)
    finally:
        settings.REDIS_URL = real
        redis_client.cache_clear()
    spooled = list(usage._spool_dir().glob("*.json"))
    assert [p.stem for p in spooled] == ["r1"]
    assert usage.recorded(["r1"])["r1"].final  # found on disk
    assert usage.drain() == 1  # moved to Redis, then settled
    assert not list(usage._spool_dir().glob("*.json"))
    assert Charge.objects.get(request_id="r1").completion_tokens == COMPLETION
    assert ledger.balance(Account.Kind.WALLET, carol.pk) == 10_000 - COST


def test_a_spooled_checkpoint_never_replaces_a_later_record(settings, held, worker):
    usage._spool_write("r1", usage.Record(held, Usage(PROMPT, 5, True), worker, False,
                                          0.0).dumps(), sync=False)
    _record(held, worker)  # Redis takes the final record, then the spool is moved back
    assert usage.recorded(["r1"])["r1"].final


def test_without_redis_the_spool_is_the_journal(settings, held, worker):
    settings.REDIS_URL = ""
    _record(held, worker)
    assert usage.drain() == 1
    assert Charge.objects.get(request_id="r1").completion_tokens == COMPLETION
    assert not list(usage._spool_dir().glob("*.json"))


def test_a_hold_whose_reserve_could_not_be_confirmed_is_given_back_by_the_drain(carol, held):
    from config.redis import redis_client

    usage.release_later("r1")
    usage.release_later("never-reserved")  # its reserve did not commit: nothing to give back
    usage.drain()
    assert Hold.objects.get(request_id="r1").status == "released"
    assert bal(Account.Kind.WALLET, carol) == 10_000
    assert redis_client().hlen(usage.RELEASES) == 0


def test_a_release_never_undoes_recorded_usage(carol, held, worker):
    _record(held, worker)
    usage.release_later("r1")
    usage.drain()
    assert Hold.objects.get(request_id="r1").status == "settled"
    assert Charge.objects.get(request_id="r1").completion_tokens == COMPLETION
