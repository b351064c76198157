"""What a token costs on a card: rented by the hour (the catalog's "$ per 1M output tokens at
full use") and owned (the break-even calculator, docs/costs.md). Pure: plain values in,
integer micro-dollars and shares out, no ORM.

One fact, used both ways: a card that costs C an hour and serves T output tokens a second
for that hour costs C / (T x 3,600) per token. Renting, C is the listing's price per hour and
T the card's verified output tokens/s at its verified concurrency (this card's share of its
engine). Owning, C is the hardware's price spread over its amortization plus the electricity,
and the card serves only the share of the hours someone sends it work (its utilization).

Exact arithmetic (fractions) until the end, then money rounded once to the micro-dollar,
half up. Utilizations are shares of the time (0..1); power is in watts, a physical quantity
measured by NVML, not money.
"""

import math
from dataclasses import dataclass
from fractions import Fraction

from billing.pricing import MICROS_PER_USD, MTOK, fee_split

SECONDS_PER_HOUR = 3600
HOURS_PER_MONTH = Fraction(8760, 12)  # 730: a year's hours over its twelve months


def exact(value) -> Fraction:
    """A number as an exact fraction; a float as the decimal it prints as (0.1 is 1/10, not
    the binary fraction nearest to it), so that hand-computed figures come out exactly."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("Not a finite number.")
        return Fraction(repr(value))
    return Fraction(value)


def micros(value: Fraction) -> int:
    """Rounded to the micro-dollar, half away from zero."""
    sign = -1 if value < 0 else 1
    return sign * math.floor(abs(value) + Fraction(1, 2))


def per_mtok_micros(cost_per_hour_micros, tokens_per_s) -> int | None:
    """What a million output tokens cost on a card that costs `cost_per_hour_micros` an hour
    and serves `tokens_per_s` output tokens a second all that hour; None when it serves none
    (not measured yet)."""
    if tokens_per_s is None or exact(tokens_per_s) <= 0:
        return None
    return micros(exact(cost_per_hour_micros) * MTOK
                  / (exact(tokens_per_s) * SECONDS_PER_HOUR))


@dataclass(frozen=True)
class PlatformPrice:
    """What the platform's own API charges for the model a card was measured with."""

    model: str  # the public model name
    output_micros_per_mtok: int


# --- owning a card ---------------------------------------------------------------------

@dataclass(frozen=True)
class Electricity:
    key: str
    label: str
    micros_per_kwh: int
    source: str


# Average household prices, the ones a person deciding to buy a card at home pays. Germany's
# in euros, converted at the European Central Bank's average reference rate for 2024
# (1.0824 US$ per euro): 39.7 euro cents x 1.0824 = $0.4297 per kWh.
EUR_USD_2024 = Fraction("1.0824")
GERMANY = Electricity(
    "de", "Germany", micros(Fraction("0.397") * EUR_USD_2024 * MICROS_PER_USD),
    "BDEW-Strompreisanalyse 2025: 39.7 euro cents per kWh for a household using 3,500 kWh a "
    "year; at the ECB's 2024 average of 1.0824 US$ per euro")
UNITED_STATES = Electricity(
    "us", "United States", 160_000,
    "U.S. EIA, Electric Power Annual (data for 2023): average residential price, 16.0 cents "
    "per kWh")
ELECTRICITY = {e.key: e for e in (GERMANY, UNITED_STATES)}

# A card generation lasts about two years (GeForce RTX 30, 40 and 50 series: September 2020,
# October 2022, January 2025); so does the calculator's default amortization.
DEFAULT_AMORTIZATION_MONTHS = 24
# The rest of the machine (CPU, board, fans, the power supply's losses), per card, whether it
# serves or not: OUR ESTIMATE for a lean single-card host; NVML measures only the GPU.
DEFAULT_SYSTEM_W = 40
# Launch prices NVIDIA announced in the US, by the name NVML reports. Datacenter and
# workstation cards have no public list price: the calculator asks for one.
LAUNCH_PRICES_USD = {
    "NVIDIA GeForce RTX 3090": 1_499,  # announced September 2020
    "NVIDIA GeForce RTX 4090": 1_599,  # announced September 2022
    "NVIDIA GeForce RTX 5090": 1_999,  # announced January 2025
}


