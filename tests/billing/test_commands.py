"""manage.py grant_credits and create_api_key."""

from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from billing import keys, selectors
from billing.models import Account, ApiKey, Transfer

pytestmark = pytest.mark.django_db


def run(*args) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_grant_credits_prints_the_new_balance(alice):
    out, _ = run("grant_credits", "ALICE@example.com", "25", "--memo", "sorry for the outage")
    assert out.strip() == "Granted $25.00 to alice@example.com; balance now $25.00."
    out, _ = run("grant_credits", "alice@example.com", "$0.125")
    assert "balance now $25.125" in out
    assert selectors.user_balances(alice.pk)[Account.Kind.WALLET] == 25_125_000
    grants = Transfer.objects.filter(kind="grant").order_by("id")
    assert [t.memo for t in grants] == ["sorry for the outage", "granted by an operator"]
    assert len({t.idempotency_key for t in grants}) == 2


@pytest.mark.parametrize("args,message", [
    (["nobody@example.com", "10"], "No user has the email address 'nobody@example.com'."),
    (["alice@example.com", "ten"], "must be an amount in dollars"),
    (["alice@example.com", "0"], "must be more than $0"),
    (["alice@example.com", "-5"], "must be more than $0"),
    (["alice@example.com", "NaN"], "must be more than $0"),
    (["alice@example.com", "1.0000001"], "more than 6 decimal places"),
])
def test_grant_credits_refuses_bad_input_with_a_sentence(alice, args, message):
    with pytest.raises(CommandError, match=message.replace("$", r"\$").replace(".", r"\.")):
        run("grant_credits", *args)
    assert not Transfer.objects.exists()


def test_create_api_key_prints_it_once(carol):
    out, err = run("create_api_key", "carol@example.com", "--name", "batch jobs")
    token = out.strip()
    row = ApiKey.objects.get()
    assert token.startswith(f"rs_{row.prefix}_") and "shown once" in err
    assert keys.api_key_authenticate(token).user_id == carol.pk
    assert row.spend_limit_micros is None and row.allowed_models == []


def test_create_api_key_with_limits(carol):
    out, _ = run("create_api_key", "carol@example.com", "--name", "capped", "--spend-limit",
                 "7.50", "--period", "weekly", "--models", "m1, m2,,m1")
    info = keys.api_key_authenticate(out.strip())
    assert info.spend_limit_micros == 7_500_000 and info.spend_period == "weekly"
    assert info.allowed_models == ("m1", "m2")


@pytest.mark.parametrize("args,message", [
    (["nobody@example.com", "--name", "x"], "No user has the email address"),
    (["carol@example.com", "--name", "x", "--spend-limit", "lots"], "must be an amount"),
    (["carol@example.com", "--name", " "], "must be 1 to 100 characters"),
])
def test_create_api_key_refuses_bad_input(carol, args, message):
    with pytest.raises(CommandError, match=message):
        run("create_api_key", *args)
    assert not ApiKey.objects.exists()


def test_create_api_key_refuses_an_unknown_period(carol):
    with pytest.raises(CommandError, match="invalid choice"):
        run("create_api_key", "carol@example.com", "--name", "x", "--period", "hourly")
