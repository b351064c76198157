"""Double-entry ledger, credit purchases, API keys, metering, payouts.

Money is integer micro-dollars (`*_micros`). An Account's balance changes only through a
Transfer whose Entries sum to zero (PostgreSQL checks it at commit, see migration 0002), and
a debit that would take a non-negative account below zero is refused by a conditional UPDATE.
"""

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone


class Account(models.Model):
    class Kind(models.TextChoices):
        WALLET = "wallet", "wallet"  # a user's spendable credit
        HOLDS = "holds", "holds"  # a user's credit reserved for requests in flight
        EARNINGS = "earnings", "earnings"  # a provider's earnings, paid out on request
        PLATFORM_REVENUE = "platform_revenue", "platform revenue"
        PAYMENT_CLEARING = "payment_clearing", "payment clearing"  # money in from the processor
        GRANTS = "grants", "operator grants"  # credit given by operators
        PAYOUTS = "payouts", "payouts"  # money sent out to providers
        # Credit taken back by a refund or a dispute beyond what the payer's wallet still held:
        # what the platform lost (negative).
        CHARGEBACKS = "chargebacks", "chargebacks"

    USER_KINDS = (Kind.WALLET, Kind.HOLDS, Kind.EARNINGS)
    # Accounts debited on the request path keep a running balance, checked by the debit's
    # conditional UPDATE; the others' balance is the sum of their entries (billing/ledger.py).
    KEEPS_BALANCE = (Kind.WALLET, Kind.HOLDS)
    # Where money crosses the ledger's edge (in from a processor or an operator, back out by a
    # refund or a dispute): these may go negative.
    SOURCE_KINDS = (Kind.PAYMENT_CLEARING, Kind.GRANTS, Kind.CHARGEBACKS)

    kind = models.CharField(max_length=32, choices=Kind.choices)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                              on_delete=models.PROTECT, related_name="ledger_accounts")
    balance_micros = models.BigIntegerField(default=0)  # kept for KEEPS_BALANCE kinds only
    allow_negative = models.BooleanField(default=False)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["owner", "kind"], condition=Q(owner__isnull=False),
                                    name="account_one_per_owner_kind"),
            models.UniqueConstraint(fields=["kind"], condition=Q(owner__isnull=True),
                                    name="account_one_system_per_kind"),
            models.CheckConstraint(condition=Q(allow_negative=True) | Q(balance_micros__gte=0),
                                   name="account_no_overdraft"),
        ]

    def __str__(self):
        return f"{self.get_kind_display()} of {self.owner}" if self.owner_id else self.kind


class Transfer(models.Model):
    class Kind(models.TextChoices):
        PURCHASE = "purchase"
        GRANT = "grant"
        RESERVE = "reserve"
        SETTLE = "settle"
        RELEASE = "release"
        RENTAL = "rental"
        PAYOUT = "payout"
        REVERSAL = "reversal"  # a refund or a dispute takes a purchase back
        FORFEIT = "forfeit"  # credit left behind by a closed account

    kind = models.CharField(max_length=16, choices=Kind.choices)
    idempotency_key = models.CharField(max_length=200, unique=True)
    reference = models.CharField(max_length=100, blank=True, db_index=True)  # e.g. rental:42
    memo = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"{self.kind} {self.idempotency_key}"


class Entry(models.Model):
    """One leg of a transfer: positive credits the account, negative debits it."""

    # No database foreign keys on the rows every request writes (entries, holds, charges):
    # PostgreSQL checks each with a locking read of the parent at commit, and two parents,
    # the platform's revenue account and the model's price, are shared by every request.
    # Migration 0006 keeps the same guarantees without the locks: the transfer's commit-time
    # check also refuses entries of unknown accounts, the entry guard (0003) refuses unknown
    # transfers, and ledger rows (accounts, transfers, holds, prices, keys) cannot be deleted.
    # Django still applies PROTECT to ORM deletes.
    transfer = models.ForeignKey(Transfer, on_delete=models.PROTECT, related_name="entries",
                                 db_constraint=False)
    account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="entries",
                                db_constraint=False, db_index=False)  # (account, transfer) below
    amount_micros = models.BigIntegerField()

    class Meta:
        verbose_name_plural = "entries"
        indexes = [models.Index(fields=["account", "transfer"])]
        constraints = [models.CheckConstraint(condition=~Q(amount_micros=0),
                                              name="entry_not_zero")]

    def __str__(self):
        return f"{self.amount_micros:+d} to {self.account_id} in {self.transfer_id}"


