from django.urls import path

from marketplace import views

app_name = "marketplace"
urlpatterns = [
    path("", views.catalog, name="catalog"),
    path("cards/<int:card_id>/", views.card_detail, name="card_detail"),
    path("cards/<int:card_id>/rent/", views.card_rent, name="card_rent"),
    path("rentals/", views.rentals, name="rentals"),
    path("rentals/<int:rental_id>/", views.rental_detail, name="rental_detail"),
    path("provider/alerts/", views.provider_alerts, name="provider_alerts"),
    path("rentals/<int:rental_id>/stop/", views.rental_stop, name="rental_stop"),
    path("provider/", views.provider_dashboard, name="provider"),
    path("provider/earnings/", views.provider_earnings, name="provider_earnings"),
    path("provider/machines/add/", views.machine_add, name="machine_add"),
    path("downloads/agent/<str:filename>", views.agent_download, name="agent_download"),
    path("provider/machines/<int:node_id>/", views.node_edit, name="node_edit"),
    path("provider/machines/<int:node_id>/remove/", views.node_revoke, name="node_revoke"),
    path("provider/enrolments/<int:token_id>/revoke/", views.enrolment_revoke,
         name="enrolment_revoke"),
    path("provider/cards/<int:card_id>/listing/", views.listing_update, name="listing_update"),
]
