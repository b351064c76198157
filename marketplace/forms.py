import dataclasses
from decimal import Decimal

from django import forms
from django.conf import settings

from billing.pricing import micros_to_usd, usd_to_micros
from marketplace import costs, engine_config
from marketplace.models import Node


class ListingForm(forms.Form):
    is_listed = forms.BooleanField(required=False, label="Listed for rent")
    price_per_hour = forms.DecimalField(min_value=Decimal("0"), max_value=Decimal("10000"),
                                        max_digits=12, decimal_places=4,
                                        label="Price ($ per hour)")
    claimed_gpu_model = forms.CharField(required=False, max_length=128,
                                        label="GPU model you advertise")
    claimed_vram_gb = forms.IntegerField(required=False, min_value=1, max_value=4096,
                                         label="VRAM you advertise (GB)")
    description = forms.CharField(required=False, max_length=2000, widget=forms.Textarea(
        attrs={"rows": 2}))

    def clean(self):
        cleaned = super().clean()
        if cleaned.get("is_listed") and not cleaned.get("price_per_hour"):
            self.add_error("price_per_hour", "Set a price above zero before listing the card.")
        return cleaned


class NodeForm(forms.ModelForm):
    class Meta:
        model = Node
        fields = ["name", "region"]
        help_texts = {"region": "Where the machine is, e.g. eu-central or us-east."}


class RentForm(forms.Form):
    UNTIL_STOPPED, FOR_HOURS = "until_stopped", "hours"
    mode = forms.ChoiceField(choices=[(UNTIL_STOPPED, "Until I stop it"),
                                      (FOR_HOURS, "For a number of hours")],
                             widget=forms.RadioSelect, initial=UNTIL_STOPPED)
    hours = forms.IntegerField(required=False, min_value=1, max_value=24 * 90)
    accept_flagged = forms.BooleanField(required=False)

    def clean(self):
        cleaned = super().clean()
        if cleaned.get("mode") == self.FOR_HOURS and not cleaned.get("hours"):
            self.add_error("hours", "How many hours?")
        return cleaned

    def hours_or_none(self) -> int | None:
        return self.cleaned_data["hours"] if self.cleaned_data["mode"] == self.FOR_HOURS else None


