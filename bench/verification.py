"""Verification benchmark: the planted-fault fleet, verified end to end, scored.

Starts the platform (uvicorn, in this process, on a throwaway PostgreSQL database), the planted
fleet (`python -m fleetsim up --planted`: honest machines and liars, each the real node agent
running its simulated engine as its child), lets the agents enrol, heartbeat and answer their
probe jobs, runs the platform-side load test (the provider's engine, then the platform's
yardstick the agent switches to and back), evaluation and publication for every node, and
prints which machines were flagged and by which finding: recall on the liars (flagged on a
finding that should catch each, `CAUGHT_BY`), false flags on the honest ones, and whether the
machine whose GPU UUID a liar replays stays listed. Goal: every liar flagged on its finding, no
honest machine flagged, the incumbent listed.

Run by `make bench-verification` (PostgreSQL from DATABASE_URL). The engines run in real time
(time scale 1): the load test measures tokens/s, and a faster clock would inflate them.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
os.environ.setdefault("TEST_DATABASE_NAME", "bench_rigshare_verification")

import django  # noqa: E402

warnings.filterwarnings("ignore", "No directory at")
django.setup()

from django.db import connection  # noqa: E402
from django.test.utils import setup_databases, teardown_databases  # noqa: E402

from accounts.models import User  # noqa: E402
from fleetsim.profiles import (  # noqa: E402
    CAUGHT_BY,
    LIARS,
    PLANTED_FLEET,
    get_profile,
    machine_ids,
)
from fleetsim.server import ServerThread  # noqa: E402
from marketplace import selectors  # noqa: E402
from marketplace import services as marketplace  # noqa: E402
from marketplace.models import Card, Node  # noqa: E402
from verification import services  # noqa: E402
from verification.models import Finding, ProbeJob, VerificationRun  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(1)


def main() -> None:
    from config.asgi import application

    old = setup_databases(verbosity=0, interactive=False)
    fleet = None
    try:
        bob = User.objects.create_user("provider@bench.test", "x")
        tokens = [marketplace.enrolment_token_create(owner=bob)[1] for _ in PLANTED_FLEET]
        with ServerThread(application) as platform, tempfile.TemporaryDirectory() as state:
            fleet = subprocess.Popen(
                [sys.executable, "-m", "fleetsim", "up", "--platform", platform.url,
                 "--profiles", ",".join(PLANTED_FLEET), "--tokens", ",".join(tokens),
                 "--state-dir", state, "--base-port", "18100", "--agent-engines", "all"],
                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                start_new_session=True)
            started = time.monotonic()
            wait_for(lambda: Node.objects.filter(cards__isnull=False).distinct().count()
                     == len(PLANTED_FLEET), 120, "every machine's first heartbeat")
            # The provider's listing claims, as a provider would type them.
            for node in Node.objects.all():
                profile = get_profile(node.name.rsplit("-", 1)[0])
                for card in node.cards.all():
                    marketplace.listing_update(
                        owner=bob, card_id=card.pk, is_listed=True,
                        price_per_hour_micros=1_000_000,
                        claimed_gpu_model=getattr(profile, "claimed_gpu_model", "") or "",
                        claimed_vram_gb=getattr(profile, "claimed_vram_gb", None))
            wait_for(lambda: not ProbeJob.objects.filter(status="pending").exists()
                     and ProbeJob.objects.count() >= len(PLANTED_FLEET), 300,
                     "every machine's probes")
            probed = time.monotonic()
            # Liars first (the fleet lists them last): a liar judged before its honest peers are
            # verified must still be caught when they are (services.peers_rejudge).
            for run_id in reversed(services.runs_ready_for_load_test()):
                services.run_load_test(run_id=run_id)
                services.run_evaluate(run_id=run_id)
                services.run_publish(run_id=run_id)
            finished = time.monotonic()
        report(started, probed, finished)
    finally:
        if fleet is not None and fleet.poll() is None:
            os.killpg(fleet.pid, signal.SIGTERM)
            fleet.wait(30)
        # The platform's request threads kept connections open: end them, then drop.
        with connection.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND pid <> pg_backend_pid()")
        connection.close()
        teardown_databases(old, verbosity=0)


def report(started: float, probed: float, finished: float) -> None:
    ids = machine_ids(PLANTED_FLEET)
    listed = {card.node_id for card in selectors.cards_for_catalog({})}
    rows, caught, honest_flagged, unverified_honest = [], 0, 0, 0
    for machine, key in zip(ids, PLANTED_FLEET, strict=True):
        node = Node.objects.get(name=machine)
        cards = list(Card.objects.filter(node=node))
        statuses = {c.verification_status for c in cards}
        verdict = ("FLAGGED" if "flagged" in statuses else
                   "serving verified" if statuses == {"serving_verified"} else
                   "not judged" if statuses == {"not_judged"} else
                   "verified" if statuses == {"verified"} else ",".join(sorted(statuses)))
        run = VerificationRun.objects.filter(node=node, status="done").first()
        findings = list(Finding.objects.filter(run=run)) if run else []
        mismatches = sorted({f.metric for f in findings if f.severity == "mismatch"})
        warnings_ = sorted({f.metric for f in findings if f.severity == "warning"})
        serving = next((f for f in findings if f.metric == "serving"), None)
        yardstick = next((f for f in findings if f.metric == "yardstick"), None)
        basis = (f"{serving.basis if serving else '-'} / "
                 f"{yardstick.basis or yardstick.severity if yardstick else '-'}")
        liar = key in LIARS
        if liar:
            by = [metric for metric in CAUGHT_BY[key] if metric in mismatches]
            caught += bool(by)
            outcome = (f"caught by {','.join(by)}" if by else
                       f"MISSED (wanted {' or '.join(CAUGHT_BY[key])})")
        else:
            honest_flagged += "flagged" in statuses
            outcome = ("FALSE FLAG" if "flagged" in statuses else "ok" if statuses <= {
                "verified", "serving_verified"} else "NOT VERIFIED")
            unverified_honest += outcome == "NOT VERIFIED"
        tps = cards[0].verified_tokens_per_s if cards else None
        rows.append((machine, LIARS.get(key, "honest"), verdict, outcome,
                     ",".join(mismatches) or "-", ",".join(warnings_) or "-", basis,
                     "yes" if node.pk in listed else "no", f"{tps:,.0f}" if tps else "-"))
    widths = [max(len(str(r[i])) for r in rows + [HEADER]) for i in range(len(HEADER))]
    for row in [HEADER] + rows:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)))
    liars = sum(1 for k in PLANTED_FLEET if k in LIARS)
    honest = len(PLANTED_FLEET) - liars
    incumbent = get_profile("liar-duplicate-uuid").faults.uuid_of
    incumbent_node = Node.objects.get(name=incumbent)
    incumbent_listed = (incumbent_node.pk in listed and not incumbent_node.held_out
                        and set(incumbent_node.cards.values_list("verification_status",
                                                                 flat=True)) == {"verified"})
    print(f"\nrecall on liars (flagged on the right finding): {caught}/{liars}   "
          f"false flags on honest machines: {honest_flagged}/{honest}   "
          f"honest machines not verified: {unverified_honest}/{honest}   "
          f"incumbent {incumbent} listed and verified: {'yes' if incumbent_listed else 'NO'}")
    print(f"time: {probed - started:.0f} s to enrol and probe {len(PLANTED_FLEET)} machines, "
          f"{finished - probed:.0f} s of load tests, evaluation and publication")
    met = caught == liars and honest_flagged == 0 and unverified_honest == 0 and incumbent_listed
    print("goal: every liar flagged on its finding, every honest machine verified, the "
          "incumbent listed:", "MET" if met else "NOT MET")


HEADER = ("machine", "planted", "verdict", "outcome", "mismatches", "warnings",
          "basis: serving / yardstick", "listed", "tok/s@32 per card")

if __name__ == "__main__":
    main()