class ModelPrice(models.Model):
    """What a model's tokens cost, from `effective_at` on. A request pays the price in force
    when it started; a new price is a new row, never an edit."""

    model = models.CharField(max_length=200, db_index=True)  # the public model name
    input_micros_per_mtok = models.BigIntegerField()
    output_micros_per_mtok = models.BigIntegerField()
    effective_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["model", "-effective_at"]
        constraints = [
            models.UniqueConstraint(fields=["model", "effective_at"], name="price_model_time"),
            models.CheckConstraint(condition=Q(input_micros_per_mtok__gte=0)
                                   & Q(output_micros_per_mtok__gte=0),
                                   name="price_not_negative"),
        ]

    def __str__(self):
        return f"{self.model} from {self.effective_at:%Y-%m-%d %H:%M}"


class ApiKey(models.Model):
    class Period(models.TextChoices):
        DAILY = "daily"
        WEEKLY = "weekly"
        MONTHLY = "monthly"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                             related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=32, unique=True)
    digest = models.CharField(max_length=64)
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    spend_limit_micros = models.BigIntegerField(null=True, blank=True)
    spend_period = models.CharField(max_length=16, choices=Period.choices, default=Period.MONTHLY)
    allowed_models = models.JSONField(default=list, blank=True)  # empty: every model
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [models.CheckConstraint(
            condition=Q(spend_limit_micros__isnull=True) | Q(spend_limit_micros__gte=0),
            name="apikey_limit_not_negative")]

    def __str__(self):
        return f"{self.name} (rs_{self.prefix}_…)"


class KeySpend(models.Model):
    """Reserved and spent money of a key in one limit period; debited by conditional UPDATE."""

    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="spends")
    period_start = models.DateTimeField()
    used_micros = models.BigIntegerField(default=0)  # held + settled in this period

    class Meta:
        constraints = [models.UniqueConstraint(fields=["api_key", "period_start"],
                                               name="keyspend_key_period")]

    def __str__(self):
        return f"key {self.api_key_id} from {self.period_start:%Y-%m-%d}: {self.used_micros} µ$"


class Hold(models.Model):
    """Credit reserved for one inference request: settled with its usage, or released."""

    class Status(models.TextChoices):
        PENDING = "pending"
        SETTLED = "settled"
        RELEASED = "released"
        EXPIRED = "expired"

    request_id = models.CharField(max_length=100, unique=True)
    # Foreign keys without database constraints or indexes: see Entry. The user is the owner
    # of the wallet the reserve debits (checked by that UPDATE), the key and price come from
    # the caller's own lookups, and neither can be deleted (migration 0006).
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT,
                             related_name="holds", db_constraint=False, db_index=False)
    api_key = models.ForeignKey(ApiKey, on_delete=models.PROTECT, related_name="holds",
                                db_constraint=False, db_index=False)
    model = models.CharField(max_length=200)
    amount_micros = models.BigIntegerField()
    price = models.ForeignKey(ModelPrice, on_delete=models.PROTECT, related_name="+",
                              db_constraint=False, db_index=False)
    spend_period_start = models.DateTimeField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()  # (status, expires_at) below serves the expiry sweep
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["status", "expires_at"])]
        constraints = [models.CheckConstraint(condition=Q(amount_micros__gt=0),
                                              name="hold_positive")]

    def __str__(self):
        return f"hold {self.request_id} ({self.status})"


class Charge(models.Model):
    """What one request cost, from the engine's usage (or from delivered tokens, estimated)."""

    # Foreign keys without database constraints (see Entry): hold, user and key are copied
    # from the locked hold row, the transfer is created in the same statement. user and
    # provider are served by the (user|provider, created_at) indexes below.
    request_id = models.CharField(max_length=100, unique=True)
    hold = models.OneToOneField(Hold, on_delete=models.PROTECT, related_name="charge",
                                db_constraint=False)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT,
                             related_name="charges", db_constraint=False, db_index=False)
    api_key = models.ForeignKey(ApiKey, on_delete=models.PROTECT, related_name="charges",
                                db_constraint=False)
    model = models.CharField(max_length=200)
    provider = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                 on_delete=models.PROTECT, related_name="served_charges",
                                 db_constraint=False, db_index=False)
    worker = models.CharField(max_length=100, blank=True)  # what served it, e.g. node:7
    prompt_tokens = models.PositiveIntegerField()
    completion_tokens = models.PositiveIntegerField()
    cost_micros = models.BigIntegerField()
    provider_micros = models.BigIntegerField()
    fee_micros = models.BigIntegerField()
    estimated = models.BooleanField(default=False)  # no usage from the engine: delivered tokens
    capped = models.BooleanField(default=False)  # usage cost more than the hold: billed the hold
    transfer = models.ForeignKey(Transfer, on_delete=models.PROTECT, related_name="+",
                                 db_constraint=False, db_index=False)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        indexes = [models.Index(fields=["user", "created_at"]),
                   models.Index(fields=["provider", "created_at"])]

    def __str__(self):
        return f"charge {self.request_id}: {self.cost_micros} µ$"


