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

Then, on the same fleet: a bait-and-switch machine (an honest 2x RTX 5090, verified) swaps in an
engine at 30% of its speed while traffic flows through /v1; the minute's refresh of the live
figures must open a drift episode on it and on no honest machine, and the run it starts must
flag it (routing/drift.py). Goal: caught, no false episode.

Last, an onboarding burst (`--burst N`, 100 by default; 0 skips it): N machines join within a
minute, each the real agent running its engine, verified by a real Celery worker and beat
(load tests on a threads pool). Goal: every run done, none failed or taken up again; the time
to verify them all is recorded.

Run by `make bench-verification` (PostgreSQL from DATABASE_URL). The engines run in real time
(time scale 1): the load test measures tokens/s, and a faster clock would inflate them.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
os.environ.setdefault("TEST_DATABASE_NAME", "bench_rigshare_verification")

import django  # noqa: E402

warnings.filterwarnings("ignore", "No directory at")
django.setup()

import httpx  # noqa: E402
from django.conf import settings  # noqa: E402
from django.db import connection  # noqa: E402
from django.db.models import Count  # noqa: E402
from django.test.utils import setup_databases, teardown_databases  # noqa: E402
from django.utils import timezone  # noqa: E402

from accounts.models import User  # noqa: E402
from billing.keys import api_key_create  # noqa: E402
from billing.models import ModelPrice  # noqa: E402
from billing.services import credits_grant  # noqa: E402
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
from routing import served  # noqa: E402
from routing.models import EngineModel, Model  # noqa: E402
from routing.pool import POOL  # noqa: E402
from verification import services  # noqa: E402
from verification.models import Finding, ProbeJob, ServedDrift, VerificationRun  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(1)


BAIT = "2x-rtx-5090"  # honest when it joins; slows to BAIT_SPEED once verified
BAIT_SPEED = 0.3
BAIT_NEIGHBOURS = ("h200", "rtx-pro-6000", "2x-rtx-4090")  # honest, serving the same model
FLEET = [*PLANTED_FLEET, BAIT]
BASE_PORT = 18100
BURST_PROFILES = ("rtx-4090", "2x-rtx-4090", "2x-rtx-4090-mistral24b", "rtx-pro-6000-llama8b")
BURST_PORT = 19000


def main() -> None:
    from config.asgi import application

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burst", type=int, default=100, metavar="N",
                        help="machines in the onboarding burst (0: none)")
    parser.add_argument("--sections", default="planted,bait,burst",
                        help="which of planted, bait, burst to run (bait alone: with three "
                             "honest machines beside it)")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    old = setup_databases(verbosity=0, interactive=False)
    fleet = None
    try:
        bob = User.objects.create_user("provider@bench.test", "x")
        if sections & {"planted", "bait"}:
            profiles = FLEET if "planted" in sections else [*BAIT_NEIGHBOURS, BAIT]
            with ServerThread(application) as platform, \
                    tempfile.TemporaryDirectory() as state:
                fleet = start_fleet(platform.url, bob, profiles, state, BASE_PORT)
                started = time.monotonic()
                wait_for(lambda: Node.objects.filter(cards__isnull=False).distinct().count()
                         == len(profiles), 120, "every machine's first heartbeat")
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
                         and ProbeJob.objects.count() >= len(profiles), 300,
                         "every machine's probes")
                probed = time.monotonic()
                # Liars first (the fleet lists them last): a liar judged before its honest
                # peers are verified must still be caught when they are
                # (services.peers_rejudge).
                for run_id in reversed(services.runs_ready_for_load_test()):
                    run_steps(run_id)
                # Runs measured again later (a starved reading, serving read short, peers'
                # figures moved: services._measure_later), each once its time has come.
                active = VerificationRun.objects.filter(status__in=VerificationRun.ACTIVE)
                deadline = time.monotonic() + 3600
                while active.exists() and time.monotonic() < deadline:
                    for run_id in services.runs_ready_for_load_test():
                        run_steps(run_id)
                    time.sleep(1)
                finished = time.monotonic()
                if "planted" in sections:
                    report(started, probed, finished)
                if "bait" in sections:
                    bait(platform.url, machine_ids(profiles)[-1],
                         BASE_PORT + len(profiles) - 1)
                stop(fleet)
        if "burst" in sections and args.burst:
            burst(args.burst, bob)
    finally:
        stop(fleet)
        # The platform's request threads kept connections open: end them, then drop.
        with connection.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND pid <> pg_backend_pid()")
        connection.close()
        teardown_databases(old, verbosity=0)


