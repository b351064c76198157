from django.urls import path

from marketplace import views

app_name = "marketplace"
urlpatterns = [
    path("", views.catalog, name="catalog"),
    path("cards/<int:card_id>/", views.card_detail, name="card_detail"),
    path("tools/vram", views.vram_tool, name="vram_tool"),
    path("tools/break-even", views.break_even_tool, name="break_even_tool"),
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
    path("provider/machines/<int:node_id>/engine/", views.engine_override_set,
         name="engine_override_set"),
    path("provider/machines/<int:node_id>/engine/clear/", views.engine_override_clear,
         name="engine_override_clear"),
    path("provider/machines/<int:node_id>/engine/restart/", views.engine_restart,
         name="engine_restart"),
    path("provider/machines/<int:node_id>/engine/key/rotate/", views.engine_key_rotate,
         name="engine_key_rotate"),
    path("provider/enrolments/<int:token_id>/revoke/", views.enrolment_revoke,
         name="enrolment_revoke"),
    path("provider/cards/<int:card_id>/listing/", views.listing_update, name="listing_update"),
    path("provider/cards/<int:card_id>/break-even", views.card_break_even,
         name="card_break_even"),
]
