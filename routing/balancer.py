"""Where a request goes among the workers that may take it: weighted rendezvous hashing (HRW)
on an affinity key, bounded by load. Pure: plain values in, plain values out, no I/O.

- **Affinity key.** A client's session (`X-Session-ID`, or the body's `user`) when it gives
  one; otherwise a digest of the conversation's start (the system prompt and the first user
  turn), which every later turn repeats and no other conversation shares; for a completion,
  the prompt's first PROMPT_KEY_CHARS characters. A follow-up then goes to the worker that
  already holds its history in its prefix cache: published fleet figures put a follow-up at
  0.54 s there against 2.56 s anywhere else.
- **Weighted rendezvous hashing.** Each worker scores `-w / ln(U)`, `U` uniform in (0, 1)
  from a stable hash of (key, deployment id); the highest score serves. A key lands on a
  worker with probability w / sum(w), and a worker that comes, goes or changes weight moves
  only the keys it must. Every server process computes the same ranking from the same
  snapshot, with no coordination.
- **Weights** are verified capacity under load (output tok/s at 32 concurrent, measured from
  the platform side, never GPU names: an RTX PRO 6000 and two RTX 4090s both do ~100 tok/s
  alone, 1,342 vs 435 at 32), on a log grid of WEIGHT_STEPS steps per doubling, so that a
  re-measurement a few percent off changes nothing.
- **Bounded load.** The ranking is walked until a worker whose in-flight requests, this one
  included, are within LOAD_FACTOR times its weight's fair share of the fleet's, plus
  LOAD_SLACK, and below the concurrency its capacity was verified at (its slots: beyond them
  an engine queues, and nothing says it serves more). Some worker always is, until the fleet
  is past its slots; then a free slot anywhere comes first, the load bound second. A hot key
  spills over instead of saturating its worker. In flight: what every router process has
  sent it, or what its engine's own metrics last said it runs and queues, whichever is more.
- **Cold start.** A worker new to traffic (newly verified, a new deployment, a node back
  online: its prefix cache is empty) enters at a quarter of its weight and takes a quarter
  more each RAMP_STEP_S (`ramp`, computed with the snapshot): never at zero, never flooded.
- **Follow the latest turn.** A follow-up whose conversation was last served by another
  worker than its key's (a spill, a retry) goes back to that worker while it is under its
  bound and has a slot free: it holds the longer history (`holder`, kept by
  routing/followups.py). Otherwise the ranking decides as above.
- **Retry** goes to the next worker of the same ranking.
"""

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from routing.placement import Fleet, Worker

LOAD_FACTOR = 1.25
LOAD_SLACK = 2  # requests: a worker with little load takes a few over its share
WEIGHT_STEPS = 8  # per doubling: weights move in ~9% steps
PROMPT_KEY_CHARS = 2048  # ~512 tokens of a completion's prompt
RAMP_STEPS = 4  # a new worker's weight: 1/4, 2/4, 3/4, then all of it...
RAMP_STEP_S = int(os.environ.get("RIGSHARE_RAMP_STEP_S", "60"))  # ...a step a minute (s)

HIT, SPILL, NEW = "hit", "spill", "new"


@dataclass(frozen=True)
class Affinity:
    key: bytes  # 16 bytes
    follow_up: bool  # the conversation has been answered before: a worker may hold it


@dataclass(frozen=True)
class Placement:
    workers: tuple[Worker, ...]  # the first serves; the rest, in order, are the retries
    # HIT: the worker holding the conversation (the latest turn's, else the key's own);
    # SPILL: it was too busy; NEW: nothing to find.
    affinity: str
    # The deployment the next turn goes to unless told otherwise: the latest turn's worker
    # when it was asked for (`holder`), else the key's own. A turn served elsewhere is
    # recorded (routing/followups.py).
    expected: int | None = None


