import pytest
from django.core.management import call_command

from billing.models import ModelPrice
from routing.models import Deployment, EngineModel, Model
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db


def test_demo_names_maps_and_prices_what_the_fleet_reports(bob, capsys):
    for context in (65_536, 262_144):
        Deployment.objects.create(node=NodeFactory(owner=bob), engine_model_id="Qwen/Qwen3-27B",
                                  engine="vllm", max_context=context)
    Deployment.objects.create(node=NodeFactory(owner=bob), engine_model_id="smollm2",
                              engine="llama.cpp", max_context=None)
    Deployment.objects.create(node=NodeFactory(owner=bob), engine_model_id="gone/Model",
                              reported=False)
    call_command("demo_models")
    call_command("demo_models")  # a restarted demo adds nothing
    assert dict(Model.objects.values_list("name", "context_length")) == {
        "qwen3-27b": 262_144, "smollm2": 32_768}
    assert list(EngineModel.objects.values_list("engine_model_id", "model__name")) == [
        ("Qwen/Qwen3-27B", "qwen3-27b")]
    assert sorted(ModelPrice.objects.values_list("model", flat=True)) == ["qwen3-27b",
                                                                          "smollm2"]
    assert "DEMO_MODEL=qwen3-27b" in capsys.readouterr().out
