"""REST API (DRF): catalog, rentals, a provider's nodes, listings and enrolment tokens. Each view
sees only what its user owns. The node agent's protocol is agentapi's."""

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
)
from rest_framework import generics, mixins, permissions, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.utils.urls import replace_query_param

from marketplace import selectors, services
from marketplace.filters import (
    KV_CACHE_CHOICES,
    MAX_CONTEXT,
    QUANT_CHOICES,
    SORTS,
    CatalogFilterForm,
)
from marketplace.model_data import known_models
from marketplace.models import EnrolmentToken, Listing, Node, Rental
from marketplace.serializers import (
    CatalogCardSerializer,
    CatalogPageSerializer,
    EnrolmentTokenSerializer,
    ListingSerializer,
    NodeSerializer,
    RentalSerializer,
)


def _query(name, type_, description, **kwargs):
    return OpenApiParameter(name, type_, OpenApiParameter.QUERY, description=description, **kwargs)


CATALOG_PAGE_SIZE = 50


@extend_schema_view(get=extend_schema(
    operation_id="cards_list",
    parameters=[
        _query("q", str, "Search: a GPU name, a model the machine serves, or the machine's "
                         "name contains this (any case)."),
        _query("gpu", str, "This GPU model only (its full name, any case)."),
        _query("min_vram_gb", int, "At least this much VRAM (GB)."),
        _query("max_price", OpenApiTypes.DECIMAL, "At most this price per hour (USD)."),
        _query("min_reliability", OpenApiTypes.DECIMAL, "At least this uptime (%, 0-100)."),
        _query("region", str, "This region only (any case)."),
        _query("verified", str, "`1`: verified cards only.", enum=["", "1"]),
        _query("model", str, "With `context`: cards that run this model (an id such as "
                             "`Qwen/Qwen3.5-27B`, any case) at that context, on their own: "
                             "its weights and one sequence of `context` tokens fit the card's "
                             "memory under its engine's rules (vLLM, or llama.cpp for GGUF "
                             "weights). Known models: "
                             + ", ".join(f"`{name}`" for name, _ in known_models()) + "."),
        _query("context", {"type": "integer", "minimum": 1, "maximum": MAX_CONTEXT},
               "With `model`: the tokens of context one sequence needs (prompt and output), "
               "1 up to the model's own limit."),
        _query("quant", str, "With `model`: the weights' quantization; `bf16` if not given.",
               enum=["", *dict(QUANT_CHOICES)]),
        _query("kv_cache", str, "With `model`: the KV cache's type; the engine's 16-bit "
                                "default if not given. `fp8` is vLLM's, `q8_0` and `q4_0` "
                                "llama.cpp's.", enum=[key for key, _ in KV_CACHE_CHOICES]),
        _query("sort", str, "The order; by price if not given. `cost`: by $ per 1M output "
                            "tokens at full use (`cost_per_mtok_usd`), cards not measured "
                            "yet last (first with `-cost`).", enum=["", *SORTS]),
        _query("cursor", str, "The page: a `next` or `previous` link's cursor, with the same "
                              "`sort`. The first page without it."),
    ],
    responses={200: CatalogPageSerializer, 400: OpenApiResponse(
        description="A filter or the cursor is invalid, or a parameter unknown: the errors "
                    "by parameter, each a list of `{message, code}`.")},
))
class CatalogCardList(generics.GenericAPIView):
    """Cards for rent, with the catalog page's search and filters (`q`, `gpu`, `min_vram_gb`,
    `max_price`, `min_reliability`, `region`, `verified=1`, "runs `model` at `context`
    tokens" with `quant` and `kv_cache`, `sort`), 50 a page. Pages are
    keyset pages: follow `next` and `previous`, whose cursors name the row a page starts
    after, so a page stays as fast at the end of the catalog as at its start."""

    serializer_class = CatalogCardSerializer
    permission_classes = [permissions.AllowAny]
    pagination_class = None  # keyset pages of its own (selectors.catalog_page)

    def get(self, request):
        form = CatalogFilterForm(request.query_params)
        if not form.is_valid():
            raise ValidationError(form.errors.get_json_data())
        page = selectors.catalog_page(form.filters(), sort=form.sort_name(),
                                      cursor=form.page_cursor(),
                                      size=CATALOG_PAGE_SIZE)
        url = request.build_absolute_uri()
        prices = selectors.platform_prices({card.verified_model for card in page.cards})
        return Response({
            "count": page.count, "count_is_estimate": page.count_estimated,
            "next": page.next_cursor and replace_query_param(url, "cursor", page.next_cursor),
            "previous": page.previous_cursor and replace_query_param(url, "cursor",
                                                                     page.previous_cursor),
            "results": self.get_serializer(page.cards, many=True, context=dict(
                self.get_serializer_context(), platform_prices=prices)).data,
        })


