"""Drift: served traffic far below the verified speed. The arithmetic with plain values, then
through the real /v1 proxy (uvicorn on a thread, fleetsim engines): a busy honest engine that
queues at its slot limit is never taken for a slow one, and one that swaps in a slower engine
after it was verified loses routing weight, gets a run and its provider an alert."""

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import openai
import pytest
from django.utils import timezone

from fleetsim.profiles import get_profile
from marketplace.models import ProviderAlert
from routing import drift, pool, served, traffic
from tests.routing.conftest import MODEL, Seen, seen_rate, streamed
from verification.findings import THRESHOLDS
from verification.models import Measurement, ServedDrift, VerificationRun, VerifiedCapacity

BANDS = traffic.bands([1, 8, 32])
LOW = THRESHOLDS["serving"][0]


def sums(streams: int, tps: float) -> traffic.Sums:
    s = traffic.Sums()
    s.add([streams, 0, streams, int(100 * streams), 100 * streams / tps * 1000]
          + [0] * traffic.TTFT_BINS)
    return s


VERIFIED = {7: {1: 60.0, 8: 400.0, 32: 1280.0}}  # per stream: 60, 50, 40


def test_a_band_far_below_its_verified_speed_per_stream_drifts():
    (found,) = drift.find({7: {2: sums(30, 20.0)}}, VERIFIED, BANDS, threshold=LOW)
    assert (found.band, found.level, found.verified_tps, found.served_tps) == (2, 8, 50.0, 20.0)
    # At the threshold's edge: 71% is not far below, 69% is.
    assert not drift.find({7: {2: sums(30, 35.5)}}, VERIFIED, BANDS, threshold=LOW)
    assert drift.find({7: {2: sums(30, 34.5)}}, VERIFIED, BANDS, threshold=LOW)


def test_what_is_never_judged_drifting():
    slow = sums(30, 10.0)
    # Too few streams to be sure.
    assert not drift.find({7: {2: sums(drift.MIN_STREAMS - 1, 10.0)}}, VERIFIED, BANDS,
                          threshold=LOW)
    # Beyond the highest level verified: nothing to compare with.
    assert not drift.find({7: {33: slow}}, VERIFIED, BANDS, threshold=LOW)
    # A level the run did not measure, or no verified figures at all.
    assert not drift.find({7: {9: slow}}, {7: {1: 60.0, 8: 400.0}}, BANDS, threshold=LOW)
    assert not drift.find({8: {2: slow}}, VERIFIED, BANDS, threshold=LOW)
    # The engine reports more running than the band holds: traffic the platform does not see.
    assert not drift.find({7: {2: slow}}, VERIFIED, BANDS, threshold=LOW,
                          engine_running={7: 12})
    # Each stream of a band is judged at the band's top, where it is slowest: 41 tok/s per
    # stream with 9-32 at once is what 32 at once give (40), not slow.
    assert not drift.find({7: {9: sums(30, 41.0)}}, VERIFIED, BANDS, threshold=LOW)


def test_the_worst_band_speaks_for_the_deployment():
    (found,) = drift.find({7: {1: sums(30, 30.0), 2: sums(30, 15.0)}}, VERIFIED, BANDS,
                          threshold=LOW)
    assert found.band == 2


def test_most_providers_slow_at_once_is_the_platforms_side_and_blames_no_one():
    fast, slow = sums(30, 48.0), sums(30, 20.0)
    verified = {pk: VERIFIED[7] for pk in range(1, 13)}
    # Three providers of four, every deployment slow in the same window: the proxy that reads
    # their speed (CPU, network) is what they share.
    everyone = {pk: {2: slow} for pk in range(1, 9)}
    owners = {pk: 100 + pk % 4 for pk in range(1, 13)}
    assert drift.find(everyone, verified, BANDS, threshold=LOW, owners=owners) == []
    mostly = everyone | {4: {2: fast}, 8: {2: fast}}  # provider 100 serves at full speed
    assert drift.find(mostly, verified, BANDS, threshold=LOW, owners=owners) == []
    # One provider's fleet slow among honest others is that provider's, however many machines.
    one = {pk: {2: slow if owners[pk] == 101 else fast} for pk in range(1, 13)}
    found = drift.find(one, verified, BANDS, threshold=LOW, owners=owners)
    assert sorted(d.deployment_id for d in found) == [1, 5, 9]
    # Two of five providers slow: not most of them, both found.
    owners5 = {pk: 200 + pk % 5 for pk in range(1, 11)}
    two = {pk: {2: slow if owners5[pk] in (201, 202) else fast} for pk in range(1, 11)}
    found = drift.find(two, verified, BANDS, threshold=LOW, owners=owners5)
    assert sorted(d.deployment_id for d in found) == [1, 2, 6, 7]
    # Fewer providers than COMMON_CAUSE's least: each is judged on its own.
    pair = {1: {2: slow}, 2: {2: slow}}
    assert len(drift.find(pair, verified, BANDS, threshold=LOW, owners={1: 1, 2: 2})) == 2


