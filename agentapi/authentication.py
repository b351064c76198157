"""The node credential (`Authorization: Bearer rsn_...`), parsed once for every agent view."""

from django.utils.functional import SimpleLazyObject
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions, permissions

from marketplace import services as marketplace


class NodeCredentialAuthentication(authentication.BaseAuthentication):
    """request.user is the node's owner and request.auth the Node; a revoked credential is
    refused with 403, an unknown one with 401."""

    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1")
        scheme, _, credential = header.partition(" ")
        if scheme != self.keyword or not credential.strip():
            return None
        try:
            node = marketplace.node_authenticate(credential=credential.strip())
        except marketplace.CredentialRefused as exc:
            if exc.revoked:
                raise exceptions.PermissionDenied(str(exc)) from None
            raise exceptions.AuthenticationFailed(str(exc)) from None
        # The owner is read only if something asks for it: an agent's request rarely does.
        return SimpleLazyObject(lambda: node.owner), node

    def authenticate_header(self, request):
        return self.keyword


class IsNode(permissions.BasePermission):
    message = "Send the node credential as 'Authorization: Bearer rsn_...'."

    def has_permission(self, request, view):
        from marketplace.models import Node

        return isinstance(request.auth, Node)


class NodeCredentialScheme(OpenApiAuthenticationExtension):
    target_class = "agentapi.authentication.NodeCredentialAuthentication"
    name = "nodeCredential"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "rsn_...",
                "description": "The node credential the agent got at enrolment."}
