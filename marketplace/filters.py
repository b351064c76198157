"""The catalog's filters: one form validates them for the web page and the REST API alike."""

from dataclasses import dataclass
from decimal import Decimal

from django import forms
from django.db.models import BigIntegerField, F, FloatField, IntegerField

from billing.pricing import usd_to_micros
from marketplace import keyset, model_data, modelmath
from marketplace.models import UNKNOWN_COST


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
    # What its engine served in the last hour, per stream (routing's live figures): a card
    # without traffic sorts as 0.
    **_orders("served", keyset.Key(
        keyset.coalesced("served_tokens_per_s", 0.0, FloatField()), float), CARD_ID),
    # $ per 1M output tokens at full use, kept on the listing (services): a card without a
    # verified figure last going up, first going down; then the listing's card_id, as price.
    **_orders("cost", keyset.Key(keyset.coalesced("listing__cost_per_mtok_micros", UNKNOWN_COST,
                                                  BigIntegerField()), int),
              keyset.Key(F("listing__card_id"), int)),
}
SORT_LABELS = {
    "price": "Price: low to high", "-price": "Price: high to low",
    "vram": "VRAM: small to large", "-vram": "VRAM: large to small",
    "reliability": "Reliability: low to high", "-reliability": "Reliability: high to low",
    "capacity": "Verified tok/s: low to high", "-capacity": "Verified tok/s: high to low",
    "served": "Served tok/s per stream: low to high",
    "-served": "Served tok/s per stream: high to low",
    "cost": "$ per 1M tokens: low to high", "-cost": "$ per 1M tokens: high to low",
}


# "Runs MODEL at CONTEXT tokens": the weights a renter would load (GGUF files run on llama.cpp,
# the others on vLLM, marketplace.modelmath.engine_for) and the KV cache's type.
QUANT_CHOICES = [("bf16", "BF16, 16-bit (vLLM)"), ("fp8", "FP8, 8-bit (vLLM)"),
                 ("awq", "AWQ/GPTQ 4-bit (vLLM)"), ("q8_0", "GGUF Q8_0 (llama.cpp)"),
                 ("q4_k_m", "GGUF Q4_K_M (llama.cpp)")]
KV_CACHE_CHOICES = [("", "16-bit, the engine's default"), ("fp8", "FP8 (vLLM)"),
                    ("q8_0", "Q8_0 (llama.cpp)"), ("q4_0", "Q4_0 (llama.cpp)")]
MAX_CONTEXT = 10_000_000  # tokens: beyond any model we know, so the model's own limit speaks
QUANT_SHORT = {"bf16": "BF16", "fp8": "FP8", "awq": "AWQ 4-bit", "q8_0": "GGUF Q8_0",
               "q4_k_m": "GGUF Q4_K_M"}
KV_CACHE_SHORT = {"fp8": "an FP8", "q8_0": "a Q8_0", "q4_0": "a Q4_0"}
ENGINE_LABELS = {"vllm": "vLLM", "llama.cpp": "llama.cpp"}


@dataclass(frozen=True)
class FitQuestion:
    """A validated "does a card run this model at this context" and its answer for the catalog:
    the least memory (MiB, as NVML reports it) a card must have. One card, since a rental is
    one card: one sequence of `context` tokens beside the weights, under the engine's rules."""

    model: str
    label: str
    arch: modelmath.Architecture
    context: int
    quantization: str
    kv_cache: str
    engine: modelmath.Engine
    min_vram_mib: int

    @property
    def engine_label(self) -> str:
        return ENGINE_LABELS[self.engine.kind]

    def describe(self) -> str:
        """"Qwen3.5-27B at 262,144 tokens, FP8 weights and an FP8 KV cache on vLLM"."""
        cache = f" and {KV_CACHE_SHORT[self.kv_cache]} KV cache" if self.kv_cache else ""
        return (f"{self.label} at {self.context:,} tokens, {QUANT_SHORT[self.quantization]} "
                f"weights{cache} on {self.engine_label}")

    def query(self) -> dict:
        """The catalog's and /tools/vram's parameters that ask the same question."""
        return {"model": self.model, "context": self.context, "quant": self.quantization,
                **({"kv_cache": self.kv_cache} if self.kv_cache else {})}


