"""What /v1 answers when it refuses: one vocabulary of error codes, one exception class per
kind of refusal, each with its HTTP status and OpenAI's error type, and the one place where
billing's refusals become them. Every /v1 error body is OpenAI's
`{"error": {"message", "type", "param", "code"}}`, so the official SDKs raise their own typed
exceptions (`BadRequestError`, `AuthenticationError`, `RateLimitError`...). Pure: no I/O.
"""

from enum import StrEnum

from billing import errors as billing

MAX_BODY_BYTES = 4 * 1024 * 1024  # settings.DATA_UPLOAD_MAX_MEMORY_SIZE matches it


class ErrorCode(StrEnum):
    INVALID_TYPE = "invalid_type"
    DECIMAL_ABOVE_MAX_VALUE = "decimal_above_max_value"
    DECIMAL_BELOW_MIN_VALUE = "decimal_below_min_value"
    REQUEST_TOO_LARGE = "request_too_large"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    MISSING_API_KEY = "missing_api_key"
    INVALID_API_KEY = "invalid_api_key"
    INSUFFICIENT_QUOTA = "insufficient_quota"
    MODEL_NOT_ALLOWED = "model_not_allowed"
    MODEL_NOT_FOUND = "model_not_found"
    UNKNOWN_URL = "unknown_url"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    HOLD_CLOSED = "hold_closed"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    KEY_LIMIT_REACHED = "key_limit_reached"
    ENGINE_REJECTED = "engine_rejected"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_DISCONNECTED = "upstream_disconnected"
    NO_CAPACITY = "no_capacity"
    SERVICE_UNAVAILABLE = "service_unavailable"


class ApiError(Exception):
    """A refusal, answered with `status` and OpenAI's error body. Subclasses fix the status,
    the type and the usual code; an engine's own 4xx keeps its status (`status=`)."""

    status = 400
    type = "invalid_request_error"
    code: ErrorCode | None = None

    def __init__(self, message: str, param: str | None = None, *,
                 code: ErrorCode | None = None, status: int | None = None):
        super().__init__(message)
        self.message, self.param = message, param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": None if self.code is None else str(self.code)}}


class InvalidRequest(ApiError):
    pass


class ContextLengthExceeded(InvalidRequest):
    code = ErrorCode.CONTEXT_LENGTH_EXCEEDED


class RequestTooLarge(ApiError):
    status, code = 413, ErrorCode.REQUEST_TOO_LARGE

    def __init__(self):
        super().__init__(f"The request body is larger than {MAX_BODY_BYTES} bytes.")


class AuthenticationFailed(ApiError):
    status, code = 401, ErrorCode.INVALID_API_KEY


class PaymentRequired(ApiError):
    status, type, code = 402, "insufficient_quota", ErrorCode.INSUFFICIENT_QUOTA


class PermissionDenied(ApiError):
    status, type = 403, "permission_error"


class NotFound(ApiError):
    status = 404


class MethodNotAllowed(ApiError):
    status, code = 405, ErrorCode.METHOD_NOT_ALLOWED

    def __init__(self, method: str, allowed: str):
        super().__init__(f"Method {method} is not allowed here; use {allowed}.")
        self.allowed = allowed


class Conflict(ApiError):
    status = 409


class RateLimited(ApiError):
    status, type, code = 429, "rate_limit_error", ErrorCode.RATE_LIMIT_EXCEEDED


class UpstreamError(ApiError):
    status, type, code = 502, "server_error", ErrorCode.UPSTREAM_ERROR


class ServiceUnavailable(ApiError):
    """Retry shortly: answered with Retry-After."""

    status, type, code = 503, "server_error", ErrorCode.SERVICE_UNAVAILABLE


class NoCapacity(ServiceUnavailable):
    code = ErrorCode.NO_CAPACITY


# Billing's refusals as a client hears them: the class, and the code where it is not the
# class's own. A spend limit is a quota the key's owner set (OpenAI's insufficient_quota type),
# answered 429 so that clients back off instead of asking for a top-up.
_FROM_BILLING: dict[type, tuple[type[ApiError], dict]] = {
    billing.ModelNotAllowed: (PermissionDenied, {"code": ErrorCode.MODEL_NOT_ALLOWED}),
    billing.RateLimited: (RateLimited, {}),
    billing.InsufficientBalance: (PaymentRequired, {}),
    billing.KeySpendLimitReached: (PaymentRequired, {"code": ErrorCode.KEY_LIMIT_REACHED,
                                                      "status": 429}),
    billing.HoldClosed: (Conflict, {"code": ErrorCode.HOLD_CLOSED}),
}


def from_billing(exc: billing.MeteringError) -> ApiError:
    cls, options = _FROM_BILLING[type(exc)]
    return cls(exc.message, **options)
