from django.urls import path

from billing import views

app_name = "billing"
urlpatterns = [
    path("", views.overview, name="overview"),
    path("test-gateway/<str:gateway_ref>/", views.test_gateway, name="test_gateway"),
    path("webhooks/payments/", views.payment_webhook, name="payment_webhook"),
    path("payments/<int:payment_id>/", views.receipt, name="receipt"),
    path("transactions/", views.transactions, name="transactions"),
    path("transactions.csv", views.transactions_csv, name="transactions_csv"),
    path("keys/", views.api_keys, name="api_keys"),
    path("keys/<int:key_id>/", views.api_key_edit, name="api_key_edit"),
    path("keys/<int:key_id>/revoke/", views.api_key_revoke, name="api_key_revoke"),
    path("usage/", views.usage, name="usage"),
    path("payouts/", views.payouts, name="payouts"),
    path("payouts/destination/", views.payout_destination, name="payout_destination"),
    path("statement.csv", views.statement_csv, name="statement_csv"),
]
