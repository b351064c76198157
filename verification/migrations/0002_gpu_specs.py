"""Seed the reference spec table from verification/spec_data.py (then edited in admin)."""

from django.db import migrations


def seed(apps, schema_editor):
    from verification.spec_data import seed_specs

    seed_specs(apps.get_model("verification", "GpuSpec"))


def unseed(apps, schema_editor):
    from verification.spec_data import SPECS

    apps.get_model("verification", "GpuSpec").objects.filter(
        name__in=[row["name"] for row in SPECS]).delete()


class Migration(migrations.Migration):
    dependencies = [("verification", "0001_initial")]
    operations = [migrations.RunPython(seed, unseed)]
