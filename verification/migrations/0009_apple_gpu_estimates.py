from django.db import migrations


def forwards(apps, schema_editor):
    from verification.spec_data import SPECS

    GpuSpec = apps.get_model("verification", "GpuSpec")
    for row in SPECS:
        if row["name"].startswith("Apple "):
            GpuSpec.objects.filter(name=row["name"], bf16_tflops__isnull=True).update(
                bf16_tflops=row["bf16_tflops"], sources=row["sources"])


class Migration(migrations.Migration):
    dependencies = [("verification", "0008_run_yardstick")]
    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]
