"""A charge names the machine that served it (`node:N`), which the provider's earnings count
by; charges written while it named the deployment (`deployment:N`) are renamed to its machine."""

from django.db import migrations


def forward(apps, schema_editor):
    Charge = apps.get_model("billing", "Charge")
    Deployment = apps.get_model("routing", "Deployment")
    for deployment_id, node_id in Deployment.objects.values_list("pk", "node_id"):
        Charge.objects.filter(worker=f"deployment:{deployment_id}").update(
            worker=f"node:{node_id}")


class Migration(migrations.Migration):
    dependencies = [
        ("routing", "0003_pool_changes"),
        ("billing", "0007_stripe_payments_reversals"),
    ]

    operations = [migrations.RunPython(forward, migrations.RunPython.noop)]