class FitFieldsMixin(forms.Form):
    """The model, context, weights and KV-cache fields, validated together into `self.fit`:
    a model nobody knows, a context beyond the model's, or a cache type the weights' engine
    lacks is an error on its field, never a filter quietly left out."""

    model = forms.CharField(required=False, max_length=200, label="Runs model")
    context = forms.IntegerField(required=False, min_value=1, max_value=MAX_CONTEXT,
                                 label="At context (tokens)")
    quant = forms.ChoiceField(required=False, choices=[("", "BF16 (default)")] + QUANT_CHOICES,
                              label="Weights")
    kv_cache = forms.ChoiceField(required=False, choices=KV_CACHE_CHOICES, label="KV cache")
    fit_required = False

    def clean(self):
        cleaned = super().clean()
        self.fit = None
        model, context = cleaned.get("model"), cleaned.get("context")
        asked = [name for name in ("model", "context", "quant", "kv_cache")
                 if self.data.get(name) not in (None, "")]
        if not asked and not self.fit_required:
            return cleaned
        if any(name in self.errors for name in asked):
            return cleaned  # the field's own error says what is wrong
        if not model:
            self.add_error("model", "Pick a model for this question.")
        if not context:
            self.add_error("context", "Say how many tokens of context it needs.")
        if not model or not context:
            return cleaned
        name = model_data.canonical_name(model)
        if name is None:
            known = ", ".join(label for _, label in model_data.known_models())
            self.add_error("model", f"Unknown model '{model}'. Rigshare knows {known}.")
            return cleaned
        arch = model_data.architecture_for(name)
        label = model_data.MODELS[name]["label"]
        if arch.max_context and context > arch.max_context:
            self.add_error("context", f"{label} reads at most {arch.max_context:,} tokens.")
            return cleaned
        quant = cleaned.get("quant") or "bf16"
        try:
            engine = modelmath.engine_for(quant, cleaned.get("kv_cache") or None)
        except ValueError:
            loader = ENGINE_LABELS[modelmath.engine_for(quant).kind]
            self.add_error("kv_cache", f"{dict(KV_CACHE_CHOICES)[cleaned['kv_cache']]} is not "
                                       f"a cache of {loader}, which loads "
                                       f"{QUANT_SHORT[quant]} weights.")
            return cleaned
        need = modelmath.min_vram_mib(arch, quantization=quant, context=context, engine=engine)
        self.fit = FitQuestion(model=name, label=label, arch=arch, context=context,
                               quantization=quant, kv_cache=cleaned.get("kv_cache") or "",
                               engine=engine, min_vram_mib=need)
        return cleaned


class CatalogFilterForm(FitFieldsMixin, forms.Form):
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
            "min_vram_mib": self._min_vram_mib(),
            "max_price_micros": None if max_price is None else usd_to_micros(max_price),
            "min_reliability": data.get("min_reliability"),
            "region": data.get("region") or None,
            "verified_only": data.get("verified") == "1",
            "search": data.get("q") or None,
        }

    def _min_vram_mib(self) -> int | None:
        """The larger of the two floors on a card's memory: the one asked for and the one the
        model at its context needs (a card fits by its own memory: a rental is one card)."""
        asked = self.cleaned_data.get("min_vram_gb")
        floors = [self.fit.min_vram_mib] if self.fit else []
        if asked is not None:
            # NVML reports a "24 GB" 4090 as 24,564 MiB and a "141 GB" H200 as 143,771 MiB:
            # 2% of slack keeps marketing gigabytes from hiding the card that was meant.
            floors.append(asked * 1024 * 49 // 50)
        return max(floors, default=None)

    def sort_name(self) -> str:
        return self.cleaned_data.get("sort") or "price"

    def page_cursor(self) -> tuple[bool, list] | None:
        """(backwards, key values) of the row the page starts after, or None: the first page."""
        return self.cleaned_data.get("cursor")


@dataclass(frozen=True)
class CardSize:
    label: str
    mib: int  # per card, as NVML reports it, or computed from the nominal size where noted
    note: str


# /tools/vram's rows: the sizes renters meet, each with the cards that have it (FACTS.md's GPU
# table). NVML readings where FACTS.md has one; the others are the nominal size in GiB, which
# NVML reports a little lower (a 4090's 24 GiB reads 24,564 MiB).
CARD_SIZES = [
    CardSize("24 GB", 24_564, "RTX 4090, RTX 3090 (NVML reading)"),
    CardSize("32 GB", 32 * 1024, "RTX 5090 (nominal)"),
    CardSize("48 GB", 48 * 1024, "L40S (nominal)"),
    CardSize("80 GB", 80 * 1024, "H100, A100 80GB (nominal)"),
    CardSize("96 GB", 96 * 1024, "RTX PRO 6000 Blackwell (nominal)"),
    CardSize("141 GB", 143_771, "H200 (NVML reading)"),
]


class VramToolForm(FitFieldsMixin, forms.Form):
    """/tools/vram: the model, weights, KV cache and context a renter asks about; the defaults
    ask about the fleet's 27B at 32,768 tokens."""

    DEFAULTS = {"model": "Qwen/Qwen3.5-27B", "context": "32768", "quant": "bf16"}
    fit_required = True

    def __init__(self, data=None, *args, **kwargs):
        super().__init__(data, *args, **kwargs)
        self.ignored = sorted(set(data or {}) - set(self.fields))
