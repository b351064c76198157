"""The live figures' arithmetic (routing/traffic.py), with plain values."""

from datetime import UTC, datetime, timedelta

import pytest

from routing import traffic

BANDS = traffic.bands([1, 8, 32])
T0 = datetime(2026, 12, 6, 12, 3, 20, tzinfo=UTC)


def served(**kw) -> traffic.Served:
    row = dict(deployment_id=7, at=T0, status=200, concurrency=1, stream=True,
               completion_tokens=101, ttft_ms=250.0, latency_ms=2250.0)
    return traffic.Served(**(row | kw))


def test_bands_follow_the_levels_verification_measures():
    assert BANDS == (1, 2, 9, 33)
    assert [traffic.band_of(c, BANDS) for c in (0, 1, 2, 8, 9, 32, 33, 500)] == [
        1, 1, 2, 2, 9, 9, 33, 33]
    assert [traffic.band_label(b, BANDS) for b in BANDS] == ["1", "2\u20138", "9\u201332", "33+"]
    assert traffic.band_top(9, BANDS) == 32 and traffic.band_top(33, BANDS) is None
    assert traffic.bands([32, 8, 1, 8]) == BANDS


def test_decode_speed_counts_from_the_first_token_to_the_last():
    # 100 tokens after the first in 2.0 s: 50 tok/s, whatever the 250 ms before it.
    sums = traffic.Sums()
    for values in traffic.deltas([served()], BANDS).values():
        sums.add(values)
        break
    assert sums.tokens_per_s == pytest.approx(50.0)
    # A queue in front of the engine lengthens the TTFT, not the decode speed.
    queued = traffic.Sums()
    queued.add(next(iter(traffic.deltas([served(ttft_ms=5250.0, latency_ms=7250.0)],
                                        BANDS).values())))
    assert queued.tokens_per_s == pytest.approx(50.0)
    assert queued.ttft_ms(0.5) > 5000 > sums.ttft_ms(0.5)


def test_what_counts_for_speed_and_what_only_for_requests_and_errors():
    rows = [served(),
            served(stream=False, ttft_ms=2250.0),  # not streamed: no decode time to read
            served(completion_tokens=5, latency_ms=400.0),  # too short to time
            served(status=502, completion_tokens=0, ttft_ms=None),  # the worker failed
            served(status=499, completion_tokens=40)]  # the client left: not the worker's
    sums = {}
    for (_deployment, span, _start, _band), values in traffic.deltas(rows, BANDS).items():
        s = sums.setdefault(span, traffic.Sums())
        s.add(values)
    hour = sums[traffic.FIVE_MINUTES]
    assert (hour.requests, hour.errors, hour.streams) == (5, 1, 1)
    assert sums[traffic.HOUR].requests == 5


def test_each_request_lands_in_its_bucket_of_each_span_and_band():
    rows = [served(concurrency=1), served(concurrency=6), served(concurrency=6),
            served(concurrency=6, at=T0 + timedelta(minutes=5)), served(deployment_id=8)]
    out = traffic.deltas(rows, BANDS)
    five = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
    hour = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
    assert out[(7, 300, five, 2)][0] == 2
    assert out[(7, 300, five + timedelta(minutes=5), 2)][0] == 1
    assert out[(7, 3600, hour, 2)][0] == 3
    assert out[(7, 3600, hour, 1)][0] == 1
    assert out[(8, 3600, hour, 1)][0] == 1
    assert len(out) == 7


def test_percentiles_read_the_histogram():
    hist = [0] * traffic.TTFT_BINS
    hist[traffic.ttft_bin(150)] = 50  # 100-200 ms
    hist[traffic.ttft_bin(2500)] = 50  # 2-3 s
    assert traffic.percentile(hist, 0.5) == pytest.approx(200)
    assert 2000 < traffic.percentile(hist, 0.95) <= 3000
    assert traffic.percentile([0] * traffic.TTFT_BINS, 0.5) is None
    slow = [0] * traffic.TTFT_BINS
    slow[-1] = 3
    assert traffic.percentile(slow, 0.5) > traffic.TTFT_BOUNDS_MS[-1]


def test_window_figures_sum_bands_and_keep_each():
    one, many = traffic.Sums(), traffic.Sums()
    one.add(next(iter(traffic.deltas([served()], BANDS).values())))
    many.add(next(iter(traffic.deltas([served(concurrency=20, latency_ms=4250.0)],
                                      BANDS).values())))
    figures = traffic.window_figures({1: one, 9: many}, BANDS, 99.5)
    assert figures["requests"] == 2 and figures["uptime_pct"] == 99.5
    assert [b["label"] for b in figures["bands"]] == ["1", "9\u201332"]
    assert figures["bands"][0]["tokens_per_s"] == 50.0
    assert figures["bands"][1]["tokens_per_s"] == 25.0
    # Both together, weighted by tokens: 200 tokens in 6 s.
    assert figures["tokens_per_s"] == pytest.approx(33.3, abs=0.1)
    assert figures["error_pct"] == 0.0


def test_uptime_is_the_share_of_the_window_online():
    assert traffic.uptime_pct(360, 3600) == 90.0
    assert traffic.uptime_pct(0, 3600) == 100.0
    assert traffic.uptime_pct(9999, 3600) == 0.0


def test_a_request_is_judged_at_the_most_in_flight_while_it_ran():
    # A stream sent first and ended last is alone at both ends; it decoded beside the others.
    from routing import placement, proxy

    worker = placement.Worker(
        deployment_id=987654321, ref="deployment:987654321", node_id=1, provider_id=1,
        url="http://127.0.0.1:9", engine="vllm", engine_model="m", quantization="",
        max_context=None, capacity_tps=0.0, verified=False, renter_id=None)
    first, second, third = (proxy.Outcome(request_id=f"r{i}", endpoint="chat", started=0.0)
                            for i in range(3))
    proxy._slot_taken(worker, first)
    assert first.concurrency == 1
    proxy._slot_taken(worker, second)
    proxy._slot_taken(worker, third)
    proxy._slot_free(worker, second)
    proxy._slot_free(worker, third)
    proxy._slot_free(worker, first)
    assert (first.concurrency, second.concurrency, third.concurrency) == (3, 3, 3)
    assert worker.deployment_id not in proxy.RUNNING
    assert worker.deployment_id not in proxy.INFLIGHT
