"""The simulated engine's scheduler: slots, queue, prefill, processor-shared decode, prefix cache.

No HTTP here; fleetsim.server turns requests into calls of `Engine.generate`. Everything runs
on one asyncio loop, so the counters need no locks.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fleetsim.profiles import Profile

# vLLM hashes the prompt in blocks of 16 tokens, each hash chained to the one before, so a
# block only matches when everything in front of it matches too.
BLOCK_SIZE = 16
# Enough for ~500k tokens of distinct prefixes; bounded so a long demo stays small in memory.
MAX_CACHED_BLOCKS = 32_768


def block_hashes(tokens: list[str]) -> list[int]:
    """Chained hashes of the full blocks of `tokens` (a trailing partial block is not cached)."""
    hashes = []
    parent = 0
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hash((parent, tuple(tokens[start : start + BLOCK_SIZE])))
        hashes.append(parent)
    return hashes


class BlockCache:
    """vLLM-style automatic prefix cache: an LRU of block hashes shared by all requests."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: list[int]) -> int:
        """Number of leading blocks already cached; touching them keeps them warm."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


class SlotCache:
    """llama.cpp's prompt cache: each slot remembers only the last sequence it processed, and a
    new request takes the free slot sharing the longest prefix with it (else the least recently
    used one). So a conversation stays cheap only while its slot has not served someone else."""

    def __init__(self, n_slots: int):
        self._slots: list[list[int]] = [[] for _ in range(n_slots)]
        self._last_used = [0.0] * n_slots
        self._busy = [False] * n_slots

    def acquire(self, hashes: list[int]) -> tuple[int, int]:
        best, best_len = None, -1
        for i, cached in enumerate(self._slots):
            if self._busy[i]:
                continue
            n = _common_prefix(cached, hashes)
            if n > best_len or (n == best_len and self._last_used[i] < self._last_used[best]):
                best, best_len = i, n
        assert best is not None, "the engine admits at most one request per slot"
        self._busy[best] = True
        return best, max(best_len, 0)

    def release(self, slot: int, hashes: list[int]) -> None:
        self._slots[slot] = hashes
        self._busy[slot] = False
        self._last_used[slot] = time.monotonic()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(eq=False)  # identity semantics: requests live in a set
class Request:
    prompt_tokens: list[str]
    max_tokens: int
    emitted: int = 0
    cached_tokens: int = 0
    slot: int | None = None
    hashes: list[int] = field(default_factory=list)
    # Set when the first token exists; the server reads them for llama.cpp's `timings`.
    prefill_s: float = 0.0
    decode_started: float = 0.0


@dataclass
class Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0


class Engine:
    """Admission (at most max_concurrency running, FIFO queue for the rest), prefill at the
    profile's prompt rate minus cached blocks, and decode where every running request gets
    aggregate_tps(n)/n tokens per second, n re-read at every token."""

    def __init__(self, profile: Profile, *, time_scale: float = 1.0, max_concurrency: int | None = None):
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.profile = profile
        self.time_scale = time_scale
        # Share of the profile's speed it serves now: 1 until its machine swaps in a slower
        # engine after it was verified (POST /fleetsim/speed, the simulator's own control).
        self.speed = 1.0
        self.max_concurrency = max_concurrency or profile.max_concurrency
        self.running: set[Request] = set()
        self.waiting: deque[tuple[Request, asyncio.Future]] = deque()
        self.counters = Counters()
        self.kv_capacity_tokens = profile.kv_cache_tokens
        if profile.engine == "llama.cpp":
            self._slots: SlotCache | None = SlotCache(self.max_concurrency)
            self._blocks: BlockCache | None = None
        else:
            self._slots = None
            self._blocks = BlockCache(min(MAX_CACHED_BLOCKS, profile.kv_cache_tokens // BLOCK_SIZE))

    # --- what /metrics reports ---

    @property
    def kv_tokens_in_use(self) -> int:
        return sum(len(r.prompt_tokens) + r.emitted for r in self.running)

    @property
    def kv_usage(self) -> float:
        return min(1.0, self.kv_tokens_in_use / self.kv_capacity_tokens)

    # --- scheduling ---

    async def _admit(self, req: Request) -> None:
        if len(self.running) < self.max_concurrency and not self.waiting:
            self.running.add(req)
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((req, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._finish(req)  # admitted just as the client left: give the slot on
            else:
                self.waiting.remove((req, fut))
            raise

    def _finish(self, req: Request) -> None:
        self.running.discard(req)
        while self.waiting and len(self.running) < self.max_concurrency:
            nxt, fut = self.waiting.popleft()
            if fut.cancelled():
                continue
            self.running.add(nxt)
            fut.set_result(None)

    def _lookup_prefix(self, req: Request) -> None:
        if not self.profile.prefix_cache:
            return
        req.hashes = block_hashes(req.prompt_tokens)
        if self._slots is not None:
            req.slot, blocks = self._slots.acquire(req.hashes)
        else:
            blocks = self._blocks.match(req.hashes)
        # The last prompt token is always computed: its logits start the answer.
        req.cached_tokens = min(blocks * BLOCK_SIZE, len(req.prompt_tokens) - 1)

    def _remember(self, req: Request, output: list[str]) -> None:
        """Cache the prompt and the answer, so the next turn of this conversation hits. A
        request aborted during prefill computed nothing worth keeping."""
        if not self.profile.prefix_cache:
            return
        prefilled = req.decode_started > 0
        hashes = block_hashes(req.prompt_tokens + output) if prefilled else []
        if self._slots is not None:
            self._slots.release(req.slot, hashes)
        else:
            self._blocks.insert(hashes)

    async def generate(self, req: Request, output: list[str]) -> AsyncIterator[list[str]]:
        """Yield batches of newly generated tokens, each batch when its last token is due.

        Usually a batch is one token. When the event loop falls behind (many streams, a large
        time_scale) the tokens already due come out together instead of drifting later, so
        the aggregate rate stays true to the profile.
        """
        loop = asyncio.get_running_loop()
        await self._admit(req)
        try:
            self._lookup_prefix(req)
            c = self.counters
            uncached = len(req.prompt_tokens) - req.cached_tokens
            c.prefix_queries += len(req.prompt_tokens)
            c.prefix_hits += req.cached_tokens
            req.prefill_s = uncached / (self.profile.prefill_tps * self.speed)
            await asyncio.sleep(req.prefill_s / self.time_scale)
            c.prompt_tokens += len(req.prompt_tokens)
            c.prompt_seconds += req.prefill_s
            if self._blocks is not None:
                # Computed prompt blocks are shareable as soon as prefill is done.
                self._blocks.insert(req.hashes)

            req.decode_started = due = loop.time()
            batch: list[str] = []
            while req.emitted < req.max_tokens:
                n = len(self.running)
                step = n / (self.profile.aggregate_tps(n) * self.speed)
                due += step / self.time_scale
                c.decode_seconds += step
                now = loop.time()
                if batch and due > now:
                    yield batch
                    batch = []
                    now = loop.time()
                if due > now:
                    await asyncio.sleep(due - now)
                token = output[req.emitted]
                batch.append(token)
                req.emitted += 1
                c.generation_tokens += 1
            if batch:
                yield batch
        finally:
            if req in self.running:
                self._remember(req, output[: req.emitted])
                self._finish(req)
