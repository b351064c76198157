from django.urls import include, path
from rest_framework.routers import DefaultRouter

from marketplace import api

router = DefaultRouter()
router.register("rentals", api.RentalViewSet, basename="rental")
router.register("nodes", api.NodeViewSet, basename="node")
router.register("enrolment-tokens", api.EnrolmentTokenViewSet, basename="enrolment-token")

urlpatterns = [
    path("cards/", api.CatalogCardList.as_view(), name="api-cards"),
    path("cards/<int:pk>/", api.CatalogCardDetail.as_view(), name="api-card"),
    path("listings/<int:card_id>/", api.ListingDetail.as_view(), name="api-listing"),
    path("", include(router.urls)),
]