def start_fleet(platform_url: str, owner, profiles: list[str], state: str,
                base_port: int) -> subprocess.Popen:
    tokens = [marketplace.enrolment_token_create(owner=owner)[1] for _ in profiles]
    return subprocess.Popen(
        [sys.executable, "-m", "fleetsim", "up", "--platform", platform_url,
         "--profiles", ",".join(profiles), "--tokens", ",".join(tokens),
         "--state-dir", state, "--base-port", str(base_port), "--agent-engines", "all"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        start_new_session=True)


def stop(process: subprocess.Popen | None) -> None:
    if process is not None and process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def run_steps(run_id: int) -> None:
    services.run_load_test(run_id=run_id)
    services.run_evaluate(run_id=run_id)
    services.run_publish(run_id=run_id)


# --- the bait-and-switch machine ----------------------------------------------------------------

def bait(platform_url: str, machine: str, port: int) -> None:
    """The fleet's Qwen3-27B sold through /v1; traffic before and after the bait machine slows,
    the minute's refresh after each round, the run an episode starts put through its steps."""
    model = Model.objects.create(name="qwen3-27b", context_length=32_768)
    EngineModel.objects.create(engine_model_id="Qwen/Qwen3-27B", model=model)
    ModelPrice.objects.create(model="qwen3-27b", input_micros_per_mtok=200_000,
                              output_micros_per_mtok=800_000,
                              effective_at=timezone.now() - timedelta(days=1))
    carol = User.objects.create_user("consumer@bench.test", "x")
    credits_grant(user=carol, amount_micros=1_000_000_000, idempotency_key="bench:bait")
    _, key = api_key_create(user=carol, name="bench", by_operator=True)
    POOL.invalidate()
    node = Node.objects.get(name=machine)
    time.sleep(3)  # the routers' pool reads the model and its workers

    def traffic(streams: int) -> int:
        def one(_):
            with httpx.stream("POST", f"{platform_url}/v1/chat/completions", timeout=120,
                              headers={"Authorization": f"Bearer {key}"},
                              json={"model": "qwen3-27b", "max_tokens": 64, "stream": True,
                                    "messages": [{"role": "user",
                                                  "content": "Tell me about GPUs."}]}) as r:
                for _ in r.iter_bytes():
                    pass
                return r.status_code
        with ThreadPoolExecutor(8) as pool:
            return sum(code == 200 for code in pool.map(one, range(streams)))

    served_ok = traffic(96)
    time.sleep(2)  # the log writer's last batch
    before = served.served_figures_refresh()["drifts"]
    httpx.post(f"http://127.0.0.1:{port}/fleetsim/speed", json={"factor": BAIT_SPEED})
    switched = time.monotonic()
    opened = None
    while time.monotonic() - switched < 600 and opened is None:
        served_ok += traffic(64)
        time.sleep(2)
        served.served_figures_refresh()
        opened = ServedDrift.objects.filter(node=node).first()
    false_episodes = ServedDrift.objects.exclude(node=node).count() + before
    detected = time.monotonic() - switched
    flagged = False
    if opened is not None and opened.run_id:
        wait_for(lambda: not ProbeJob.objects.filter(run_id=opened.run_id,
                                                     status="pending").exists(), 120,
                 "the bait machine's probes")
        run_steps(opened.run_id)
        flagged = set(node.cards.values_list("verification_status", flat=True)) == {"flagged"}
        opened.refresh_from_db()
    total = time.monotonic() - switched
    print(f"\nbait-and-switch ({machine}, verified, then {BAIT_SPEED:.0%} of its speed): "
          f"{served_ok} streams served through /v1; "
          + (f"drift opened {detected:.0f} s after the switch ({opened.band_label} concurrent, "
             f"{opened.served_tps:.1f} of {opened.verified_tps:.1f} tok/s per stream over "
             f"{opened.streams} streams), episode {opened.outcome}, card "
             f"{'FLAGGED' if flagged else 'not flagged'} {total:.0f} s after the switch"
             if opened else "NO drift opened")
          + f"; drift episodes on honest machines: {false_episodes}")
    print("goal: the bait machine flagged on its served traffic, no episode on an honest "
          "machine:", "MET" if flagged and not false_episodes else "NOT MET")


# --- the onboarding burst --------------------------------------------------------------------

def burst(n: int, owner) -> None:
    """n machines joining together, verified by a real worker and beat (load tests on a threads
    pool) against the platform under uvicorn in this process."""
    from config.asgi import application

    profiles = [BURST_PROFILES[i % len(BURST_PROFILES)] for i in range(n)]
    db = settings.DATABASES["default"]
    env = dict(os.environ, DATABASE_URL=f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/"
                                        f"{db['NAME']}")
    with ServerThread(application) as platform, tempfile.TemporaryDirectory() as state:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "config", "worker", "-B", "-s",
             f"{state}/beat-schedule", "--pool", "threads", "--concurrency", "16",
             "--without-gossip", "--without-mingle", "--loglevel=WARNING"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True)
        known = set(Node.objects.values_list("pk", flat=True))
        fleet = start_fleet(platform.url, owner, profiles, state, BURST_PORT)
        started = time.monotonic()
        try:
            nodes = Node.objects.exclude(pk__in=known)
            wait_for(lambda: nodes.filter(cards__isnull=False).distinct().count() == n, 300,
                     "every burst machine's first heartbeat")
            joined = time.monotonic() - started
            ids = list(nodes.values_list("pk", flat=True))
            runs = VerificationRun.objects.filter(node_id__in=ids)
            wait_for(lambda: runs.filter(status__in=VerificationRun.ACTIVE).count() == 0
                     and runs.values("node_id").distinct().count() == n, 3600,
                     "every burst machine's run")
            took = time.monotonic() - started
        finally:
            stop(fleet)
            stop(worker)
    statuses = dict(runs.values_list("status").annotate(n=Count("pk")))
    resumed = runs.filter(resumed__gt=0).count()
    remeasured = runs.filter(remeasured__gt=0).count()
    unmeasured = runs.filter(error__contains="overloaded Rigshare worker").count()
    read_twice = runs.exclude(first_reading={}).count()
    cards = dict(Card.objects.filter(node_id__in=ids).values_list("verification_status")
                 .annotate(n=Count("pk")))
    failed = [f"{r.node.name}: {r.error}" for r in runs.exclude(status="done")
              .select_related("node")[:5]]
    print(f"\nonboarding burst: {n} machines ({', '.join(BURST_PROFILES)}) joined within "
          f"{joined:.0f} s; runs {statuses}; taken up again: {resumed}; cards {cards}; "
          f"all runs over {took:.0f} s after the first machine started; measured again "
          f"later: {remeasured} runs (serving read short: {read_twice}); not judged on serving "
          f"for a starved reader: {unmeasured}")
    for line in failed:
        print(f"  not done: {line}")
    for run in runs.filter(node__cards__verification_status__in=["flagged", "not_judged",
                                                                  "unverified"]).distinct()[:8]:
        serving = Finding.objects.filter(run=run, metric="serving").first()
        print(f"  {run.node.name}: serving {serving.severity if serving else '-'}: "
              f"{serving.message[:300] if serving else run.error[:160]}; yardstick "
              f"{run.yardstick_state}: {run.yardstick_note[:120]}; tries {run.remeasured + 1}, "
              f"error {run.error[:160]!r}")
    print("goal: every run done, none failed or taken up again, every card verified:",
          "MET" if statuses == {"done": n} and not resumed and set(cards) == {"verified"}
          else "NOT MET")


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