class Payment(models.Model):
    """A credit purchase through the payment gateway."""

    class Status(models.TextChoices):
        REQUIRES_CONFIRMATION = "requires_confirmation", "awaiting confirmation"
        SUCCEEDED = "succeeded"
        DECLINED = "declined"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT,
                             related_name="payments")
    amount_micros = models.BigIntegerField()
    status = models.CharField(max_length=32, choices=Status.choices)
    gateway = models.CharField(max_length=32)
    gateway_ref = models.CharField(max_length=100, unique=True)
    card_last4 = models.CharField(max_length=4, blank=True)
    decline_reason = models.CharField(max_length=200, blank=True)
    idempotency_key = models.CharField(max_length=100, unique=True)
    receipt_number = models.CharField(max_length=32, unique=True, null=True, blank=True)
    transfer = models.OneToOneField(Transfer, null=True, blank=True, on_delete=models.PROTECT,
                                    related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    succeeded_at = models.DateTimeField(null=True, blank=True)
    # The processor's own id of the money (Stripe's PaymentIntent), which refunds and disputes
    # name, and the page where the payer finishes paying (Stripe Checkout).
    processor_ref = models.CharField(max_length=100, blank=True, db_index=True)
    checkout_url = models.CharField(max_length=1000, blank=True)
    refunded_micros = models.BigIntegerField(default=0)  # refunded so far
    disputed_micros = models.BigIntegerField(default=0)  # taken back by open disputes

    class Meta:
        ordering = ["-created_at"]
        constraints = [models.CheckConstraint(condition=Q(amount_micros__gt=0),
                                              name="payment_positive")]

    def __str__(self):
        return f"payment {self.gateway_ref} ({self.status})"


class GatewayEvent(models.Model):
    """Every processor event handled, so that a replayed delivery is answered and ignored:
    the unique (gateway, event id) is the idempotency."""

    gateway = models.CharField(max_length=32)
    event_id = models.CharField(max_length=100)
    type = models.CharField(max_length=32)
    payment = models.ForeignKey(Payment, null=True, blank=True, on_delete=models.PROTECT,
                                related_name="events")
    received_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-received_at"]
        constraints = [models.UniqueConstraint(fields=["gateway", "event_id"],
                                               name="gateway_event_once")]

    def __str__(self):
        return f"{self.gateway} {self.event_id} ({self.type})"


class Payout(models.Model):
    class Status(models.TextChoices):
        REQUESTED = "requested"
        PAID = "paid"
        REJECTED = "rejected"

    provider = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT,
                                 related_name="payouts")
    amount_micros = models.BigIntegerField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.REQUESTED)
    requested_at = models.DateTimeField(default=timezone.now)
    decided_at = models.DateTimeField(null=True, blank=True)
    decided_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.PROTECT, related_name="+")
    transfer = models.OneToOneField(Transfer, null=True, blank=True, on_delete=models.PROTECT,
                                    related_name="+")
    # Where to send it, as it was when the payout was requested: a later change of the
    # destination does not redirect a payout already asked for.
    destination = models.CharField(max_length=300, blank=True)
    # Cooling-off (billing/payout_holds.py): not to be paid before this, and why.
    held_until = models.DateTimeField(null=True, blank=True)
    held_because = models.CharField(max_length=200, blank=True)

    class Meta:
        ordering = ["-requested_at"]
        constraints = [models.CheckConstraint(condition=Q(amount_micros__gt=0),
                                              name="payout_positive")]

    def __str__(self):
        return f"payout #{self.pk} ({self.status})"


class PayoutDestination(models.Model):
    """Where a provider's payouts go. One per provider; a payout request copies it."""

    class Method(models.TextChoices):
        BANK = "bank", "bank transfer (IBAN)"
        PAYPAL = "paypal", "PayPal"

    provider = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                                    related_name="payout_destination")
    method = models.CharField(max_length=16, choices=Method.choices)
    holder_name = models.CharField(max_length=140)
    iban = models.CharField(max_length=34, blank=True)  # compact, checked (stdnum.iban)
    bic = models.CharField(max_length=11, blank=True)
    paypal_email = models.EmailField(blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=(Q(method="bank") & ~Q(iban="")) | (Q(method="paypal")
                                                             & ~Q(paypal_email="")),
                name="payout_destination_complete"),
        ]

    def __str__(self):
        return self.masked()

    def full(self) -> str:
        """What an operator pays to."""
        if self.method == self.Method.BANK:
            bic = f", BIC {self.bic}" if self.bic else ""
            return f"bank transfer to {self.holder_name}, IBAN {self.iban}{bic}"
        return f"PayPal to {self.holder_name}, {self.paypal_email}"

    def masked(self) -> str:
        """What the provider's pages show: enough to recognise it, not to copy it."""
        if self.method == self.Method.BANK:
            return f"bank transfer to {self.holder_name}, IBAN {self.iban[:4]} …{self.iban[-4:]}"
        name, _, domain = self.paypal_email.partition("@")
        return f"PayPal to {self.holder_name}, {name[:2]}…@{domain}"
