"""REST API for billing: a user's own API keys (list, create: the secret once, update limits,
revoke). Nobody sees or touches another user's keys: they answer 404."""

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.response import Response

from accounts import security
from billing import keys
from billing.models import ApiKey
from billing.serializers import ApiKeySerializer


class ApiKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.UpdateModelMixin,
                    viewsets.GenericViewSet):
    serializer_class = ApiKeySerializer
    http_method_names = ["get", "post", "patch", "head", "options"]

    def get_permissions(self):
        # Making a key or raising its limits needs a recent proof when the session asks;
        # revoking one never does.
        extra = [security.RecentProof()] if self.action in ("create", "partial_update",
                                                            "update") else []
        return super().get_permissions() + extra

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # the schema generator has no user
            return ApiKey.objects.none()
        return ApiKey.objects.filter(user=self.request.user).order_by("-created_at", "-id")

    @extend_schema(responses={201: OpenApiResponse(
        ApiKeySerializer, description="The key's fields plus `key`: the secret, shown this once.")})
    def create(self, request):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            row, token = keys.api_key_create(user=request.user, **serializer.validated_data)
        except security.NeedsStrongerAccount as exc:
            raise PermissionDenied(str(exc)) from None
        return Response(dict(self.get_serializer(row).data, key=token),
                        status=status.HTTP_201_CREATED)

    def perform_update(self, serializer):
        if serializer.instance.revoked_at is not None:
            raise ValidationError({"detail": "A revoked key cannot change."})
        try:
            serializer.instance = keys.api_key_update(user=self.request.user,
                                                      key_id=serializer.instance.pk,
                                                      **serializer.validated_data)
        except security.NeedsStrongerAccount as exc:
            raise PermissionDenied(str(exc)) from None

    @extend_schema(request=None, responses=ApiKeySerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        row = self.get_object()
        keys.api_key_revoke(user=request.user, key_id=row.pk)
        row.refresh_from_db()
        return Response(self.get_serializer(row).data)
