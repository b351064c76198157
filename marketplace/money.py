"""Price arithmetic on integer micro-dollars (no ORM, no float)."""

from decimal import ROUND_HALF_UP, Decimal

MICROS_PER_USD = 1_000_000


def usd_to_micros(usd: Decimal) -> int:
    return int((Decimal(usd) * MICROS_PER_USD).to_integral_value(rounding=ROUND_HALF_UP))


def micros_to_usd(micros: int) -> Decimal:
    return (Decimal(micros) / MICROS_PER_USD).quantize(Decimal("0.000001"))


def format_usd(micros: int) -> str:
    """$0.45, $1.2345: at least cents, more digits only when the price has them."""
    usd = micros_to_usd(micros).normalize()
    if usd.as_tuple().exponent > -2:
        usd = usd.quantize(Decimal("0.01"))
    return f"${usd:,}"
