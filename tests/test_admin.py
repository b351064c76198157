import pytest
from django.contrib import admin

from tests.factories import RentalFactory, UserFactory, listed_card

pytestmark = pytest.mark.django_db


def test_every_model_has_an_admin_whose_pages_load(client):
    operator = UserFactory(is_staff=True, is_superuser=True, two_factor=True)
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


def test_what_heartbeats_and_runs_write_cannot_be_hand_added_or_edited(client):
    """Nodes, cards, findings, measurements and verified capacity come from agents and
    verification runs; the admin shows them and lets no one add or edit them by hand."""
    from django.apps import apps

    operator = UserFactory(is_staff=True, is_superuser=True, two_factor=True)
    card = listed_card()
    client.force_login(operator)
    for label in ("marketplace.Card", "marketplace.Node", "marketplace.NodeStatusChange",
                  "marketplace.NodeUptimeHour", "verification.Finding",
                  "verification.Measurement", "verification.VerifiedCapacity",
                  "verification.ServedDrift", "routing.TrafficBucket"):
        meta = apps.get_model(label)._meta
        url = f"/admin/{meta.app_label}/{meta.model_name}/"
        assert client.get(url + "add/").status_code == 403, label
        assert f'href="{url}add/"' not in client.get(url).content.decode(), label
    # A node can still be held for review; its cards' facts and verdicts cannot be typed in.
    page = client.get(f"/admin/marketplace/card/{card.pk}/change/").content.decode()
    assert 'name="verification_status"' not in page and 'name="uuid"' not in page
    assert client.post(f"/admin/marketplace/card/{card.pk}/change/",
                       {"verification_status": "verified"}).status_code == 403
    node_page = client.get(f"/admin/marketplace/node/{card.node_id}/change/").content.decode()
    assert 'name="needs_review"' in node_page
    assert 'name="cards-0-verification_status"' not in node_page


def test_plural_names_read_as_english():
    from django.apps import apps

    for model in apps.get_models():
        plural = str(model._meta.verbose_name_plural)
        assert not plural.endswith(("ys", "ss")) or plural.endswith(("eys", "ays")), plural
