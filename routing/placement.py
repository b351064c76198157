"""Which workers may take a request: pure, no I/O. In which order: routing/balancer.py.

A model's workers come as a `Fleet`: the Worker rows and, beside them, the columns that
eligibility and the balancer read, as arrays in deployment id order, so that a request costs a
few vectorized passes over the fleet instead of a Python loop per worker (10,000 workers:
docs/benchmarks.md, `make bench-pool`).
"""

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from marketplace import engine_tls
from routing import errors


@dataclass(frozen=True, slots=True)
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
    # May take shared traffic: every card's serving verified, none flagged, the node not held
    # out, and its engine reached over TLS where that is required (engine_tls.py).
    verified: bool
    renter_id: int | None  # a rented card answers only its renter's keys (-1: nobody's)
    ramp: float = 1.0  # the share of its weight a worker new to traffic takes yet (balancer)
    engine_queue: int = 0  # running + waiting, as the engine's /metrics last said (0: unknown)
    ramp_since: float = 0.0  # unix time it came to traffic, which `ramp` counts from
    slots: int = 0  # the concurrency its capacity was verified at (0: not verified)
    # What the proxy sends as `Authorization: Bearer` ("": no key yet). Out of repr: logs.
    engine_key: str = field(default="", repr=False)
    # The engine's certificate (PEM) that an https:// url is pinned to ("": plain HTTP).
    tls_pin: str = field(default="", repr=False)

    @property
    def engine_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.engine_key}"} if self.engine_key else {}

    @property
    def tls_extensions(self) -> dict[str, str]:
        """What a request to it carries for routing/upstream.py to pin its TLS to."""
        return engine_tls.extensions(self.tls_pin)


NOBODY = -1  # renter_id of a worker two renters share: it serves neither
_COLUMNS = {  # column: (dtype, from a Worker)
    "id": (np.int64, lambda w: w.deployment_id),
    "node": (np.int64, lambda w: w.node_id),
    "capacity": (np.float64, lambda w: w.capacity_tps),
    "ramp": (np.float64, lambda w: w.ramp),
    "since": (np.float64, lambda w: w.ramp_since),
    "context": (np.int64, lambda w: w.max_context or 0),  # 0: the model's
    "renter": (np.int64, lambda w: 0 if w.renter_id is None else w.renter_id),  # 0: nobody's
    "verified": (np.bool_, lambda w: w.verified),
    "queue": (np.float64, lambda w: w.engine_queue),
    "slots": (np.float64, lambda w: w.slots),
}