class CatalogCardDetail(generics.RetrieveAPIView):
    serializer_class = CatalogCardSerializer
    permission_classes = [permissions.AllowAny]

    def get_queryset(self):
        return selectors.cards_for_catalog({})

    def retrieve(self, request, *args, **kwargs):
        card = self.get_object()
        prices = selectors.platform_prices({card.verified_model})
        return Response(self.get_serializer(card, context=dict(
            self.get_serializer_context(), platform_prices=prices)).data)


class RentalViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.CreateModelMixin,
                    viewsets.GenericViewSet):
    serializer_class = RentalSerializer
    queryset = Rental.objects.none()  # the schema's types; get_queryset says whose

    def get_queryset(self):
        return selectors.rentals_of(self.request.user)

    def perform_create(self, serializer):
        try:
            serializer.instance = services.rental_start(
                renter=self.request.user, card_id=serializer.validated_data["card_id"],
                hours=serializer.validated_data.get("hours"),
                accept_flagged=serializer.validated_data.get("accept_flagged", False))
        except services.RentalRefused as exc:
            raise ValidationError({"card": [str(exc)]}) from None

    @extend_schema(request=None, responses=RentalSerializer)
    @action(detail=True, methods=["post"])
    def stop(self, request, pk=None):
        rental = self.get_object()
        rental = services.rental_stop(rental_id=rental.pk, renter=request.user)
        return Response(self.get_serializer(rental).data)


class NodeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.UpdateModelMixin,
                  viewsets.GenericViewSet):
    """The provider's own machines. Only `name` and `region` are theirs to change: hardware
    facts come from the agent."""

    serializer_class = NodeSerializer
    queryset = Node.objects.none()  # the schema's types; get_queryset says whose
    http_method_names = ["get", "patch", "post", "head", "options"]

    def get_queryset(self):
        return selectors.provider_nodes(self.request.user)

    def perform_update(self, serializer):
        node = serializer.instance
        serializer.instance = services.node_update(
            owner=self.request.user, node_id=node.pk,
            name=serializer.validated_data.get("name", node.name),
            region=serializer.validated_data.get("region", node.region))

    @extend_schema(request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        node = self.get_object()
        services.node_revoke(owner=request.user, node_id=node.pk)
        return Response(self.get_serializer(self.get_queryset().get(pk=node.pk)).data)


class ListingDetail(generics.RetrieveUpdateAPIView):
    """A provider's offer for one of their cards: listed or not, price, claims."""

    serializer_class = ListingSerializer
    http_method_names = ["get", "patch", "head", "options"]
    lookup_field = "card_id"

    def get_queryset(self):
        return Listing.objects.filter(card__node__owner=self.request.user)

    def perform_update(self, serializer):
        listing, data = serializer.instance, serializer.validated_data
        try:
            serializer.instance = services.listing_update(
                owner=self.request.user, card_id=listing.card_id,
                is_listed=data.get("is_listed", listing.is_listed),
                price_per_hour_micros=data.get("price_per_hour_micros",
                                               listing.price_per_hour_micros),
                claimed_gpu_model=data.get("claimed_gpu_model", listing.claimed_gpu_model),
                claimed_vram_gb=data.get("claimed_vram_gb", listing.claimed_vram_gb),
                description=data.get("description", listing.description))
        except services.MarketplaceError as exc:
            raise ValidationError({"is_listed": [str(exc)]}) from None


class EnrolmentTokenViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin,
                            viewsets.GenericViewSet):
    serializer_class = EnrolmentTokenSerializer
    queryset = EnrolmentToken.objects.none()  # the schema's types; get_queryset says whose

    def get_queryset(self):
        return selectors.provider_enrolment_tokens(self.request.user)

    @extend_schema(request=None, responses={201: OpenApiResponse(
        description="The token (shown once) and the commands to run on the machine.")})
    def create(self, request):
        row, token = services.enrolment_token_create(owner=request.user)
        data = dict(self.get_serializer(row).data, token=token)
        return Response(data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=EnrolmentTokenSerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        row = self.get_object()
        services.enrolment_token_revoke(owner=request.user, token_id=row.pk)
        row.refresh_from_db()
        return Response(self.get_serializer(row).data)
