"""How the proxy treats a worker that fails: one frozen policy, and the circuit breaker that
applies it. Retries happen only before the first byte reaches the client (after it, a stream
is cut and billed for what it delivered), on the next worker of the balancer's ranking."""

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    attempts: int = 2  # the first worker, then once the next one, before the first byte only
    breaker_failures: int = 3  # consecutive failures that open a worker's circuit...
    breaker_open_s: float = 15.0  # ...for this long; then one request may try it again
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 120.0  # between two reads of the engine's answer, not in all


POLICY = Policy()


class Breaker:
    """Per worker, in this process: a worker that failed `breaker_failures` times in a row
    gets no traffic for `breaker_open_s`, then one request at a time until one succeeds."""

    def __init__(self, policy: Policy = POLICY):
        self.policy = policy
        self.failures: dict[int, int] = {}
        self.open_until: dict[int, float] = {}

    def is_open(self, deployment_id: int) -> bool:
        return self.open_until.get(deployment_id, 0.0) > time.monotonic()

    def open_ids(self) -> set[int]:
        now = time.monotonic()
        return {d for d, until in self.open_until.items() if until > now}

    def success(self, deployment_id: int) -> None:
        self.failures.pop(deployment_id, None)
        self.open_until.pop(deployment_id, None)

    def failure(self, deployment_id: int) -> None:
        count = self.failures.get(deployment_id, 0) + 1
        self.failures[deployment_id] = count
        if count >= self.policy.breaker_failures:
            self.open_until[deployment_id] = time.monotonic() + self.policy.breaker_open_s


BREAKER = Breaker()
