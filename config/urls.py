from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from accounts import urls as accounts_urls
from config.views import healthz

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("admin/", admin.site.urls),
    path("accounts/", include("accounts.urls")),
    path("accounts/", include("lifecycle.urls")),
    path("accounts/", include(accounts_urls.allauth_urlpatterns)),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("billing/", include("billing.urls")),
    path("api/", include("billing.api_urls")),
    path("api/agent/", include("agentapi.urls")),
    path("api/", include("marketplace.api_urls")),
    path("verification/", include("verification.urls")),
    path("", include("routing.urls")),
    path("", include("marketplace.urls")),
]

handler400 = "config.views.bad_request"
handler404 = "config.views.not_found"
handler500 = "config.views.server_error"
