from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("verification", "0005_capacity_routed_since"),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name="measurement",
            name="measurement_once",
        ),
        migrations.AddConstraint(
            model_name="measurement",
            constraint=models.UniqueConstraint(
                condition=models.Q(("card__isnull", False)),
                fields=("run", "card", "metric"),
                name="measurement_once_per_card",
            ),
        ),
        migrations.AddConstraint(
            model_name="measurement",
            constraint=models.UniqueConstraint(
                condition=models.Q(("card__isnull", True)),
                fields=("run", "metric"),
                name="measurement_once_per_engine",
            ),
        ),
    ]
