"""Prepare and finish the demo: users, enrolment tokens for the simulated fleet, listings.

`make demo` runs it twice: `--tokens-file` before the fleet starts (users, one token per
machine that has no credential yet), `--list` once the machines have reported their cards.
"""

import json
import time
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.utils import timezone

from accounts.models import User
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

    def handle(self, *args, machines, state_dir, tokens_file, list_cards, timeout, **options):
        profiles = [m.strip() for m in machines.split(",") if m.strip()]
        if tokens_file:
            self._prepare(profiles, state_dir, tokens_file)
        if list_cards:
            self._list(profiles, state_dir, timeout)

    def _prepare(self, profiles, state_dir, tokens_file):
        with transaction.atomic():
            for email, (password, _) in DEMO_USERS.items():
                if not User.objects.filter(email=email).exists():
                    staff = email.startswith("admin@")
                    User.objects.create_user(email, password, is_staff=staff,
                                             is_superuser=staff)
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

    def _list(self, profiles, state_dir, timeout):
        bob = User.objects.get(email=PROVIDER)
        deadline = time.monotonic() + timeout
        for profile, machine_id in zip(profiles, machine_ids(profiles), strict=True):
            credential = state_dir / f"{machine_id}.json"
            while True:
                node_id = (json.loads(credential.read_text()).get("node_id")
                           if credential.exists() else None)
                cards = list(Card.objects.filter(node_id=node_id, present=True))
                if cards:
                    break
                if time.monotonic() > deadline:
                    raise CommandError(f"Machine {machine_id} did not report within "
                                       f"{timeout:.0f} s.")
                time.sleep(0.5)
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
        self.stdout.write(f"{len(profiles)} simulated machines online and listed.")
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
        _, token = api_key_create(user=carol, name=f"demo {timezone.now():%Y-%m-%d %H:%M}")
        self.stdout.write(f"DEMO_API_KEY={token}")

