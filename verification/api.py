"""The agent's answers to its jobs (docs/agent-protocol.md, section 3)."""

from drf_spectacular.utils import extend_schema
from rest_framework import permissions, serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from marketplace import services as marketplace
from verification import services


class JobResultSerializer(serializers.Serializer):
    status = serializers.ChoiceField(choices=["done", "failed"])
    result = serializers.DictField(required=False, allow_null=True, default=None)
    error = serializers.CharField(required=False, allow_null=True, allow_blank=True,
                                  max_length=2000, default="")


class AgentJobResult(APIView):
    authentication_classes: list = []
    permission_classes = [permissions.AllowAny]

    @extend_schema(request=JobResultSerializer, responses={200: None})
    def post(self, request, job_id: int):
        scheme, _, credential = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
        try:
            node = marketplace.node_authenticate(credential=credential.strip()
                                                 if scheme == "Bearer" else "")
        except marketplace.CredentialRefused as exc:
            return Response({"detail": str(exc)}, status=403 if exc.revoked else 401)
        if len(request.body) > 1_000_000:
            return Response({"body": ["The result is over 1 MB."]}, status=400)
        data = JobResultSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            services.job_result_record(node_id=node.pk, job_id=job_id, **data.validated_data)
        except services.JobNotFound:
            return Response({"detail": "No such job for this node."}, status=404)
        except services.JobAlreadyAnswered:
            return Response({"detail": "This job was answered already."}, status=409)
        return Response({"status": "stored"})
