from decimal import Decimal

from django import forms

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
