"""Enrol, heartbeat and job results: thin views that call each app's services in turn."""

import json

from django.conf import settings
from django.db import transaction
from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from rest_framework import exceptions, permissions, serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.secrets import secret_prefix
from agentapi.authentication import IsNode, NodeCredentialAuthentication
from marketplace import heartbeat_fast
from marketplace import selectors as marketplace_selectors
from marketplace import services as marketplace
from marketplace.serializers import (
    MAX_HEARTBEAT_BYTES,
    EnrollResponseSerializer,
    EnrollSerializer,
    HeartbeatResponseSerializer,
    HeartbeatSerializer,
)
from routing import services as routing
from verification import services as verification
from verification.models import VerificationRun

MAX_RESULT_BYTES = 1_000_000


def _too_big(request, limit: int) -> Response | None:
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    if length > limit:
        return Response({"body": [f"The body is {length} bytes; the limit is {limit}."]},
                        status=400)
    return None


class AgentView(APIView):
    """A view only a node's agent may call, with its node credential."""

    authentication_classes = [NodeCredentialAuthentication]
    permission_classes = [IsNode]

    def permission_denied(self, request, message=None, code=None):
        if request.auth is None:
            raise exceptions.NotAuthenticated(IsNode.message)
        super().permission_denied(request, message, code)


class AgentEnroll(APIView):
    authentication_classes: list = []
    permission_classes = [permissions.AllowAny]

    @extend_schema(request=EnrollSerializer, responses={201: EnrollResponseSerializer, 401: (
        OpenApiResponse(description="The enrolment token is unknown, used, expired or revoked."))})
    def post(self, request):
        if (refusal := _too_big(request, MAX_HEARTBEAT_BYTES)) is not None:
            return refusal
        serializer = EnrollSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            enrolment = marketplace.node_enroll(**serializer.validated_data)
        except marketplace.EnrolmentRefused as exc:
            return Response({"detail": str(exc)}, status=401)
        return Response({"node_id": enrolment.node.pk, "credential": enrolment.credential,
                         "engine_key": enrolment.engine_key,
                         "heartbeat_interval_s": settings.RIGSHARE_HEARTBEAT_INTERVAL_S},
                        status=201)


class AgentHeartbeat(AgentView):
    def initial(self, request, *args, **kwargs):
        # Read before the credential is checked, and so before anything the answer depends on:
        # a forget that lands after this read voids the fast-path entry this request leaves.
        if request.method == "POST":
            self.fast_generation = heartbeat_fast.generation(
                secret_prefix(_bearer(request), "rsn"))
        super().initial(request, *args, **kwargs)

    @extend_schema(request=HeartbeatSerializer, responses=HeartbeatResponseSerializer)
    def post(self, request):
        node = request.auth
        if (refusal := _too_big(request, MAX_HEARTBEAT_BYTES)) is not None:
            return refusal
        report = request.body
        serializer = HeartbeatSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        with transaction.atomic():
            result = marketplace.node_heartbeat_record(
                node_id=node.pk, node=node, report=serializer.validated_data)
            # Under the heartbeat's lock on the node's row, from the row it just wrote.
            routing.deployments_sync(node_id=node.pk, locked=result.node)
        if result.first_report or result.hardware_changed or result.engine_changed:
            trigger = (VerificationRun.Trigger.ENROLMENT if result.first_report
                       else VerificationRun.Trigger.HARDWARE_CHANGE if result.hardware_changed
                       else VerificationRun.Trigger.ENGINE_CHANGE)
            transaction.on_commit(lambda: verification.run_start(node_id=node.pk,
                                                                 trigger=trigger))
        if result.uuid_conflicts_changed:
            # Its UUID finding, and its verdict, follow the conflict at once, run or no run.
            verification.node_rejudge(node_id=node.pk)
        work = verification.heartbeat_work(node_id=node.pk)
        # While a run measures the machine: its GPUs' power draw, and soon a heartbeat a second;
        # from the report that starts a run on, so that the draw is in before its load test.
        report_power = work.report_power or result.first_report or result.hardware_changed
        answer = {"node_id": node.pk, "status": result.node.status,
                  "needs_review": result.node.held_out,
                  "heartbeat_interval_s": work.interval or settings.RIGSHARE_HEARTBEAT_INTERVAL_S,
                  "jobs": work.jobs, "report_power": report_power}
        engine = serializer.validated_data["engine"]
        if engine.get("supervisor") is not None:
            # The agent runs the engine: the command to run, the restarts asked for, and the
            # platform's yardstick while a verification run asks it to serve that instead.
            answer["engine"] = marketplace_selectors.node_engine_for_agent(result.node)
            answer["engine"]["yardstick"] = work.yardstick
        # An agent that says nothing of keys (older than them) is not handed one.
        engine_key = marketplace.node_engine_key_sync(
            node=result.node, held=engine.get("key_held"), in_use=engine.get("key_fingerprint"),
            hand_over="key_held" in engine)
        if engine_key is not None:
            answer["engine_key"] = engine_key
        if (not answer["jobs"] and not report_power and result.node.is_online
                and engine_key is None
                and not result.first_report and not result.hardware_changed
                and not result.uuid_conflicts_changed and not result.engine_changed):
            # A repeat of this report gets this answer again: the ASGI front may give it
            # (agentapi.asgi) until something forgets it (services.node_heartbeat_forget).
            body = json.dumps(answer, separators=(",", ":")).encode()
            transaction.on_commit(lambda: marketplace.node_heartbeat_remember(
                node=node, generation=self.fast_generation, report=report, answer=body))
        return Response(answer)


def _bearer(request) -> str:
    scheme, _, credential = request.headers.get("Authorization", "").partition(" ")
    return credential.strip() if scheme == NodeCredentialAuthentication.keyword else ""


class JobResultSerializer(serializers.Serializer):
    status = serializers.ChoiceField(choices=["done", "failed"])
    result = serializers.DictField(required=False, allow_null=True, default=None)
    error = serializers.CharField(required=False, allow_null=True, allow_blank=True,
                                  max_length=2000, default="")


class AgentJobResult(AgentView):
    @extend_schema(request=JobResultSerializer, responses={
        200: inline_serializer("JobResultStored", {"status": serializers.CharField()}),
        404: OpenApiResponse(description="No such job for this node."),
        409: OpenApiResponse(description="This job was answered already.")})
    def post(self, request, job_id: int):
        if len(request.body) > MAX_RESULT_BYTES:
            return Response({"body": ["The result is over 1 MB."]}, status=400)
        data = JobResultSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            verification.job_result_record(node_id=request.auth.pk, job_id=job_id,
                                           **data.validated_data)
        except verification.JobNotFound:
            return Response({"detail": "No such job for this node."}, status=404)
        except verification.JobAlreadyAnswered:
            return Response({"detail": "This job was answered already."}, status=409)
        return Response({"status": "stored"})
