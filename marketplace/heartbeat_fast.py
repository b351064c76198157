"""What the heartbeat fast path keeps in Redis (docs/agent-protocol.md, "Repeated reports").

Most heartbeats repeat the node's previous report word for word. The full path
(agentapi.views.AgentHeartbeat: ~10 statements) stores a report in PostgreSQL and, when its answer
is one a repeat would get again (online, no jobs, nothing about to change), leaves an entry
here under the credential's prefix. agentapi.asgi answers a repeat from that entry before
Django's handler, without PostgreSQL, and counts the heartbeat here;
marketplace.services.heartbeats_flush moves the counts into PostgreSQL every few seconds.

Keys, all under `rigshare:heartbeat:`:
  entry:<prefix>  JSON {node, digest, report, raw, at, body}: the node, its credential's
                  stored HMAC, the sha256 of the report parsed with its keys sorted and of its
                  exact bytes, when the full path wrote it (unix s), the answer to repeat.
                  Expires FULL_EVERY_S after that write, so PostgreSQL gets a full report
                  from every node at least that often.
  gen:<prefix>    bumped by every forget. The full path reads it before it reads anything its
                  answer depends on and writes its entry only if it has not moved since, so an
                  answer made stale meanwhile (a job queued, the node revoked) is never stored.
  live            hash: node id -> unix time of its latest fast heartbeat
  beats           hash: "<node id>:<hour, unix s>" -> fast heartbeats counted in that hour

Redis holds nothing here that the platform cannot do without: while it is away every
heartbeat takes the full path, and a forget that could not reach it is made good by the
entry's expiry.
"""

import hashlib
import json
import logging
import math
import time

from django.conf import settings

from config.redis import REDIS_ERRORS, redis_client

log = logging.getLogger(__name__)

PREFIX = "rigshare:heartbeat:"
LIVE = PREFIX + "live"
BEATS = PREFIX + "beats"
# A repeated report takes the full path again once its entry is this old. It sets what a fleet
# costs: at a 10 s interval one heartbeat in FULL_EVERY_S / 10 is full (~15x a fast one). Ten
# minutes is how often the platform looks up an engine's address again anyway
# (marketplace.services.ENGINE_RECHECK), and what it leaves behind is display only (a card's
# "last seen"): liveness and uptime move every flush, and every change that matters to an
# answer forgets the entry at once. At one minute, 2 cores hold ~3,000 agents, not 10,000
# (docs/benchmarks.md, "Heartbeats").
FULL_EVERY_S = 600
# What a report may change without being a new one: the PCIe link's current generation and
# width move with load (the GPU saves power when idle), and a busy GPU would otherwise never
# repeat its report. The full path stores them when anything else changes, or at FULL_EVERY_S.
# A GPU's power draw moves the same way (agents send it only while the platform measures the
# machine, and then take the full path, but a repeat must not turn new over a watt).
VOLATILE_GPU_FACTS = ("pcie_gen_current", "pcie_width_current", "power_draw_w")
# Free disk space moves with every log line and download, the same way.
VOLATILE_HOST_FACTS = ("disk_free_gb",)
GEN_TTL_S = 86_400  # a generation outlives any full heartbeat in flight by far

# A fast heartbeat counted, in one step: the node's latest time, its hour's count.
RECORD = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
return 1
"""
# Write the entry only if no forget has moved the generation since the full path began.
_REMEMBER = """
if (redis.call('GET', KEYS[2]) or '') ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
return 1
"""
# Take both hashes in one step: a fast heartbeat counted meanwhile lands in the next flush.
_TAKE = """
local taken = {redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2])}
redis.call('DEL', KEYS[1], KEYS[2])
return taken
"""
# Put back what a flush took and could not store: the later time of each node, counts added.
_GIVE_BACK = """
local n = tonumber(ARGV[1])
for i = 2, 2 * n, 2 do
  local held = redis.call('HGET', KEYS[1], ARGV[i])
  if not held or tonumber(held) < tonumber(ARGV[i + 1]) then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
for i = 2 * n + 2, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1])
end
return 1
"""


def enabled() -> bool:
    """The fast path needs Redis, and the flush's SQL needs PostgreSQL (the zero-setup demo has
    neither: every heartbeat takes the full path there)."""
    return bool(settings.REDIS_URL) and \
        settings.DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql"


def entry_key(prefix: str) -> str:
    return f"{PREFIX}entry:{prefix}"


def gen_key(prefix: str) -> str:
    return f"{PREFIX}gen:{prefix}"


def body_digest(body: bytes) -> str:
    """sha256 of the body's exact bytes."""
    return hashlib.sha256(body).hexdigest()


