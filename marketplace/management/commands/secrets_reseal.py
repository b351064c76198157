"""`manage.py secrets_reseal`: after SECRET_KEY rotated (the old one in SECRET_KEY_FALLBACKS),
seal every stored engine key again under the new SECRET_KEY. Credentials (node credentials,
API keys, REST tokens) re-hash on their next use. docs/operations.md, "Rotating SECRET_KEY"."""

from django.core.management.base import BaseCommand

from marketplace.services import engine_keys_reseal


class Command(BaseCommand):
    help = __doc__.split("\n\n")[0]

    def handle(self, *args, **options):
        resealed = engine_keys_reseal()
        self.stdout.write(f"{resealed} engine key{'s' if resealed != 1 else ''} sealed again "
                          "under SECRET_KEY.")
