"""`make demo`: what an operator does for the simulated fleet's models: a public name per engine
model id its agents report (e.g. Qwen/Qwen3-27B -> qwen3-27b), the id mapped to it, a price."""

from datetime import timedelta

from django.core.management.base import BaseCommand
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from billing.models import ModelPrice
from routing.models import Deployment, EngineModel, Model

DEFAULT_CONTEXT = 32_768
IN_PER_MTOK, OUT_PER_MTOK = 200_000, 800_000  # $0.20 / $0.80 per 1M tokens


def public_name(engine_model_id: str) -> str:
    return engine_model_id.rsplit("/", 1)[-1].lower()


class Command(BaseCommand):
    help = "Name, map and price every model the demo fleet's engines report."

    @transaction.atomic
    def handle(self, *args, **options):
        reported = (Deployment.objects.filter(reported=True).values("engine_model_id")
                    .annotate(context=Max("max_context")))
        for row in reported:
            name = public_name(row["engine_model_id"])
            model, _ = Model.objects.get_or_create(name=name, defaults={
                "context_length": row["context"] or DEFAULT_CONTEXT})
            if row["engine_model_id"] != name:
                EngineModel.objects.get_or_create(engine_model_id=row["engine_model_id"],
                                                  defaults={"model": model})
            if not ModelPrice.objects.filter(model=name).exists():
                ModelPrice.objects.create(model=name, input_micros_per_mtok=IN_PER_MTOK,
                                          output_micros_per_mtok=OUT_PER_MTOK,
                                          effective_at=timezone.now() - timedelta(days=1))
            self.stdout.write(f"DEMO_MODEL={name}")
