"""Reliability from heartbeats: the pure arithmetic, the service and the chart."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from billing import charts
from marketplace import selectors, services, uptime
from marketplace.models import NodeUptimeHour
from tests.factories import NodeFactory

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def test_credited_seconds_is_capped_at_an_hour():
    assert uptime.credited_seconds(0, 10) == 0
    assert uptime.credited_seconds(180, 10) == 1800
    assert uptime.credited_seconds(400, 10) == 3600


def test_reliability_pct():
    assert uptime.reliability_pct(1800, 3600) == Decimal("50.00")
    assert uptime.reliability_pct(3600, 1800) == Decimal("100.00")
    assert uptime.reliability_pct(1, 3) == Decimal("33.33")
    assert uptime.reliability_pct(10, 0) == Decimal("0.00")


def test_hour_bars_skip_time_before_enrolment_and_judge_the_current_hour_by_its_past():
    counts = {T0: 360, T0 + timedelta(hours=1): 90, T0 + timedelta(hours=2): 30}
    bars = uptime.hour_bars(counts, start=T0 - timedelta(hours=3),
                            end=T0 + timedelta(hours=2, minutes=10), interval_s=10,
                            not_before=T0)
    assert [b.pct for b in bars] == [Decimal("100.00"), Decimal("25.00"), Decimal("50.00")]
    chart = charts.uptime_chart(bars)
    assert [b.css for b in chart.bars] == ["up", "partial", "partial"]
    assert all(0 <= b.y <= chart.height and b.height > 0 for b in chart.bars)
    # Three hours of history sit at the right end of a 48-hour axis.
    slot = chart.width / 48
    assert chart.bars[0].x == pytest.approx(45 * slot + 1)
    assert chart.bars[-1].x + chart.bars[-1].width == pytest.approx(chart.width - 1)
    assert (chart.first_label, chart.last_label) == ("48 h ago", "now")


@pytest.mark.django_db
def test_reliability_over_the_window_since_enrolment(settings):
    settings.RIGSHARE_HEARTBEAT_INTERVAL_S = 10
    node = NodeFactory(created_at=T0, reliability_pct=0)
    # Up for the whole first hour, down the second, half the third.
    NodeUptimeHour.objects.create(node=node, hour=T0, heartbeats=360)
    NodeUptimeHour.objects.create(node=node, hour=T0 + timedelta(hours=2), heartbeats=180)
    services.nodes_refresh_reliability(now=T0 + timedelta(hours=3))
    node.refresh_from_db()
    assert node.reliability_pct == Decimal("50.00")
    # Thirty-one days on, only the last thirty count, and nothing was heard in them.
    services.nodes_refresh_reliability(now=T0 + timedelta(days=31))
    node.refresh_from_db()
    assert node.reliability_pct == Decimal("0.00")


@pytest.mark.django_db
def test_uptime_bars_from_the_database():
    node = NodeFactory(created_at=T0)
    NodeUptimeHour.objects.create(node=node, hour=T0, heartbeats=360)
    bars = selectors.node_uptime_bars(node, now=T0 + timedelta(hours=1, minutes=30))
    assert [b.pct for b in bars] == [Decimal("100.00"), Decimal("0.00")]
