"""Factories for tests. Hardware facts are set directly here only because a factory stands in
for a heartbeat; production code sets them through marketplace.services alone."""

import itertools
import uuid
from datetime import timedelta

import factory
from allauth.account.models import EmailAddress
from django.utils import timezone

from accounts.models import User
from accounts.secrets import secret_issue
from billing.metering import Price
from billing.models import ModelPrice
from marketplace.models import Card, Listing, Node, Rental

_seq = itertools.count(1)


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = User
        skip_postgeneration_save = True

    email = factory.Sequence(lambda n: f"user{n}@example.com")
    password = factory.PostGenerationMethodCall("set_password", "correct horse battery")

    @factory.post_generation
    def _save(obj, create, extracted, **kwargs):
        if create:
            obj.save()

    @factory.post_generation
    def verified(obj, create, extracted, **kwargs):
        """The address is verified unless `verified=False`."""
        if create:
            EmailAddress.objects.create(user=obj, email=obj.email, primary=True,
                                        verified=extracted is not False)

    @factory.post_generation
    def two_factor(obj, create, extracted, **kwargs):
        """`two_factor=True`: a TOTP authenticator (its secret in `obj.totp_secret`) and
        recovery codes, as a user who turned two-factor on has."""
        if create and extracted:
            obj.totp_secret = enable_two_factor(obj)


def enable_two_factor(user) -> str:
    """Give `user` TOTP and recovery codes through allauth's own activation; the secret."""
    from allauth.mfa.recovery_codes.internal.auth import RecoveryCodes
    from allauth.mfa.totp.internal.auth import TOTP, generate_totp_secret

    secret = generate_totp_secret()
    TOTP.activate(user, secret)
    RecoveryCodes.activate(user)
    return secret


def totp_code(secret: str) -> str:
    import pyotp

    return pyotp.TOTP(secret).now()


class NodeFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Node

    owner = factory.SubFactory(UserFactory)
    name = factory.Sequence(lambda n: f"node-{n}")
    region = "eu-central"
    credential_prefix = factory.LazyFunction(lambda: secret_issue("rsn").prefix)
    credential_digest = "0" * 64
    status = Node.Status.ONLINE
    last_heartbeat_at = factory.LazyFunction(timezone.now)
    reliability_pct = 99
    created_at = factory.LazyFunction(lambda: timezone.now() - timedelta(days=3))
    engine_url = ""
    # As a heartbeat would have checked it (marketplace/engine_address.py).
    engine_connect_url = factory.LazyAttribute(lambda o: (o.engine_url or "").rstrip("/"))


class CardFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Card

    node = factory.SubFactory(NodeFactory)
    index = factory.LazyAttribute(lambda o: o.node.cards.count())
    uuid = factory.LazyFunction(lambda: f"GPU-{uuid.uuid4()}")
    name = "NVIDIA GeForce RTX 4090"
    memory_total_mib = 24564
    compute_capability = "8.9"
    pcie_gen_current = 4
    pcie_gen_max = 4
    pcie_width_current = 16
    pcie_width_max = 16
    power_limit_w = 450


class ListingFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Listing

    card = factory.SubFactory(CardFactory)
    is_listed = True
    price_per_hour_micros = 450_000


def listed_card(**kwargs) -> Card:
    """A card for rent: listing kwargs prefixed `listing__`, node kwargs `node__`."""
    listing_kwargs = {k.removeprefix("listing__"): v for k, v in kwargs.items()
                      if k.startswith("listing__")}
    card_kwargs = {k: v for k, v in kwargs.items() if not k.startswith("listing__")}
    card = CardFactory(**card_kwargs)
    ListingFactory(card=card, **listing_kwargs)
    return card


class RentalFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Rental

    card = factory.SubFactory(CardFactory)
    renter = factory.SubFactory(UserFactory)
    price_per_hour_micros = 450_000
    started_at = factory.LazyFunction(timezone.now)


def price_at(model: str, at=None) -> Price:
    """The model's price in force at `at` (now), as the proxy's pool snapshot hands it to
    metering."""
    row = (ModelPrice.objects.filter(model=model, effective_at__lte=at or timezone.now())
           .order_by("-effective_at").first())
    if row is None:
        raise ModelPrice.DoesNotExist(f"The model '{model}' has no price.")
    return Price(row.pk, row.input_micros_per_mtok, row.output_micros_per_mtok)
