"""The catalog's filters: one form validates them for the web page and the REST API alike."""

from decimal import Decimal

from django import forms
from django.db.models import F

from billing.pricing import usd_to_micros

SORTS = {
    "price": ("listing__price_per_hour_micros", "id"),
    "-price": ("-listing__price_per_hour_micros", "id"),
    "vram": ("memory_total_mib", "id"),
    "-vram": ("-memory_total_mib", "id"),
    "reliability": ("node__reliability_pct", "id"),
    "-reliability": ("-node__reliability_pct", "id"),
    "capacity": (F("verified_tokens_per_s").asc(nulls_first=True), "id"),
    "-capacity": (F("verified_tokens_per_s").desc(nulls_last=True), "id"),
}
SORT_LABELS = {
    "price": "Price: low to high", "-price": "Price: high to low",
    "vram": "VRAM: small to large", "-vram": "VRAM: large to small",
    "reliability": "Reliability: low to high", "-reliability": "Reliability: high to low",
    "capacity": "Verified tok/s: low to high", "-capacity": "Verified tok/s: high to low",
}


class CatalogFilterForm(forms.Form):
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
    page = forms.IntegerField(required=False, min_value=1)

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
            "sort": SORTS[data.get("sort") or "price"],
        }
