"""Billing's refusals, one class each: plain exceptions with a message, no HTTP and no Django,
so that any caller can import them. How /v1 answers each: routing/errors.py."""


class MeteringError(Exception):
    """Metering refused the request, and moved nothing. Each refusal is a class of its own;
    how a client hears it (status, OpenAI's error shape) is the API's business
    (routing/errors.py)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ModelNotAllowed(MeteringError):
    pass


class RateLimited(MeteringError):
    pass


class InsufficientBalance(MeteringError):
    pass


class KeySpendLimitReached(MeteringError):
    pass


class HoldClosed(MeteringError):
    pass
