"""Accounts made before email verification existed get their address as a primary, unverified
EmailAddress: they log in as before and verify it from Account settings."""

from django.db import migrations


def forwards(apps, schema_editor):
    User = apps.get_model("accounts", "User")
    EmailAddress = apps.get_model("account", "EmailAddress")
    known = set(EmailAddress.objects.values_list("user_id", flat=True))
    EmailAddress.objects.bulk_create(
        [EmailAddress(user_id=pk, email=email, primary=True, verified=False)
         for pk, email in User.objects.values_list("pk", "email") if pk not in known],
        batch_size=1000)


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0002_security"),
        ("account", "0009_emailaddress_unique_primary_email"),
    ]
    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]