def report_digest(body: bytes) -> str | None:
    """sha256 of the report as parsed JSON with its keys sorted and its volatile facts left out
    (key order, spacing, a PCIe link or free disk space that moved do not make a report new);
    None for a body that is not JSON."""
    try:
        parsed = json.loads(body)
        gpus = parsed.get("gpus") if isinstance(parsed, dict) else None
        for gpu in gpus if isinstance(gpus, list) else ():
            if isinstance(gpu, dict):
                for name in VOLATILE_GPU_FACTS:
                    gpu.pop(name, None)
        host = parsed.get("host") if isinstance(parsed, dict) else None
        if isinstance(host, dict):
            for name in VOLATILE_HOST_FACTS:
                host.pop(name, None)
        canonical = json.dumps(parsed, sort_keys=True, separators=(",", ":"))
    except (ValueError, RecursionError):
        return None
    return hashlib.sha256(canonical.encode()).hexdigest()


def beat_field(node_id: int, now: float) -> str:
    return f"{node_id}:{math.floor(now / 3600) * 3600}"


def generation(prefix: str | None) -> str | None:
    """The credential's generation now ('' before any forget); None when no entry may be
    written (no fast path, a malformed credential, Redis away)."""
    if not prefix or not enabled():
        return None
    try:
        value = redis_client().get(gen_key(prefix))
    except REDIS_ERRORS:
        return None
    return value.decode() if value is not None else ""


def remember(*, prefix: str, generation: str, node_id: int, credential_digest: str,
             body: bytes, answer: bytes, now: float | None = None) -> bool:
    """Store the entry a repeat of the report `body` is answered from; False when a forget
    came first, the body is not JSON, or Redis is away."""
    report = report_digest(body)
    if report is None:
        return False
    entry = json.dumps({"node": node_id, "digest": credential_digest, "report": report,
                        "raw": body_digest(body), "at": now if now is not None else time.time(),
                        "body": answer.decode()}, separators=(",", ":"))
    try:
        client = redis_client()
        return bool(client.register_script(_REMEMBER)(
            keys=[entry_key(prefix), gen_key(prefix)],
            args=[generation, entry, FULL_EVERY_S]))
    except REDIS_ERRORS:
        return False


def forget(prefixes: list[str]) -> bool:
    """Drop the credentials' entries and void any entry a full heartbeat in flight is about to
    write; False when Redis could not be told (the entries then expire on their own within
    FULL_EVERY_S)."""
    if not prefixes or not enabled():
        return True
    try:
        with redis_client().pipeline(transaction=True) as pipe:
            for prefix in prefixes:
                pipe.incr(gen_key(prefix))
                pipe.expire(gen_key(prefix), GEN_TTL_S)
                pipe.delete(entry_key(prefix))
            pipe.execute()
    except REDIS_ERRORS:
        log.warning("heartbeat fast path: %d entries not forgotten, Redis is away; they expire "
                    "within %d s", len(prefixes), FULL_EVERY_S)
        return False
    return True


def take() -> tuple[dict[int, float], dict[tuple[int, int], int]]:
    """Take every fast heartbeat counted so far out of Redis: ({node id: latest unix time},
    {(node id, hour unix s): count}). Raises what Redis raises."""
    live, beats = redis_client().register_script(_TAKE)(keys=[LIVE, BEATS])
    times = {int(live[i]): float(live[i + 1]) for i in range(0, len(live), 2)}
    counts = {}
    for i in range(0, len(beats), 2):
        node, hour = beats[i].split(b":")
        counts[(int(node), int(hour))] = int(beats[i + 1])
    return times, counts


def give_back(times: dict[int, float], counts: dict[tuple[int, int], int]) -> None:
    """Return what take() took, for a flush that could not store it. Raises what Redis raises."""
    args: list = [len(times)]
    for node_id, at in times.items():
        args += [node_id, repr(at)]
    for (node_id, hour), count in counts.items():
        args += [f"{node_id}:{hour}", count]
    redis_client().register_script(_GIVE_BACK)(keys=[LIVE, BEATS], args=args)
