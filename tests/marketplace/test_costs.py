"""marketplace/costs.py with plain values: each case states its inputs, and the expected
figures are worked out by hand in the comments."""

from fractions import Fraction

import pytest

from marketplace import costs
from marketplace.costs import Owning

# --- renting: $ per 1M output tokens at full use ---


@pytest.mark.parametrize(("price_micros", "tokens_per_s", "expected"), [
    # $1.00/h at 1,000 tok/s: 3.6M tokens an hour, $1 / 3.6 = $0.2777... per 1M.
    (1_000_000, 1000, 277_778),
    # $0.45/h at 217.5 tok/s (half of the 2x RTX 4090's 435 at 32, FACTS.md): 783,000 tokens
    # an hour; 450,000 x 10^6 / 783,000 = 574,712.64 micro-dollars.
    (450_000, 217.5, 574_713),
    # $3.20/h at 2,436 tok/s: 8,769,600 tokens an hour; 3.2e12 / 8,769,600 = 364,897.0
    (3_200_000, 2436.0, 364_897),
    # Not measured, or measured at nothing: no cost to show.
    (1_000_000, None, None),
    (1_000_000, 0.0, None),
])
def test_price_per_hour_over_tokens_per_hour(price_micros, tokens_per_s, expected):
    assert costs.per_mtok_micros(price_micros, tokens_per_s) == expected


def test_rounding_is_half_up_once():
    # $0.36/h at 0.2 tok/s: 720 tokens an hour, 360,000 x 10^6 / 720 = 500,000,000 exactly;
    # 1 micro-dollar an hour at 555.5... tok/s -> 1e6 / 2e6 = 0.5 -> rounds up to 1.
    assert costs.per_mtok_micros(360_000, 0.2) == 500_000_000
    assert costs.per_mtok_micros(1, Fraction(5000, 9)) == 1


# --- owning: a hand-computed card ---

# $730 paid off over 1 month of 730 hours: $1.00 an hour, fixed. The GPU draws 100 W idle and
# 400 W serving, nothing else, at $0.50 a kWh: $0.05 an hour idle, $0.20 serving. It serves
# 250 tok/s at 16 concurrent (0.9M tokens an hour) and 50 tok/s alone (0.18M an hour), and an
# API charges $2.00 per 1M output tokens.
CARD = Owning(tokens_per_s_single=50, tokens_per_s_loaded=250, concurrency=16, idle_w=100,
              loaded_w=400, system_w=0, electricity_micros_per_kwh=500_000,
              hardware_micros=730_000_000, amortization_months=1, api_micros_per_mtok=2_000_000)


def test_what_an_hour_costs():
    assert CARD.fixed_per_hour() == 1_000_000
    assert CARD.energy_per_hour(0) == 50_000 and CARD.energy_per_hour(1) == 200_000
    # Half the time busy: 250 W on average, $0.125 an hour.
    assert CARD.energy_per_hour(Fraction(1, 2)) == 125_000
    assert CARD.mtok_per_hour() == Fraction(9, 10)


@pytest.mark.parametrize(("utilization", "single", "expected"), [
    (1, False, 1_333_333),  # ($1 + $0.20) / 0.9M = $1.3333...
    (Fraction(1, 2), False, 2_500_000),  # ($1 + $0.125) / 0.45M = $2.50
    (Fraction(1, 10), False, 11_833_333),  # ($1 + $0.065) / 0.09M = $11.8333...
    (1, True, 6_666_667),  # ($1 + $0.20) / 0.18M = $6.6666...
    (Fraction(1, 2), True, 12_500_000),  # $1.125 / 0.09M
])
def test_cost_per_million_tokens_by_utilization(utilization, single, expected):
    assert CARD.cost_per_mtok(utilization, single=single) == expected


def test_serving_many_at_once_breaks_even():
    # $1 + $0.05 + u x $0.15 = $2 x u x 0.9  ->  u = 1.05 / (1.80 - 0.15) = 7/11 = 63.6%.
    assert CARD.break_even() == Fraction(7, 11)
    assert CARD.cost_per_mtok(Fraction(7, 11)) == 2_000_000  # where the curve meets the API
    # The rest of the machine at 100 W all the time: standing costs $1.10, u = 1.10/1.65 = 2/3.
    busier = Owning(**{**CARD.__dict__, "system_w": 100})
    assert busier.break_even() == Fraction(2, 3)


