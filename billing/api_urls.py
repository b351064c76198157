from rest_framework.routers import SimpleRouter

from billing import api

# SimpleRouter: no root view of its own, so /api/ stays marketplace's API root.
router = SimpleRouter()
router.register("keys", api.ApiKeyViewSet, basename="api-key")

urlpatterns = router.urls