# --- through the proxy ------------------------------------------------------------------------

SCALE = 4
TOKENS = 48


def verified_levels(deployment, profile):
    """The deployment's run, as a load test of this engine at SCALE writes it."""
    run = VerificationRun.objects.get(node=deployment.node)
    for level in (1, 8, 32):
        tps = profile.aggregate_tps(min(level, profile.max_concurrency)) * SCALE
        Measurement.objects.create(run=run, metric=f"tps@{level}", value=tps, unit="tok/s")


def traffic_for(v1, key, *, concurrency: int, streams: int) -> list[Seen]:
    client = openai.OpenAI(base_url=v1, api_key=key, max_retries=0, timeout=120)
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda _: streamed(client, max_tokens=TOKENS), range(streams)))


@pytest.mark.django_db(transaction=True)
def test_a_busy_honest_engine_at_its_slot_limit_is_never_slow(v1, carol_key, engine, deploy,
                                                               settled, gpu_specs):
    profile = get_profile("rtx-pro-6000")
    # Four slots, twelve requests at once: eight wait in the engine's queue at any time.
    deployment = deploy(engine("rtx-pro-6000", time_scale=SCALE, max_concurrency=4))
    verified_levels(deployment, profile)
    seen = traffic_for(v1, carol_key, concurrency=12, streams=36)
    settled()
    assert served.served_figures_refresh()["drifts"] == 0
    assert not ServedDrift.objects.exists()
    hour = deployment.node.cards.get()
    hour.refresh_from_db()
    figures = hour.served["models"][0]["hour"]
    busy = {b["band"]: b for b in figures["bands"]}
    # Nine and more were in flight at once. Each stream's decode speed leaves out its wait in
    # the engine's queue: with twelve at once for four slots each stream waited about two
    # others' time, so its decode runs well above what its client saw over the whole request,
    # and far above what the band is judged against (32 at once). (The simulator's clock runs
    # SCALE times fast and falls behind on a crowded machine: the clients' view is the
    # reference, not the profile.)
    assert busy[9]["streams"] >= drift.MIN_STREAMS
    assert busy[9]["tokens_per_s"] > 1.8 * seen_rate(seen, whole=True)
    assert busy[9]["tokens_per_s"] > 1.5 * profile.aggregate_tps(4) * SCALE / 32


@pytest.mark.django_db(transaction=True)
def test_an_engine_that_slows_after_verification_loses_weight_and_gets_a_run(
        v1, carol_key, engine, deploy, settled, gpu_specs):
    profile = get_profile("rtx-pro-6000")
    url = engine("rtx-pro-6000", time_scale=SCALE)
    deployment = deploy(url)
    verified_levels(deployment, profile)
    traffic_for(v1, carol_key, concurrency=4, streams=24)
    settled()
    assert served.served_figures_refresh()["drifts"] == 0

    assert httpx.post(f"{url}/fleetsim/speed", json={"factor": 0.3}).json() == {"speed": 0.3}
    switched = time.monotonic()
    traffic_for(v1, carol_key, concurrency=4, streams=40)
    settled()
    assert served.served_figures_refresh()["drifts"] == 1
    episode = ServedDrift.objects.get()
    assert episode.node_id == deployment.node_id and episode.level == 8
    assert episode.served_tps < LOW * episode.verified_tps
    # Routing weighs it by what it served, the run is under way, the provider knows.
    capacity = VerifiedCapacity.objects.get(card__node=deployment.node)
    assert capacity.routing_tps == pytest.approx(capacity.tokens_per_s * episode.ratio)
    worker = pool.build().workers[MODEL]
    assert worker.cols["capacity"][0] == pytest.approx(capacity.routing_tps)
    run = VerificationRun.objects.get(node=deployment.node, trigger="served_traffic")
    assert episode.run_id == run.pk and run.is_active
    alert = ProviderAlert.objects.get(kind="served_slow")
    assert alert.owner_id == deployment.node.owner_id and "per stream" in alert.message
    assert time.monotonic() - switched < 120
    # The same slow traffic a minute later opens nothing more while the run checks it.
    traffic_for(v1, carol_key, concurrency=4, streams=8)
    settled()
    assert served.served_figures_refresh(now=timezone.now() + timedelta(minutes=1))[
        "drifts"] == 0
    assert ServedDrift.objects.count() == 1
