"""Price arithmetic on integer micro-dollars (no ORM, no float)."""

MTOK = 1_000_000
BPS = 10_000


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def token_cost_micros(*, input_per_mtok: int, output_per_mtok: int, prompt_tokens: int,
                      completion_tokens: int) -> int:
    """Rounded up to the micro-dollar, once per request: a request never costs 0 by rounding."""
    return _ceil_div(prompt_tokens * input_per_mtok + completion_tokens * output_per_mtok, MTOK)


def fee_split(amount_micros: int, fee_bps: int) -> tuple[int, int]:
    """(provider's share, platform fee); the fee is rounded down, so shares sum to the amount."""
    fee = amount_micros * fee_bps // BPS
    return amount_micros - fee, fee


def rental_due_micros(price_per_hour_micros: int, seconds: int) -> int:
    """What `seconds` of rental cost in all. Charges take the difference between two totals,
    so rounding never accumulates however often they run."""
    return price_per_hour_micros * seconds // 3600