class Fleet(Sequence):
    """A model's workers in deployment id order, with their columns as arrays: `cols["id"]`,
    `["capacity"]`, ..., `["load"]` (requests in flight, every router process's, as last
    exchanged), and whatever the balancer derives and keeps here (`memo`); `routers`: how many
    router processes exchanged that load. Immutable: a change makes a new Fleet, so a request
    reads one consistent fleet."""

    __slots__ = ("_workers", "_index", "cols", "memo", "routers")

    def __init__(self, workers: Sequence[Worker] = (), *, _cols=None, _index=None, _memo=None,
                 routers: int = 1):
        if _cols is None:
            workers = sorted(workers, key=lambda w: w.deployment_id)
            n = len(workers)
            _cols = {name: np.fromiter((get(w) for w in workers), dtype, n)
                     for name, (dtype, get) in _COLUMNS.items()}
            _cols["load"] = np.zeros(n)
        self._workers = tuple(workers)
        self._index = _index  # None: every worker of _workers; else their positions
        self.cols: dict[str, np.ndarray] = _cols
        self.memo: dict[str, np.ndarray] = _memo if _memo is not None else {}
        self.routers = routers

    @classmethod
    def of(cls, workers: "Sequence[Worker] | Fleet") -> "Fleet":
        return workers if isinstance(workers, Fleet) else cls(workers)

    def __len__(self) -> int:
        return len(self.cols["id"])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._workers[i if self._index is None else int(self._index[i])]

    def __iter__(self):
        if self._index is None:
            return iter(self._workers)
        return (self._workers[i] for i in self._index.tolist())

    def __repr__(self) -> str:
        return f"Fleet({list(self)!r})"

    def take(self, mask: np.ndarray) -> "Fleet":
        """The workers where `mask` holds, in the same order (this fleet itself if all do)."""
        if mask.all():
            return self
        where = np.flatnonzero(mask)
        index = where if self._index is None else self._index[where]
        return Fleet(self._workers, _index=index,
                     _cols={k: v[where] for k, v in self.cols.items()},
                     _memo={k: v[where] for k, v in self.memo.items()}, routers=self.routers)

    def patch(self, drop: np.ndarray, add: Sequence[Worker]) -> "Fleet":
        """A new fleet: these workers but those where `drop` holds, and `add`; in deployment
        id order. Costs copies of the arrays, not a pass of Python per worker kept."""
        keep = np.flatnonzero(~drop)
        extra = Fleet(add)
        ids = np.concatenate([self.cols["id"][keep], extra.cols["id"]])
        order = np.argsort(ids, kind="stable")
        cols = {k: np.concatenate([v[keep], extra.cols[k]])[order] for k, v in self.cols.items()}
        workers = [self[i] for i in keep.tolist()] + list(extra)
        return Fleet([workers[i] for i in order.tolist()], _cols=cols)

    def positions(self, deployment_ids) -> tuple[np.ndarray, np.ndarray]:
        """(positions in this fleet, which of `deployment_ids` they are) of those it has."""
        ids = self.cols["id"]
        wanted = np.asarray(deployment_ids, dtype=np.int64)
        at = np.minimum(np.searchsorted(ids, wanted), max(len(ids) - 1, 0))
        found = (ids[at] == wanted) if len(ids) else np.zeros(len(wanted), bool)
        return at[found], np.flatnonzero(found)

    def with_load(self, load: Mapping[int, int], routers: int = 1) -> "Fleet":
        """The same workers with `load` (in flight per deployment id, as `routers` router
        processes exchanged it) as their load column."""
        column = np.zeros(len(self))
        if load:
            at, which = self.positions(list(load))
            column[at] = np.fromiter(load.values(), np.float64, len(load))[which]
        return Fleet(self._workers, _index=self._index, _cols={**self.cols, "load": column},
                     _memo=self.memo, routers=routers)

    def load_plus(self, extra: Mapping[int, int]) -> np.ndarray:
        """The load column plus `extra` requests per deployment id."""
        load = self.cols["load"]
        if not extra:
            return load
        load = load.copy()
        at, which = self.positions(list(extra))
        load[at] += np.fromiter(extra.values(), np.float64, len(extra))[which]
        return load


def eligible(workers: Sequence[Worker] | Fleet, *, user_id: int, context_needed: int,
             model_context: int, open_ids: Collection[int] = ()) -> Fleet | errors.ApiError:
    """The workers that may serve this user's request. A renter's own cards come first: if
    any of them serves the model and fits, only they are used (the renter pays for them).
    Shared traffic goes only to verified workers with a measured capacity that nobody rents.
    `open_ids`: deployments whose circuit is open (routing/retry.py)."""
    fleet = Fleet.of(workers)
    cols = fleet.cols
    context = contexts(fleet, model_context)
    usable = context >= context_needed
    if len(fleet) and not usable.any():
        return errors.ContextLengthExceeded(
            f"This request needs about {context_needed} tokens of context (prompt + "
            f"max_tokens); the largest deployment of this model holds {int(context.max())}. "
            "Shorten the prompt or lower max_tokens.")
    if open_ids:
        usable &= ~np.isin(cols["id"], np.fromiter(open_ids, np.int64, len(open_ids)))
    own = usable & (cols["renter"] == user_id)
    if own.any():
        return fleet.take(own)
    shared = usable & shares(fleet)
    if shared.any():
        return fleet.take(shared)
    return errors.NoCapacity("No verified worker can take this request right now; retry "
                             "shortly.")


def contexts(fleet: Fleet, model_context: int) -> np.ndarray:
    """Each worker's context (prompt + completion tokens): its engine's own, or the model's
    where the engine did not say."""
    return np.where(fleet.cols["context"] > 0, fleet.cols["context"], model_context)


def shares(fleet: Fleet) -> np.ndarray:
    """Which workers take shared traffic: verified, with a measured capacity, rented by
    nobody."""
    cols = fleet.cols
    return (cols["renter"] == 0) & cols["verified"] & (cols["capacity"] > 0)