class EngineOverrideForm(forms.Form):
    """One flag of a node's engine command set by hand. `engine` is the node's
    selectors.NodeEngine: the value is checked against the flag's range and against the node
    (its GPUs, the model's memory), with the node's other overrides in place."""

    flag = forms.ChoiceField(label="Flag")
    value = forms.CharField(max_length=256, label="Value")
    reason = forms.CharField(max_length=300, label="Why",
                             help_text="Shown beside the flag, for whoever reads it next.")

    def __init__(self, *args, engine, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine = engine
        kind = engine.config.engine if engine.config else None
        self.fields["flag"].choices = [
            (knob.flag, f"{knob.flag} ({knob.help})") for knob in engine_config.KNOBS.values()
            if kind is None or knob.engine == kind]

    def clean(self):
        cleaned = super().clean()
        flag, value = cleaned.get("flag"), cleaned.get("value")
        if not flag or value is None:
            return cleaned
        if not self.engine.inputs:
            raise forms.ValidationError("The engine reports no model yet: the configuration "
                                        "is computed once it does.")
        try:
            config = engine_config.check_override(
                flag=flag, value=value, overrides=self.engine.override_map(),
                **self.engine.inputs)
        except engine_config.OverrideError as exc:
            self.add_error("value", str(exc))
            return cleaned
        cleaned["value"] = engine_config.canonical_value(flag, value)
        self.config = config
        return cleaned


class BreakEvenForm(forms.Form):
    """The break-even calculator's inputs (marketplace.costs.Owning), as a GET form: the pages
    prefill it from a card's measurements or the fleet's medians, and anyone may change any
    figure. A figure out of range is an error on its field."""

    ELECTRICITY_CHOICES = [*((e.key, f"{e.label} (${micros_to_usd(e.micros_per_kwh).normalize()}"
                                       "/kWh)") for e in costs.ELECTRICITY.values()),
                           ("custom", "My own price")]

    tokens_per_s_loaded = forms.FloatField(min_value=0.01, max_value=1e6,
                                           label="Output tokens/s at full concurrency")
    concurrency = forms.IntegerField(min_value=1, max_value=4096,
                                     label="Concurrent requests (full concurrency)")
    tokens_per_s_single = forms.FloatField(min_value=0.01, max_value=1e6,
                                           label="Output tokens/s, one request at a time")
    idle_w = forms.FloatField(min_value=0, max_value=10_000, label="GPU power idle (W)")
    loaded_w = forms.FloatField(min_value=0, max_value=10_000, label="GPU power serving (W)")
    system_w = forms.FloatField(min_value=0, max_value=10_000,
                                label="Rest of the machine, per card (W)")
    electricity = forms.ChoiceField(choices=ELECTRICITY_CHOICES, label="Electricity")
    electricity_usd_per_kwh = forms.DecimalField(
        required=False, min_value=Decimal("0"), max_value=Decimal("10"), max_digits=9,
        decimal_places=6, label="My electricity price ($/kWh)")
    hardware_usd = forms.DecimalField(min_value=Decimal("0"), max_value=Decimal("10000000"),
                                      max_digits=12, decimal_places=2,
                                      label="What the card costs ($)", error_messages={
                                          "required": "Enter what the card costs (a price you "
                                                      "paid or would pay)."})
    amortization_months = forms.IntegerField(min_value=1, max_value=240,
                                             label="Paid off over (months)")
    api_usd_per_mtok = forms.DecimalField(
        required=False, min_value=Decimal("0"), max_value=Decimal("10000"), max_digits=12,
        decimal_places=6, label="API price to beat ($ per 1M output tokens)")
    price_per_hour_usd = forms.DecimalField(
        required=False, min_value=Decimal("0"), max_value=Decimal("10000"), max_digits=12,
        decimal_places=4, label="Rented out at ($ per hour)")
    utilization_pct = forms.DecimalField(
        required=False, min_value=Decimal("0"), max_value=Decimal("100"), max_digits=5,
        decimal_places=2, label="Rented (% of the time)")

    def clean(self):
        cleaned = super().clean()
        self.owning = None
        if cleaned.get("electricity") == "custom" and cleaned.get(
                "electricity_usd_per_kwh") is None:
            self.add_error("electricity_usd_per_kwh", "Enter your price per kWh, or pick a "
                                                      "country's average.")
        if (cleaned.get("price_per_hour_usd") is None) != (cleaned.get("utilization_pct") is None):
            missing = ("utilization_pct" if cleaned.get("utilization_pct") is None
                       else "price_per_hour_usd")
            self.add_error(missing, "Give both the price per hour and the share of the time "
                                    "rented for a month's earnings, or neither.")
        if self.errors:
            return cleaned
        api = cleaned.get("api_usd_per_mtok")
        self.owning = costs.Owning(
            tokens_per_s_single=cleaned["tokens_per_s_single"],
            tokens_per_s_loaded=cleaned["tokens_per_s_loaded"],
            concurrency=cleaned["concurrency"], idle_w=cleaned["idle_w"],
            loaded_w=cleaned["loaded_w"], system_w=cleaned["system_w"],
            electricity_micros_per_kwh=self.electricity_micros(),
            hardware_micros=usd_to_micros(cleaned["hardware_usd"]),
            amortization_months=cleaned["amortization_months"],
            api_micros_per_mtok=None if api is None else usd_to_micros(api))
        return cleaned

    def electricity_micros(self, key: str | None = None) -> int:
        key = key or self.cleaned_data["electricity"]
        if key == "custom":
            return usd_to_micros(self.cleaned_data["electricity_usd_per_kwh"])
        return costs.ELECTRICITY[key].micros_per_kwh

    def for_electricity(self, key: str) -> costs.Owning:
        """The same card at another electricity price (a country's average, or the one given)."""
        return dataclasses.replace(self.owning, electricity_micros_per_kwh=(
            self.electricity_micros(key)))

    def month(self) -> costs.Month | None:
        data = self.cleaned_data
        if data.get("price_per_hour_usd") is None:
            return None
        return self.owning.month(price_per_hour_micros=usd_to_micros(data["price_per_hour_usd"]),
                                 utilization=costs.exact(data["utilization_pct"]) / 100,
                                 fee_bps=settings.RIGSHARE_PLATFORM_FEE_BPS)
