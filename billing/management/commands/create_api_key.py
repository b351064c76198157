"""`manage.py create_api_key EMAIL --name N [--spend-limit USD --period P] [--models a,b]`."""

from django.core.management.base import BaseCommand, CommandError

from billing import keys
from billing.management.commands.grant_credits import parse_usd, user_by_email
from billing.models import ApiKey


class Command(BaseCommand):
    help = "Create an API key for a user and print it: this is the only time it is shown."

    def add_arguments(self, parser):
        parser.add_argument("email")
        parser.add_argument("--name", required=True)
        parser.add_argument("--spend-limit", help="USD per period; no limit if left out")
        parser.add_argument("--period", choices=ApiKey.Period.values,
                            default=ApiKey.Period.MONTHLY)
        parser.add_argument("--models", default="",
                            help="comma-separated model names the key may use (default: all)")

    def handle(self, *args, email, name, spend_limit, period, models, **options):
        user = user_by_email(email)
        if not name.strip() or len(name) > 100:
            raise CommandError("The --name must be 1 to 100 characters.")
        limit = None if spend_limit is None else parse_usd(spend_limit, what="The spend limit")
        allowed = list(dict.fromkeys(m.strip() for m in models.split(",") if m.strip()))
        row, token = keys.api_key_create(user=user, name=name.strip(), spend_limit_micros=limit,
                                         spend_period=period, allowed_models=allowed,
                                         by_operator=True)
        self.stderr.write(f"API key {row.name!r} for {user.email} (shown once; store it now):")
        self.stdout.write(token)
