"""Prometheus metrics of the inference API (prometheus-client), per server process: scrape each
process (docs/operations.md). Labels are bounded: model names and worker refs come from the
pool, never from the client."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry(auto_describe=True)

REQUESTS = Counter("rigshare_requests", "Inference requests by outcome",
                   ["endpoint", "model", "worker", "status"], registry=REGISTRY)
TOKENS = Counter("rigshare_tokens", "Tokens billed", ["model", "worker", "kind"],
                 registry=REGISTRY)
TTFT = Histogram("rigshare_ttft_seconds", "Time to the first byte of the answer",
                 ["model", "worker"], registry=REGISTRY,
                 buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
LATENCY = Histogram("rigshare_request_seconds", "Time to the end of the answer",
                    ["model", "worker"], registry=REGISTRY,
                    buckets=(.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300))
RETRIES = Counter("rigshare_retries", "Requests that tried a second worker", ["model"],
                  registry=REGISTRY)
POOL_GENERATION = Gauge("rigshare_pool_generation", "Snapshots built by this process",
                        registry=REGISTRY)
POOL_WORKERS = Gauge("rigshare_pool_workers", "Deployments in the pool snapshot", ["model"],
                     registry=REGISTRY)
POOL_VERSION = Gauge("rigshare_pool_version_info", "Digest of the pool snapshot in use",
                     ["version"], registry=REGISTRY)
IN_FLIGHT = Gauge("rigshare_in_flight", "Requests being proxied, all processes, per worker",
                  ["worker"], registry=REGISTRY)


def observe(outcome, latency_s: float) -> None:
    worker = outcome.worker.ref if outcome.worker else ""
    model = outcome.model if worker else ""  # unknown names are the client's, not labels
    REQUESTS.labels(outcome.endpoint, model, worker, str(outcome.status)).inc()
    if outcome.attempts > 1:
        RETRIES.labels(model).inc()
    if not worker:
        return
    if outcome.prompt_tokens:
        TOKENS.labels(model, worker, "prompt").inc(outcome.prompt_tokens)
    if outcome.completion_tokens:
        TOKENS.labels(model, worker, "completion").inc(outcome.completion_tokens)
    if outcome.ttft_s is not None:
        TTFT.labels(model, worker).observe(outcome.ttft_s)
    LATENCY.labels(model, worker).observe(latency_s)


def pool_changed(snapshot) -> None:
    POOL_GENERATION.set(snapshot.generation)
    POOL_VERSION.clear()
    POOL_VERSION.labels(snapshot.version).set(1)
    POOL_WORKERS.clear()
    for model, workers in snapshot.workers.items():
        POOL_WORKERS.labels(model).set(len(workers))
    IN_FLIGHT.clear()
    refs = {w.deployment_id: w.ref for ws in snapshot.workers.values() for w in ws}
    for deployment_id, count in snapshot.load.items():
        if deployment_id in refs:
            IN_FLIGHT.labels(refs[deployment_id]).set(count)


def render() -> bytes:
    return generate_latest(REGISTRY)