@dataclass(frozen=True)
class Owning:
    """A card someone owns (or would buy), as the break-even calculator takes it.

    The GPU draws `idle_w` while it waits and `loaded_w` while it serves `concurrency`
    requests at once; the rest of the machine draws `system_w` all the time. Serving one
    request at a time, it is counted at `loaded_w` too: only the verified concurrency's draw
    is measured, and one stream draws less, so that case's cost is an upper bound."""

    tokens_per_s_single: float  # output tokens/s of one request alone
    tokens_per_s_loaded: float  # output tokens/s at `concurrency` requests at once
    concurrency: int
    idle_w: float
    loaded_w: float
    system_w: float
    electricity_micros_per_kwh: int
    hardware_micros: int
    amortization_months: int
    # What a pay-per-token API charges for 1M output tokens; None: nothing to compare with.
    api_micros_per_mtok: int | None = None

    def __post_init__(self):
        if exact(self.tokens_per_s_single) <= 0 or exact(self.tokens_per_s_loaded) <= 0:
            raise ValueError("Tokens per second must be above zero.")
        if self.amortization_months < 1:
            raise ValueError("Amortize over at least one month.")
        if min(exact(self.idle_w), exact(self.loaded_w), exact(self.system_w)) < 0 \
                or self.electricity_micros_per_kwh < 0 or self.hardware_micros < 0:
            raise ValueError("Power and prices cannot be negative.")

    def tokens_per_s(self, single: bool) -> Fraction:
        return exact(self.tokens_per_s_single if single else self.tokens_per_s_loaded)

    def fixed_per_hour(self) -> Fraction:
        """The hardware's price spread over every hour of its amortization, used or not."""
        return Fraction(self.hardware_micros) / (self.amortization_months * HOURS_PER_MONTH)

    def watts(self, utilization) -> Fraction:
        """The machine's average draw for this card when it serves `utilization` of the time."""
        u = exact(utilization)
        return (exact(self.system_w) + (1 - u) * exact(self.idle_w)
                + u * exact(self.loaded_w))

    def energy_per_hour(self, utilization) -> Fraction:
        return self.watts(utilization) / 1000 * self.electricity_micros_per_kwh

    def cost_per_hour(self, utilization) -> Fraction:
        return self.fixed_per_hour() + self.energy_per_hour(utilization)

    def mtok_per_hour(self, single: bool = False) -> Fraction:
        """Millions of output tokens an hour at full use."""
        return self.tokens_per_s(single) * SECONDS_PER_HOUR / MTOK

    def cost_per_mtok(self, utilization, *, single: bool = False) -> int:
        """What a million output tokens cost the owner when the card serves `utilization` of
        the time (above 0), every hour's cost counted, served or not."""
        u = exact(utilization)
        if not 0 < u <= 1:
            raise ValueError("Utilization is a share above 0 and at most 1.")
        return micros(self.cost_per_hour(u) / (u * self.mtok_per_hour(single)))

    def break_even(self, *, single: bool = False) -> Fraction | None:
        """The utilization at which owning costs what the API charges for the same tokens;
        None ("never") when even serving all the time costs more, or there is no API price.

        Solves fixed + idle energy + u x (loaded - idle energy) = API price x u x tokens an
        hour at full use, for u."""
        if self.api_micros_per_mtok is None:
            return None
        standing = self.fixed_per_hour() + self.energy_per_hour(0)
        extra = self.energy_per_hour(1) - self.energy_per_hour(0)
        earns = self.api_micros_per_mtok * self.mtok_per_hour(single)
        if earns <= extra:
            return None
        u = standing / (earns - extra)
        return u if u <= 1 else None

    def curve(self, *, single: bool = False, steps: int = 20) -> list[tuple[Fraction, int]]:
        """(utilization, cost per 1M output tokens) from 1/steps to full use."""
        return [(Fraction(i, steps), self.cost_per_mtok(Fraction(i, steps), single=single))
                for i in range(1, steps + 1)]

    def month(self, *, price_per_hour_micros: int, utilization, fee_bps: int) -> "Month":
        """A month of renting the card out at `price_per_hour_micros` an hour, rented
        `utilization` of the time: what renters pay, the platform's fee, what the owner
        keeps, and what the month costs the owner (a month of the hardware's amortization,
        the electricity: loaded while rented, idle otherwise)."""
        u = exact(utilization)
        if not 0 <= u <= 1:
            raise ValueError("Utilization is a share from 0 to 1.")
        rent = micros(price_per_hour_micros * HOURS_PER_MONTH * u)
        earned, fee = fee_split(rent, fee_bps)
        hardware = micros(Fraction(self.hardware_micros, self.amortization_months))
        electricity = micros(self.energy_per_hour(u) * HOURS_PER_MONTH)
        return Month(utilization=u, rent_micros=rent, fee_micros=fee, earned_micros=earned,
                     hardware_micros=hardware, electricity_micros=electricity,
                     net_micros=earned - hardware - electricity)


@dataclass(frozen=True)
class Month:
    utilization: Fraction
    rent_micros: int
    fee_micros: int
    earned_micros: int
    hardware_micros: int
    electricity_micros: int
    net_micros: int


def pct(share: Fraction | None) -> float | None:
    """A share as a percentage, for people (display only)."""
    return None if share is None else float(share * 100)
