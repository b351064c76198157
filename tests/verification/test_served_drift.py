"""An episode of served traffic slower than verified, through verification's side: opened
(routing weight, a run with trigger "served traffic", the provider's alert), then judged by its
run: confirmed when the run measures the slowness itself, or when runs keep finding full speed
while the traffic keeps being slow; otherwise not confirmed, the run's figure standing and the
episode kept in the card's history. The machines are judged by the real evaluation
(tests/verification/machines.py)."""

from datetime import timedelta

import pytest
from django.utils import timezone

from fleetsim.profiles import get_profile
from marketplace.models import Card, ProviderAlert
from routing.models import Deployment
from tests.verification.machines import judged_node, measure
from verification import services
from verification.models import Finding, Measurement, ServedDrift, VerificationRun, VerifiedCapacity

pytestmark = pytest.mark.django_db

PROFILE = get_profile("2x-rtx-5090")


def episode(node, *, share: float, now=None):
    """Served traffic of 2 to 32 at once at `share` of the speed per stream verified at 32."""
    verified = Measurement.objects.filter(run__node=node, metric="tps@32", card=None) \
        .order_by("-run__finished_at").first().value / 32
    deployment = Deployment.objects.get_or_create(node=node, engine_model_id=PROFILE.model)[0]
    return services.served_drift_open(
        node_id=node.pk, deployment_id=deployment.pk, model=PROFILE.model, band=9,
        band_label="9\u201332", level=32, served_tps=round(verified * share, 2),
        verified_tps=round(verified, 2), streams=40, window_start=timezone.now(), now=now)


def served_finding(run) -> Finding:
    return Finding.objects.filter(run=run, metric="served").first()


def statuses(node) -> set[str]:
    return set(Card.objects.filter(node=node).values_list("verification_status", flat=True))


def test_a_slow_episode_opens_once_and_acts_at_once(bob, gpu_specs):
    node = judged_node(bob, PROFILE)
    assert statuses(node) == {"verified"}
    drift = episode(node, share=0.3)
    assert drift is not None and drift.run.trigger == "served_traffic"
    for capacity in VerifiedCapacity.objects.filter(card__node=node):
        assert capacity.routing_tps == pytest.approx(capacity.tokens_per_s * drift.ratio)
    assert ProviderAlert.objects.filter(node=node, kind="served_slow").count() == 1
    assert episode(node, share=0.2) is None  # one at a time
    assert ServedDrift.objects.count() == 1


def test_the_run_measuring_the_slowness_itself_confirms_it(bob, gpu_specs):
    node = judged_node(bob, PROFILE)
    drift = episode(node, share=0.3)
    measure(drift.run, PROFILE, own_factor=0.3)
    found = served_finding(drift.run)
    assert found.severity == "mismatch" and "Confirmed: the run measured" in found.message
    assert "per stream over 40 requests at 9\u201332 concurrent" in found.message
    assert statuses(node) == {"flagged"}
    drift.refresh_from_db()
    assert drift.outcome == "confirmed" and drift.closed_at is not None


def test_a_run_at_full_speed_clears_it_and_its_figure_stands(bob, gpu_specs):
    node = judged_node(bob, PROFILE)
    drift = episode(node, share=0.3)
    run = measure(drift.run, PROFILE)
    found = served_finding(run)
    assert found.severity == "warning" and "Not confirmed" in found.message
    assert statuses(node) == {"verified"}
    drift.refresh_from_db()
    assert drift.outcome == "cleared"
    # Routing weighs it by the run's figure again.
    for capacity in VerifiedCapacity.objects.filter(card__node=node):
        assert capacity.routing_tps == pytest.approx(capacity.tokens_per_s)
        assert capacity.run_id == run.pk
    # Slow traffic right after the episode closed opens nothing yet: the next one is judged on
    # traffic wholly after it.
    assert episode(node, share=0.3) is None
    assert episode(node, share=0.3, now=timezone.now() + services.DRIFT_QUIET) is not None


def test_fast_whenever_verified_and_slow_otherwise_is_confirmed_on_the_third_episode(
        bob, gpu_specs):
    node = judged_node(bob, PROFILE)
    now = timezone.now()
    for i in range(services.CLEARED_TO_CONFIRM):
        drift = episode(node, share=0.35, now=now + i * 2 * services.DRIFT_QUIET)
        measure(drift.run, PROFILE)
        assert served_finding(drift.run).severity == "warning"
    drift = episode(node, share=0.35,
                    now=now + services.CLEARED_TO_CONFIRM * 2 * services.DRIFT_QUIET)
    measure(drift.run, PROFILE)
    found = served_finding(drift.run)
    assert found.severity == "mismatch", found.message
    assert "whenever it is not being verified" in found.message
    assert statuses(node) == {"flagged"}
    # A day later, earlier cleared episodes no longer count.
    assert services.INTERMITTENT_WINDOW == timedelta(days=1)


def test_an_episode_whose_run_never_finished_is_closed(bob, gpu_specs):
    node = judged_node(bob, PROFILE)
    drift = episode(node, share=0.3)
    VerificationRun.objects.filter(pk=drift.run_id).update(status="timed_out")
    assert services.served_drifts_close_orphaned() == 1
    drift.refresh_from_db()
    assert drift.outcome == "cleared" and "ended before" in drift.note