def test_one_request_at_a_time_never_breaks_even():
    # Alone it could earn $2 x 0.18 = $0.36 an hour busy all the time, and costs $1.20 then:
    # u would have to be 1.05 / (0.36 - 0.15) = 5, more than all the time.
    assert CARD.break_even(single=True) is None
    # Nor does anything when the API pays less than the extra power of serving.
    cheap = Owning(**{**CARD.__dict__, "api_micros_per_mtok": 100_000})  # $0.09 an hour
    assert cheap.break_even() is None
    # With no API price there is nothing to break even against.
    assert Owning(**{**CARD.__dict__, "api_micros_per_mtok": None}).break_even() is None


def test_the_curve_falls_toward_full_use():
    curve = CARD.curve(steps=4)
    # 25%: ($1 + $0.0875) / 0.225M = $4.8333...; 75%: ($1 + $0.1625) / 0.675M = $1.7222...
    assert curve == [(Fraction(1, 4), 4_833_333), (Fraction(1, 2), 2_500_000),
                     (Fraction(3, 4), 1_722_222), (Fraction(1), 1_333_333)]


def test_a_month_of_renting_it_out():
    # $0.50/h rented 40% of 730 hours: $146 from renters; a 15% fee is $21.90 (rounded up);
    # the owner keeps $124.10. The month costs the hardware's $730 and 730 hours at
    # 0.6 x 100 W + 0.4 x 400 W = 220 W: 160.6 kWh x $0.50 = $80.30. Net -$686.20.
    month = CARD.month(price_per_hour_micros=500_000, utilization=Fraction(2, 5), fee_bps=1500)
    assert (month.rent_micros, month.fee_micros, month.earned_micros) == (
        146_000_000, 21_900_000, 124_100_000)
    assert (month.hardware_micros, month.electricity_micros) == (730_000_000, 80_300_000)
    assert month.net_micros == -686_200_000


@pytest.mark.parametrize("bad", [
    {"tokens_per_s_loaded": 0}, {"tokens_per_s_single": -1.0}, {"amortization_months": 0},
    {"idle_w": -5}, {"hardware_micros": -1},
])
def test_input_no_card_has_is_refused(bad):
    with pytest.raises(ValueError):
        Owning(**{**CARD.__dict__, **bad})
    with pytest.raises(ValueError):
        CARD.cost_per_mtok(0)


def test_electricity_defaults_and_their_sources():
    # 39.7 euro cents x 1.0824 $/euro = $0.4297128 per kWh.
    assert costs.GERMANY.micros_per_kwh == 429_713
    assert costs.UNITED_STATES.micros_per_kwh == 160_000
    assert "BDEW" in costs.GERMANY.source and "2025" in costs.GERMANY.source
    assert "EIA" in costs.UNITED_STATES.source and "2023" in costs.UNITED_STATES.source


# --- FACTS.md: "An RTX 4090 breaks even against pay-per-token APIs at about 20% utilisation
# (Germany) or 15% (US) when serving 16 requests at once; serving one at a time, never." ---

# The assumptions that reproduce it (docs/costs.md):
# - tokens/s: verification/predict.py's fitted prediction for one RTX 4090 (measured at 90% of
#   its 1,008 GB/s and 82% of its 165 TFLOPS, as fleetsim's card reads) with the 27B at 4
#   bits: 107 tok/s alone, 886 at 16 concurrent;
# - power: 30 W idle, 400 W serving (of its 450 W limit, FACTS.md), 40 W for the rest of the
#   machine;
# - the card at its $1,599 launch price, paid off over 24 months: $0.0913 an hour;
# - an API at $0.24 per 1M output tokens.
RTX_4090_16_DEEP = dict(tokens_per_s_single=107, tokens_per_s_loaded=886, concurrency=16,
                        idle_w=30, loaded_w=400, system_w=40, hardware_micros=1_599_000_000,
                        amortization_months=24, api_micros_per_mtok=240_000)


@pytest.mark.parametrize(("electricity", "published"), [
    (costs.GERMANY, Fraction(20, 100)), (costs.UNITED_STATES, Fraction(15, 100))])
def test_the_published_rtx_4090_break_even(electricity, published):
    card = Owning(**RTX_4090_16_DEEP, electricity_micros_per_kwh=electricity.micros_per_kwh)
    # Germany: ($91,267 + 70 W x $0.4297) / ($0.24 x 3.1896M - 370 W x $0.4297) an hour
    #   = (91,267 + 30,080) / (765,504 - 158,994) = 20.0%;
    # US: (91,267 + 11,200) / (765,504 - 59,200) = 14.5%.
    assert abs(card.break_even() - published) <= Fraction(1, 100)
    # One at a time it earns at most $0.24 x 0.3852M = $0.092 an hour, and busy all the time
    # it costs $0.091 + 440 W of electricity: never.
    assert card.break_even(single=True) is None
    assert card.cost_per_mtok(1, single=True) > card.api_micros_per_mtok
