"""`manage.py grant_credits EMAIL USD [--memo ...]`: an operator's top-up, through the ledger."""

import uuid
from decimal import Decimal, InvalidOperation

from django.core.management.base import BaseCommand, CommandError

from accounts.models import User
from billing import selectors, services
from billing.models import Account
from billing.pricing import format_usd_exact, usd_to_micros


def parse_usd(text: str, *, what: str) -> int:
    """Dollars as typed on a command line, in micros; a CommandError with a sentence if not."""
    try:
        usd = Decimal(text.strip().removeprefix("$").replace(",", ""))
    except InvalidOperation:
        raise CommandError(f"{what} must be an amount in dollars, like 25 or 12.50; "
                           f"got {text!r}.") from None
    if not usd.is_finite() or usd <= 0:
        raise CommandError(f"{what} must be more than $0; got {text!r}.")
    if usd.as_tuple().exponent < -6:
        raise CommandError(f"{what} has more than 6 decimal places: {text!r}.")
    return usd_to_micros(usd)


def user_by_email(email: str) -> User:
    user = User.objects.filter(email__iexact=email.strip()).first()
    if user is None:
        raise CommandError(f"No user has the email address {email!r}.")
    return user


class Command(BaseCommand):
    help = "Give a user credit (in USD), printed with their new balance."

    def add_arguments(self, parser):
        parser.add_argument("email")
        parser.add_argument("usd", help="amount in dollars, e.g. 25 or 12.50")
        parser.add_argument("--memo", default="", help="shown on the user's transactions")

    def handle(self, *args, email, usd, memo, **options):
        user = user_by_email(email)
        amount = parse_usd(usd, what="The amount")
        try:
            services.credits_grant(user=user, amount_micros=amount,
                                   idempotency_key=f"grant:cli:{uuid.uuid4()}",
                                   memo=memo or "granted by an operator")
        except services.BillingError as exc:
            raise CommandError(str(exc)) from None
        balance = selectors.user_balances(user.pk)[Account.Kind.WALLET]
        self.stdout.write(f"Granted {format_usd_exact(amount)} to {user.email}; "
                          f"balance now {format_usd_exact(balance)}.")
