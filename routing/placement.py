"""Which workers may take a request: pure, no I/O. In which order: routing/balancer.py."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Worker:
    """One deployment as the pool snapshot holds it."""

    deployment_id: int
    ref: str  # "deployment:12": headers, metrics, charges
    node_id: int
    provider_id: int
    url: str  # the engine's base URL
    engine: str
    engine_model: str  # the id the engine knows the model by
    quantization: str
    max_context: int | None  # None: the engine did not say; the model's context is assumed
    capacity_tps: float  # verified output tok/s at 32 concurrent; 0: not verified
    verified: bool  # every card's serving verified, none flagged, the node not held out
    renter_id: int | None  # a rented card answers only its renter's keys (-1: nobody's)
    ramp: float = 1.0  # the share of its weight a worker new to traffic takes yet (balancer)
    engine_queue: int = 0  # running + waiting, as the engine's /metrics last said (0: unknown)


@dataclass(frozen=True)
class Refusal:
    status: int
    code: str
    message: str


def eligible(workers: Sequence[Worker], *, user_id: int, context_needed: int,
             model_context: int, is_open: Callable[[int], bool] = lambda _: False
             ) -> list[Worker] | Refusal:
    """The workers that may serve this user's request. A renter's own cards come first: if
    any of them serves the model and fits, only they are used (the renter pays for them).
    Shared traffic goes only to verified workers with a measured capacity that nobody rents."""
    fits = [w for w in workers if (w.max_context or model_context) >= context_needed]
    if workers and not fits:
        largest = max(w.max_context or model_context for w in workers)
        return Refusal(400, "context_length_exceeded",
                       f"This request needs about {context_needed} tokens of context (prompt "
                       f"+ max_tokens); the largest deployment of this model holds {largest}. "
                       "Shorten the prompt or lower max_tokens.")
    usable = [w for w in fits if not is_open(w.deployment_id)]
    own = [w for w in usable if w.renter_id == user_id]
    if own:
        return own
    shared = [w for w in usable if w.renter_id is None and w.verified and w.capacity_tps > 0]
    if shared:
        return shared
    return Refusal(503, "no_capacity", "No verified worker can take this request right now; "
                   "retry shortly.")
