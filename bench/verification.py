"""Verification benchmark: the planted-fault fleet, verified end to end, scored.

Starts the platform (uvicorn, in this process, on a throwaway PostgreSQL database), the planted
fleet (`python -m fleetsim up --planted`: honest machines and liars, each an engine server and
the real node agent), lets the agents enrol, heartbeat and answer their probe jobs, runs the
platform-side load test, evaluation and publication for every node, and prints which machines
were flagged: recall on the liars and false flags on the honest ones. Goal: every liar flagged,
no honest card flagged.

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
from fleetsim.profiles import LIARS, PLANTED_FLEET, get_profile, machine_ids  # noqa: E402
from fleetsim.server import ServerThread  # noqa: E402
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
                 "--state-dir", state, "--base-port", "18100"],
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
            for run_id in services.runs_ready_for_load_test():
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
    rows, liars_flagged, honest_flagged = [], 0, 0
    for machine, key in zip(ids, PLANTED_FLEET, strict=True):
        node = Node.objects.get(name=machine)
        cards = list(Card.objects.filter(node=node))
        flagged = any(c.verification_status == "flagged" for c in cards)
        run = VerificationRun.objects.filter(node=node).first()
        mismatches = sorted({f.metric for f in Finding.objects.filter(
            run=run, severity="mismatch")}) if run else []
        warnings_ = sorted({f.metric for f in Finding.objects.filter(
            run=run, severity="warning")}) if run else []
        liar = key in LIARS
        liars_flagged += liar and flagged
        honest_flagged += (not liar) and flagged
        tps = cards[0].verified_tokens_per_s if cards else None
        rows.append((machine, LIARS.get(key, "honest"), "FLAGGED" if flagged else "verified",
                     ",".join(mismatches) or "-", ",".join(warnings_) or "-",
                     f"{tps:,.0f}" if tps else "-"))
    widths = [max(len(str(r[i])) for r in rows + [HEADER]) for i in range(len(HEADER))]
    for row in [HEADER] + rows:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)))
    liars = sum(1 for k in PLANTED_FLEET if k in LIARS)
    honest = len(PLANTED_FLEET) - liars
    print(f"\nrecall on liars: {liars_flagged}/{liars}   false flags on honest machines: "
          f"{honest_flagged}/{honest}")
    print(f"time: {probed - started:.0f} s to enrol and probe {len(PLANTED_FLEET)} machines, "
          f"{finished - probed:.0f} s of load tests, evaluation and publication")
    print("goal: every liar flagged, no honest machine flagged:",
          "MET" if liars_flagged == liars and honest_flagged == 0 else "NOT MET")


HEADER = ("machine", "planted", "verdict", "mismatches", "warnings", "tok/s@32 per card")

if __name__ == "__main__":
    main()
