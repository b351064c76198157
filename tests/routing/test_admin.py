import pytest
from django.apps import apps
from django.contrib import admin

from routing import requestlog
from routing.models import Deployment, EngineModel, Model, RequestLog, UnannouncedCheck
from tests.factories import NodeFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator(client):
    client.force_login(UserFactory(is_staff=True, is_superuser=True, two_factor=True))
    return client


def test_every_routing_model_has_an_admin_whose_pages_load(operator, bob):
    model = Model.objects.create(name="qwen3-27b", context_length=32_768)
    EngineModel.objects.create(engine_model_id="Qwen/Qwen3-27B", model=model)
    deployment = Deployment.objects.create(node=NodeFactory(owner=bob),
                                           engine_model_id="Qwen/Qwen3-27B")
    from django.utils import timezone

    # As the proxy's log writer writes it: the row, and its deployment's traffic buckets.
    requestlog.write([dict(request_id="req-1", created_at=timezone.now(), endpoint="chat",
                           model="qwen3-27b", deployment_id=deployment.pk, stream=True,
                           status=200, attempts=1, prompt_tokens=9, completion_tokens=40,
                           estimated=False, ttft_ms=90.0, latency_ms=900.0, concurrency=1)])
    assert RequestLog.objects.count() == 1
    UnannouncedCheck.objects.create(deployment_id=deployment.pk, node=deployment.node,
                                    model="Qwen/Qwen3-27B", requests=3, tokens_per_s=61.5,
                                    ttft_ms=180.0)
    for row in apps.get_app_config("routing").get_models():
        assert row in admin.site._registry, f"{row.__name__} has no admin"
        url = f"/admin/routing/{row._meta.model_name}/"
        assert operator.get(url).status_code == 200, url
        first = row.objects.first()
        assert operator.get(f"{url}{first.pk}/change/").status_code == 200, url


def test_an_operator_maps_an_engine_id_to_a_public_model(operator, bob):
    Deployment.objects.create(node=NodeFactory(owner=bob), engine_model_id="llama-3-8b.gguf")
    page = operator.get("/admin/routing/deployment/").content.decode()
    assert "not mapped" in page
    response = operator.post("/admin/routing/model/add/", {
        "name": "llama-3-8b", "context_length": 8192, "description": "", "is_active": "on",
        "created_at_0": "2026-11-30", "created_at_1": "00:00:00",
        "engine_models-TOTAL_FORMS": "1", "engine_models-INITIAL_FORMS": "0",
        "engine_models-0-engine_model_id": "llama-3-8b.gguf"})
    assert response.status_code == 302, response.content.decode()[:2000]
    assert EngineModel.objects.get().model.name == "llama-3-8b"
    page = operator.get("/admin/routing/deployment/").content.decode()
    assert "not mapped" not in page and "llama-3-8b" in page
    bad = operator.post("/admin/routing/model/add/", {
        "name": "bad name!", "context_length": 0,
        "engine_models-TOTAL_FORMS": "0", "engine_models-INITIAL_FORMS": "0"})
    assert bad.status_code == 200 and "errornote" in bad.content.decode()


def test_routing_admin_refuses_non_staff(client, mallory):
    client.force_login(mallory)
    assert client.get("/admin/routing/deployment/").status_code == 302