def _digest(*parts: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.digest()


def _text(content) -> str:
    return content if isinstance(content, str) else json.dumps(content, sort_keys=True,
                                                                default=str)


def affinity(body: dict, endpoint: str, session: str | None = None) -> Affinity:
    """The request's affinity key. `body` is the parsed request (routing.openai checked it)."""
    user = body.get("user")
    session = session or (user if isinstance(user, str) and user else None)
    if endpoint == "chat":
        messages = [m for m in body.get("messages") or () if isinstance(m, dict)]
        follow_up = any(m.get("role") == "assistant" for m in messages)
        if session:
            return Affinity(_digest("session", session), follow_up)
        system, first_user = [], None
        for message in messages:
            role = message.get("role")
            if role in ("system", "developer") and first_user is None:
                system.append(_text(message.get("content")))
            elif role == "user":
                first_user = _text(message.get("content"))
                break
        return Affinity(_digest("chat", *system, "\x1e", first_user or ""), follow_up)
    if session:
        return Affinity(_digest("session", session), True)
    prompt = body.get("prompt")
    text = _text(prompt)[:PROMPT_KEY_CHARS]
    return Affinity(_digest("prompt", text), len(_text(prompt)) > PROMPT_KEY_CHARS)


def ramp(age_s: float) -> float:
    """The share of its weight a worker takes `age_s` seconds after it came to traffic: in
    whole steps, so every process agrees but at a step's very edge."""
    return ramps(np.array([age_s])).item()


def ramps(ages_s: np.ndarray) -> np.ndarray:
    """`ramp` of each age."""
    return np.minimum(1.0, (np.maximum(ages_s, 0.0) // RAMP_STEP_S + 1) / RAMP_STEPS)


def weight(worker: Worker) -> float:
    """The worker's weight: its verified capacity on a log grid (a renter's own unverified
    card counts 1), times its ramp."""
    return _weights(Fleet([worker]))[0].item()


def _weights(fleet: Fleet) -> np.ndarray:
    weights = fleet.memo.get("weight")
    if weights is None:
        capacity = fleet.cols["capacity"]
        grid = np.round(np.log2(np.maximum(capacity, 1.0)) * WEIGHT_STEPS) / WEIGHT_STEPS
        weights = fleet.memo["weight"] = np.exp2(grid) * fleet.cols["ramp"]
    return weights


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every bit of the input moves every bit of the output."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _scores(key: bytes, fleet: Fleet) -> np.ndarray:
    """`-w / ln(U)` per worker, U uniform in (0, 1) from (key, deployment id): the same on
    every machine (fixed-width integer arithmetic, no salted hash). The deployment ids' half
    of the hash is kept with the fleet; a request mixes in its key."""
    mixed = fleet.memo.get("mixed")
    if mixed is None:
        mixed = fleet.memo["mixed"] = _mix(fleet.cols["id"].astype(np.uint64) * _GOLDEN)
    seed = np.uint64(int.from_bytes(key[:8], "little") ^ int.from_bytes(key[8:16], "little"))
    uniform = ((_mix(mixed ^ seed) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    return -_weights(fleet) / np.log(uniform)


def rank(workers: Sequence[Worker] | Fleet, key: bytes) -> list[Worker]:
    """Every worker, best first, for this key."""
    fleet = Fleet.of(workers)
    return [fleet[i] for i in np.argsort(-_scores(key, fleet), kind="stable")]


TOP = 8  # the ranking's head that placement walks; the whole ranking only if all are too busy


def place(workers: Sequence[Worker] | Fleet, affinity: Affinity,
          load: Mapping[int, int] | None = None, limit: int = 2,
          holder: int | None = None) -> Placement:
    """Up to `limit` workers for the request: the first in the key's ranking under its load
    bound, then the ranking's next ones as retries. In flight per worker: the fleet's load
    column (every router process's, as last exchanged) plus `load` (requests per deployment
    id sent since). `holder`: the deployment that served the conversation's latest turn, first
    if it may take the request."""
    fleet = Fleet.of(workers)
    n = len(fleet)
    if not n:
        return Placement((), NEW)
    weights = _weights(fleet)
    scores = _scores(affinity.key, fleet)
    if n > TOP:
        head = np.argpartition(-scores, TOP)[:TOP]
        order = head[np.argsort(-scores[head], kind="stable")]
    else:
        order = np.argsort(-scores, kind="stable")
    # The routers' own count, or the engine's queue where it says more (traffic that did not
    # come through these routers, or requests it still holds).
    exchanged = fleet.cols["load"]
    routed = fleet.load_plus(load or {})
    inflight = np.maximum(routed, fleet.cols["queue"])
    share = (inflight.sum() + 1) / weights.sum()
    bound = LOAD_FACTOR * share * weights + LOAD_SLACK
    bounded = inflight + 1 <= bound
    slots = fleet.cols["slots"]
    free = (slots == 0) | (inflight < slots)
    seen_free = free
    if fleet.routers > 1:
        # The free slots the other router processes fill after the exchange, this one cannot
        # see: the slots each worker had free then are split between them, so that together
        # they do not queue a request on it while another worker has room.
        mine = routed - exchanged
        free = free & ((slots == 0) | (mine + 1 <= (slots - exchanged) / fleet.routers))
    within = bounded & free
    if not within[order].any():  # the head is busy: walk the whole ranking
        order = np.argsort(-scores, kind="stable")
    top = int(fleet.cols["id"][order[0]])
    if holder is not None:
        held = np.flatnonzero(fleet.cols["id"] == holder)
        if held.size and within[held[0]]:
            rest = order[order != held[0]]
            picked = [int(held[0]), *rest[:limit - 1]]
            return Placement(tuple(fleet[i] for i in picked), HIT, holder)
    # The first under its bound with a slot free; else the first with a slot free (past the
    # concurrency it was verified at, a worker queues: a free slot elsewhere answers sooner);
    # else the first under its bound; else the first with a slot free by all this process
    # sees, its share aside; else the key's own worker.
    chosen = next((int(np.argmax(ok[order])) for ok in (within, free, bounded, seen_free)
                   if ok[order].any()), 0)
    # The retry is the next in the ranking; those over their bound come last (TOP > limit).
    picked = [*order[chosen:], *order[:chosen]][:limit]
    verdict = NEW if not affinity.follow_up else (HIT if chosen == 0 else SPILL)
    return Placement(tuple(fleet[int(i)] for i in picked), verdict,
                     top if holder is None else holder)
