"""Price arithmetic with plain values."""

import pytest

from billing import pricing


@pytest.mark.parametrize("amount, bps, provider, fee", [
    (1, 1500, 0, 1),  # a micro-dollar request still pays the platform
    (6, 1500, 5, 1),  # 0.9 micro-dollars of fee: rounded up, not away
    (100, 1500, 85, 15),
    (101, 1500, 85, 16),
    (0, 1500, 0, 0),
    (7, 0, 7, 0),
    (7, 10_000, 0, 7),
])
def test_the_fee_is_rounded_in_the_platforms_favour_and_shares_sum(amount, bps, provider, fee):
    assert pricing.fee_split(amount, bps) == (provider, fee)
    assert sum(pricing.fee_split(amount, bps)) == amount
