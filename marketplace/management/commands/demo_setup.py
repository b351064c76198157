"""Prepare and finish the demo: users, enrolment tokens for the simulated fleet, listings.

`make demo` runs it twice: `--tokens-file` before the fleet starts (users, one token per
machine that has no credential yet), `--list` while it starts: it waits until the machines
have reported since then and says how many did, or stops with one line when the fleet died.
"""

import json
import time
from datetime import UTC, datetime
from pathlib import Path

from allauth.account.models import EmailAddress
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.utils import timezone

from accounts.models import User
from agent.supervisor import process_alive
from billing.keys import api_key_create
from billing.services import credits_grant
from fleetsim.profiles import machine_ids
from marketplace import services
from marketplace.models import Card, Node, Rental

DEMO_USERS = {
    # email: (password, what they do)
    "alice@rigshare.test": ("demo-alice-2026", "renter"),
    "bob@rigshare.test": ("demo-bob-2026", "provider of the simulated fleet"),
    "carol@rigshare.test": ("demo-carol-2026", "API consumer"),
    "admin@rigshare.test": ("demo-admin-2026", "operator (Django admin)"),
}
PROVIDER = "bob@rigshare.test"
# Per profile: region and price per hour (micro-dollars), as a provider might set them.
OFFERS = {
    "h200": ("us-east", 3_200_000),
    "rtx-pro-6000": ("eu-central", 1_500_000),
    "2x-rtx-5090": ("eu-west", 900_000),
    "2x-rtx-4090": ("eu-central", 450_000),
    "2x-rtx-4090-wsl2": ("us-west", 400_000),
    "m4-max-llamacpp": ("eu-west", 600_000),
}


