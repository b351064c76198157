"""The catalog's filters: one form validates them for the web page and the REST API alike."""

from decimal import Decimal

from django import forms
from django.db.models import F, FloatField, IntegerField

from billing.pricing import usd_to_micros
from marketplace import keyset


def _orders(name: str, *keys: keyset.Key, indexed: int = 0) -> dict[str, keyset.Order]:
    return {name: keyset.Order(keys, indexed=indexed),
            f"-{name}": keyset.Order(keys, descending=True, indexed=indexed)}


# Each sort's key ends with a unique tie-break, and each has an index that reads the rows in
# its order (marketplace/migrations, "catalog keyset"): a page is the next 25 entries of it.
CARD_ID = keyset.Key(F("id"), int)
SORTS = {
    # The listing's own card_id (the card's id), so that one index on the listing holds both.
    **_orders("price", keyset.Key(F("listing__price_per_hour_micros"), int),
              keyset.Key(F("listing__card_id"), int)),
    # An unknown size or an unverified card sorts as 0: first going up, last going down.
    **_orders("vram", keyset.Key(keyset.coalesced("memory_total_mib", 0, IntegerField()), int),
              CARD_ID),
    # Reliability is the machine's: its cards stay together, in id order.
    **_orders("reliability", keyset.Key(F("node__reliability_pct"), Decimal),
              keyset.Key(F("node_id"), int), CARD_ID, indexed=1),
    **_orders("capacity", keyset.Key(
        keyset.coalesced("verified_tokens_per_s", 0.0, FloatField()), float), CARD_ID),
}
SORT_LABELS = {
    "price": "Price: low to high", "-price": "Price: high to low",
    "vram": "VRAM: small to large", "-vram": "VRAM: large to small",
    "reliability": "Reliability: low to high", "-reliability": "Reliability: high to low",
    "capacity": "Verified tok/s: low to high", "-capacity": "Verified tok/s: high to low",
}


class CatalogFilterForm(forms.Form):
    q = forms.CharField(required=False, max_length=100, strip=True, label="Search")
    gpu = forms.CharField(required=False, max_length=128, label="GPU model")
    min_vram_gb = forms.IntegerField(required=False, min_value=0, max_value=4096,
                                     label="Min VRAM (GB)")
    max_price = forms.DecimalField(required=False, min_value=Decimal("0"), max_digits=12,
                                   decimal_places=4, label="Max price ($/h)")
    min_reliability = forms.DecimalField(required=False, min_value=Decimal("0"),
                                         max_value=Decimal("100"), max_digits=5,
                                         decimal_places=2, label="Min reliability (%)")
    region = forms.CharField(required=False, max_length=64)
    verified = forms.ChoiceField(required=False, choices=[("", "Any"), ("1", "Verified only")],
                                 label="Verification")
    sort = forms.ChoiceField(required=False, choices=[("", "Default (price)")]
                             + list(SORT_LABELS.items()))
    cursor = forms.CharField(required=False, max_length=512, label="Page")

    def __init__(self, data=None, *args, strict: bool = True, **kwargs):
        super().__init__(data, *args, **kwargs)
        unknown = sorted(set(data or {}) - set(self.fields)) if data is not None else []
        # The API refuses a parameter it does not know (a misspelt filter must not quietly
        # show everything); a page names the ones it ignores and shows the cards, so that a
        # shared link with a campaign tag (?utm_source=...) still works.
        self._unknown = unknown if strict else []
        self.ignored = [] if strict else unknown

    def clean(self):
        cleaned = super().clean()
        for name in self._unknown:
            self.add_error(None, f"Unknown filter '{name}'.")
        return cleaned

    def clean_cursor(self):
        token = self.cleaned_data.get("cursor") or ""
        if not token:
            return None
        if "sort" not in self.cleaned_data:
            return None  # the sort's own error says what is wrong
        sort = self.cleaned_data["sort"] or "price"
        try:
            return keyset.decode(token, sort, SORTS[sort])
        except keyset.InvalidCursor as exc:
            raise forms.ValidationError(str(exc)) from None

    def filters(self) -> dict:
        """The validated filters with money in micros; only call after is_valid()."""
        data = self.cleaned_data
        max_price = data.get("max_price")
        return {
            "gpu": data.get("gpu") or None,
            "min_vram_mib": None if data.get("min_vram_gb") is None
            # NVML reports a "24 GB" 4090 as 24,564 MiB and a "141 GB" H200 as 143,771 MiB:
            # 2% of slack keeps marketing gigabytes from hiding the card that was meant.
            else data["min_vram_gb"] * 1024 * 49 // 50,
            "max_price_micros": None if max_price is None else usd_to_micros(max_price),
            "min_reliability": data.get("min_reliability"),
            "region": data.get("region") or None,
            "verified_only": data.get("verified") == "1",
            "search": data.get("q") or None,
        }

    def sort_name(self) -> str:
        return self.cleaned_data.get("sort") or "price"

    def page_cursor(self) -> tuple[bool, list] | None:
        """(backwards, key values) of the row the page starts after, or None: the first page."""
        return self.cleaned_data.get("cursor")
