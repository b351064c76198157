import pytest
from django.contrib import admin

from tests.factories import RentalFactory, UserFactory, listed_card

pytestmark = pytest.mark.django_db


def test_every_model_has_an_admin_whose_pages_load(client):
    operator = UserFactory(is_staff=True, is_superuser=True)
    card = listed_card()
    RentalFactory(card=card)
    client.force_login(operator)
    app_models = [m for m in admin.site._registry
                  if m._meta.app_label in ("accounts", "marketplace")]
    from django.apps import apps
    for model in list(apps.get_app_config("accounts").get_models()) + list(
            apps.get_app_config("marketplace").get_models()):
        assert model in app_models, f"{model.__name__} has no admin"
        meta = model._meta
        url = f"/admin/{meta.app_label}/{meta.model_name}/"
        assert client.get(url).status_code == 200, url
        first = model.objects.first()
        if first is not None:
            assert client.get(f"{url}{first.pk}/change/").status_code == 200, url


def test_admin_refuses_non_staff(client, mallory):
    client.force_login(mallory)
    assert client.get("/admin/marketplace/node/").status_code == 302


def test_healthz_answers_when_the_database_does(client):
    assert client.get("/healthz").json() == {"status": "ok"}
