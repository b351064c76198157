"""The REST API's OpenAPI schema: drf-spectacular's, with the 4xx answers that DRF really gives
documented on every operation, in the shapes DRF gives them.

drf-spectacular documents only the success responses by itself. This AutoSchema adds, to each
operation, whichever of these it can give and has not documented itself (a view's own
`@extend_schema(responses=...)` entry for a code wins):

- 400, 413 and 415: the operation takes a request body (malformed, invalid field by field,
  over DATA_UPLOAD_MAX_MEMORY_SIZE, or in a media type the view does not parse);
- 401 (403 where the view's first authenticator sends no challenge, as DRF then answers):
  the view requires a user, or takes credentials that can be refused (a bearer token);
- 403: a write with the session cookie (CSRF), or a permission beyond "authenticated";
- 404: the path names an object (`{id}`), or the operation is a paginated list (`?page=`
  past the end);
- 429: the view is throttled.

A view documents any other 4xx of its own (409, say) with a description alone, as
`OpenApiResponse(description=...)`: its body is DRF's, filled in here.
"""

from drf_spectacular.openapi import AutoSchema as SpectacularAutoSchema
from drf_spectacular.plumbing import ResolvedComponent
from rest_framework import authentication, permissions

# DRF's answer for every APIException but a validation error: {"detail": "..."}.
ERROR = "Error"
ERROR_SCHEMA = {
    "type": "object",
    "properties": {"detail": {"type": "string"}},
    "required": ["detail"],
}
# DRF's validation error: field name -> its messages, or for a nested object (or a list of
# them) the same shape again; `non_field_errors` for the body as a whole, and `detail` (a
# string) for a body that could not be parsed at all.
VALIDATION_ERROR = "ValidationError"
VALIDATION_ERROR_SCHEMA = {
    "type": "object",
    "description": "Errors by field: `non_field_errors` for the request as a whole, `detail` "
                   "for a body that could not be parsed.",
    "additionalProperties": {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "object"}]}},
            {"type": "object"},
        ],
    },
}

DESCRIPTIONS = {
    400: "The request is malformed or invalid: the errors, field by field.",
    401: "Credentials are missing, unknown or revoked.",
    403: "The credentials may not do this.",
    404: "No such object among the caller's own, or no such page.",
    413: "The body is over the size limit.",
    415: "The body is in a media type this operation does not read.",
    429: "Too many requests: retry after the number of seconds in Retry-After.",
}

BASIC_PERMISSIONS = (permissions.AllowAny, permissions.IsAuthenticated,
                     permissions.IsAuthenticatedOrReadOnly)


def _challenges(authenticator) -> bool:
    """Whether the authenticator answers a refusal with a WWW-Authenticate challenge (DRF then
    answers 401; without one it answers 403)."""
    return (type(authenticator).authenticate_header
            is not authentication.BaseAuthentication.authenticate_header)


class AutoSchema(SpectacularAutoSchema):
    def get_operation(self, path, path_regex, path_prefix, method, registry):
        operation = super().get_operation(path, path_regex, path_prefix, method, registry)
        if operation is None:
            return None
        responses = operation.setdefault("responses", {})
        for code in self.error_codes(operation):
            responses.setdefault(str(code), self._error_response(code))
        for code, response in responses.items():
            # A 4xx that a view documents with only a description gets DRF's body for it.
            if code.startswith("4") and "content" not in response:
                responses[code] = {**self._error_response(int(code)),
                                   "description": response.get("description")
                                   or DESCRIPTIONS.get(int(code), "")}
        operation["responses"] = dict(sorted(responses.items()))
        return operation

    def error_codes(self, operation: dict) -> list[int]:
        """The 4xx codes this operation can answer (see the module's docstring)."""
        view, codes = self.view, set()
        authenticators = view.get_authenticators()
        perms = view.get_permissions()
        safe = self.method in permissions.SAFE_METHODS
        if "requestBody" in operation:
            codes |= {400, 413, 415}
        open_to_all = all(
            isinstance(p, permissions.AllowAny)
            or (isinstance(p, permissions.IsAuthenticatedOrReadOnly) and safe) for p in perms)
        refuses_credentials = any(not isinstance(a, authentication.SessionAuthentication)
                                  for a in authenticators)
        if not open_to_all or refuses_credentials:
            codes.add(401 if authenticators and _challenges(authenticators[0]) else 403)
        session = any(isinstance(a, authentication.SessionAuthentication) for a in authenticators)
        if (session and not safe) or any(not isinstance(p, BASIC_PERMISSIONS) for p in perms):
            codes.add(403)
        if "{" in self.path or (safe and self._is_list_view() and self._get_paginator()):
            codes.add(404)
        if view.get_throttles():
            codes.add(429)
        return sorted(codes)

    def _error_response(self, code: int) -> dict:
        name, schema = ((VALIDATION_ERROR, VALIDATION_ERROR_SCHEMA) if code == 400
                        else (ERROR, ERROR_SCHEMA))
        component = ResolvedComponent(name=name, type=ResolvedComponent.SCHEMA, object=name,
                                      schema=schema)
        self.registry.register_on_missing(component)
        return {
            "content": {media_type: {"schema": component.ref}
                        for media_type in self.map_renderers("media_type")},
            "description": DESCRIPTIONS.get(code, ""),
        }
