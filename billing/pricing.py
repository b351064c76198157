"""Price arithmetic on integer micro-dollars, and dollars for people (no ORM, no float).
The one place these conversions live: billing and marketplace both use them."""

from decimal import ROUND_HALF_UP, Decimal

MICROS_PER_USD = 1_000_000
_SIX_PLACES = Decimal("0.000001")
MTOK = 1_000_000
BPS = 10_000


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def token_cost_micros(*, input_per_mtok: int, output_per_mtok: int, prompt_tokens: int,
                      completion_tokens: int) -> int:
    """Rounded up to the micro-dollar, once per request: a request never costs 0 by rounding."""
    return _ceil_div(prompt_tokens * input_per_mtok + completion_tokens * output_per_mtok, MTOK)


def fee_split(amount_micros: int, fee_bps: int) -> tuple[int, int]:
    """(provider's share, platform fee), summing to the amount. The fee is rounded up, in the
    platform's favour: rounded down, a request of a few micro-dollars would pay no fee at all."""
    fee = min(amount_micros, _ceil_div(amount_micros * fee_bps, BPS))
    return amount_micros - fee, fee


def rental_due_micros(price_per_hour_micros: int, seconds: int) -> int:
    """What `seconds` of rental cost in all. Charges take the difference between two totals,
    so rounding never accumulates however often they run."""
    return price_per_hour_micros * seconds // 3600


def usd_to_micros(usd: Decimal) -> int:
    return int((Decimal(usd) * MICROS_PER_USD).to_integral_value(rounding=ROUND_HALF_UP))


def micros_to_usd(micros: int) -> Decimal:
    """Exact: six decimal places hold every micro-dollar."""
    return (Decimal(int(micros)) / MICROS_PER_USD).quantize(_SIX_PLACES)


# The site's display rule: balances, prices and totals in cents; the exact form only where an
# amount is made of per-token prices (a request's cost, a price per 1M tokens), which are
# fractions of a cent, and always next to a label that says so.
def usd_per_token(micros_per_mtok: int) -> str:
    """A per-million-tokens price as dollars per token, exact, in plain digits ("0.0000002"):
    how OpenAI-compatible model lists (OpenRouter's `pricing`) write a price."""
    usd = (Decimal(int(micros_per_mtok)) / (MICROS_PER_USD * MTOK)).normalize()
    return f"{usd:f}"


def format_usd(micros: int) -> str:
    """$12.50, $74.97, -$0.42: rounded to the cent (half away from zero)."""
    usd = micros_to_usd(micros).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
    sign = "-" if usd < 0 else ""
    return f"{sign}${abs(usd):,}"


def format_usd_exact(micros: int) -> str:
    """$12.50, $0.000412, -$0.0042: to the micro-dollar, with at least cents."""
    usd = micros_to_usd(micros).normalize()
    if usd.as_tuple().exponent > -2:
        usd = usd.quantize(Decimal("0.01"))
    sign = "-" if usd < 0 else ""
    return f"{sign}${abs(usd):,}"