class Command(BaseCommand):
    help = "Create the demo users and fleet tokens, or list the fleet's cards once they report."

    def add_arguments(self, parser):
        parser.add_argument("--machines", required=True,
                            help="comma-separated fleetsim profile keys, one per machine")
        parser.add_argument("--state-dir", required=True, type=Path)
        parser.add_argument("--tokens-file", type=Path,
                            help="write one enrolment token per machine that needs one")
        parser.add_argument("--list", action="store_true", dest="list_cards",
                            help="wait for the machines and list their cards")
        parser.add_argument("--timeout", type=float, default=90)
        parser.add_argument("--since", type=float, metavar="EPOCH",
                            help="with --list: count only heartbeats from this time on (when "
                                 "the fleet was started), not those of an earlier run")
        parser.add_argument("--fleet-pid", type=int, metavar="PID",
                            help="with --list: stop waiting, with the reason, when it exits")
        parser.add_argument("--fleet-log", type=Path, metavar="PATH",
                            help="where the fleet's output goes, for its last error")

    def handle(self, *args, machines, state_dir, tokens_file, list_cards, timeout, since,
               fleet_pid, fleet_log, **options):
        profiles = [m.strip() for m in machines.split(",") if m.strip()]
        if tokens_file:
            self._prepare(profiles, state_dir, tokens_file)
        if list_cards:
            since_at = datetime.fromtimestamp(since, UTC) if since is not None else None
            self._list(profiles, state_dir, timeout, since_at, fleet_pid, fleet_log)

    def _prepare(self, profiles, state_dir, tokens_file):
        with transaction.atomic():
            for email, (password, _) in DEMO_USERS.items():
                if not User.objects.filter(email=email).exists():
                    staff = email.startswith("admin@")
                    user = User.objects.create_user(email, password, is_staff=staff,
                                                    is_superuser=staff)
                    # Demo addresses count as verified; the console prints every email.
                    EmailAddress.objects.create(user=user, email=email, primary=True,
                                                verified=True)
        bob = User.objects.get(email=PROVIDER)
        state_dir.mkdir(parents=True, exist_ok=True)
        tokens = []
        for machine_id in machine_ids(profiles):
            credential = state_dir / f"{machine_id}.json"
            if credential.exists():
                node_id = json.loads(credential.read_text()).get("node_id")
                if Node.objects.filter(pk=node_id, owner=bob).exists():
                    tokens.append("-")  # already enrolled: fleetsim reuses the credential
                    continue
                credential.unlink()  # left from an older database: enrol again
            _, token = services.enrolment_token_create(owner=bob)
            tokens.append(token)
        tokens_file.write_text(",".join(tokens))

    def _list(self, profiles, state_dir, timeout, since_at, fleet_pid, fleet_log):
        bob = User.objects.get(email=PROVIDER)
        ids = machine_ids(profiles)
        deadline = time.monotonic() + timeout
        where = f" (log: {fleet_log})" if fleet_log else ""
        while True:
            reported = _reported(bob, ids, state_dir, since_at)
            if len(reported) == len(ids):
                break
            if fleet_pid is not None and not process_alive(fleet_pid):
                raise CommandError(f"The simulated fleet stopped: {_last_error(fleet_log)}"
                                   f"{where}")
            if time.monotonic() > deadline:
                if not reported:
                    raise CommandError(f"No simulated machine reported within {timeout:.0f} s"
                                       f"{where}.")
                break
            time.sleep(0.5)
        for profile, machine_id in zip(profiles, ids, strict=True):
            cards = reported.get(machine_id)
            if not cards:
                continue
            region, price = OFFERS.get(profile, ("eu-central", 500_000))
            node = cards[0].node
            if not node.region:
                services.node_update(owner=bob, node_id=node.pk, name=machine_id,
                                     region=region)
            for card in cards:
                if not card.listing.price_per_hour_micros:
                    services.listing_update(owner=bob, card_id=card.pk, is_listed=True,
                                            price_per_hour_micros=price,
                                            claimed_gpu_model=card.name,
                                            claimed_vram_gb=round(
                                                (card.memory_total_mib or 0) / 1024) or None)
        missing = [machine_id for machine_id in ids if machine_id not in reported]
        self.stdout.write(
            f"{len(reported)} of {len(ids)} simulated machines online and listed"
            + (f"; not reported within {timeout:.0f} s: {', '.join(missing)}{where}."
               if missing else "."))
        self._money()

    def _money(self):
        """Credit for the renter and the consumer, a running rental (charged by the second from
        now on) and an API key for the consumer. (The models' names and prices: routing's
        demo_models.)"""
        alice = User.objects.get(email="alice@rigshare.test")
        carol = User.objects.get(email="carol@rigshare.test")
        # Idempotency keys make a restarted demo grant nothing twice.
        credits_grant(user=alice, amount_micros=50_000_000, idempotency_key="demo:alice",
                      memo="demo credit")
        credits_grant(user=carol, amount_micros=20_000_000, idempotency_key="demo:carol",
                      memo="demo credit")
        if not Rental.objects.filter(renter=alice, stopped_at__isnull=True).exists():
            card = Card.objects.filter(listing__is_listed=True, name__icontains="4090",
                                       node__status=Node.Status.ONLINE).order_by("pk").first()
            if card is not None:
                services.rental_start(renter=alice, card_id=card.pk)
        _, token = api_key_create(user=carol, name=f"demo {timezone.now():%Y-%m-%d %H:%M}",
                                  by_operator=True)
        self.stdout.write(f"DEMO_API_KEY={token}")


def _reported(owner, machine_ids_, state_dir: Path, since_at) -> dict:
    """{machine id: its present cards} for the machines whose node has reported (since
    `since_at`, when given)."""
    reported = {}
    for machine_id in machine_ids_:
        credential = state_dir / f"{machine_id}.json"
        try:
            node_id = json.loads(credential.read_text()).get("node_id")
        except (OSError, ValueError):
            continue
        nodes = Node.objects.filter(pk=node_id, owner=owner)
        if since_at is not None:
            nodes = nodes.filter(last_heartbeat_at__gte=since_at)
        cards = list(Card.objects.filter(node__in=nodes, present=True).select_related(
            "node", "listing"))
        if cards:
            reported[machine_id] = cards
    return reported


def _last_error(log: Path | None) -> str:
    """The fleet's own last word: its last error line, else its last line."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()
                 if line.strip()] if log else []
    except OSError:
        lines = []
    for line in reversed(lines):
        if line.startswith("fleetsim:") or "error" in line.lower():
            return line
    return lines[-1] if lines else "it printed nothing"
