import re
import uuid
from decimal import Decimal

from django import forms
from django.core.validators import RegexValidator

from accounts.models import User
from billing.models import ApiKey, PayoutDestination
from billing.pricing import micros_to_usd, usd_to_micros


def fresh_key() -> str:
    return uuid.uuid4().hex


def _idempotency_key_field() -> forms.CharField:
    return forms.CharField(widget=forms.HiddenInput, max_length=32, validators=[RegexValidator(
        r"^[0-9a-f]{32}$", "This form is damaged: reload the page and submit it again.")])


class TopUpForm(forms.Form):
    """A credit purchase. The hidden key is made when the form is rendered, so submitting the same
    form twice (a double click, a reload) names one payment and charges once."""

    amount = forms.DecimalField(label="Amount (USD)", min_value=Decimal("1"),
                                max_value=Decimal("10000"), max_digits=7, decimal_places=2)
    card_number = forms.CharField(label="Card number", max_length=30,
                                  widget=forms.TextInput(attrs={"autocomplete": "cc-number",
                                                                "inputmode": "numeric"}))
    idempotency_key = _idempotency_key_field()

    def __init__(self, *args, collects_card: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        if not collects_card:  # the processor's own page takes the card
            del self.fields["card_number"]
        if not self.is_bound:
            self.initial.setdefault("idempotency_key", fresh_key())

    def clean_card_number(self):
        digits = re.sub(r"[\s-]", "", self.cleaned_data["card_number"])
        if not re.fullmatch(r"\d{12,19}", digits):
            raise forms.ValidationError("Enter the card number: 12 to 19 digits.")
        return digits

    def amount_micros(self) -> int:
        return usd_to_micros(self.cleaned_data["amount"])


class PayoutRequestForm(forms.Form):
    amount = forms.DecimalField(label="Amount (USD)", min_value=Decimal("0.01"),
                                max_value=Decimal("1000000"), max_digits=13, decimal_places=2)

    def amount_micros(self) -> int:
        return usd_to_micros(self.cleaned_data["amount"])


class PayoutDestinationForm(forms.Form):
    """Where payouts go; billing.services.payout_destination_set checks the numbers."""

    method = forms.ChoiceField(label="Paid by", choices=PayoutDestination.Method.choices,
                               widget=forms.RadioSelect)
    holder_name = forms.CharField(label="Account holder's name", max_length=140)
    iban = forms.CharField(label="IBAN", max_length=50, required=False,
                           help_text="For a bank transfer, e.g. DE89 3704 0044 0532 0130 00.")
    bic = forms.CharField(label="BIC (optional)", max_length=20, required=False)
    paypal_email = forms.EmailField(label="PayPal address", required=False,
                                    help_text="For PayPal.")

    def clean(self):
        cleaned = super().clean()
        method = cleaned.get("method")
        if method == PayoutDestination.Method.BANK and not cleaned.get("iban"):
            self.add_error("iban", "A bank transfer needs the IBAN.")
        if method == PayoutDestination.Method.PAYPAL and not cleaned.get("paypal_email"):
            self.add_error("paypal_email", "PayPal needs the address.")
        return cleaned


class ApiKeyForm(forms.Form):
    """Limits of an API key; every one optional (blank: no limit)."""

    name = forms.CharField(max_length=100)
    spend_limit = forms.DecimalField(label="Spend limit (USD)", required=False,
                                     min_value=Decimal("0"), max_value=Decimal("1000000"),
                                     max_digits=13, decimal_places=2)
    spend_period = forms.ChoiceField(label="per", choices=ApiKey.Period.choices,
                                     initial=ApiKey.Period.MONTHLY)
    allowed_models = forms.CharField(
        label="Models allowed", required=False, max_length=2000,
        help_text="Comma-separated model names; blank allows every model.")
    requests_per_minute = forms.IntegerField(required=False, min_value=1, max_value=1_000_000)
    tokens_per_minute = forms.IntegerField(required=False, min_value=1, max_value=1_000_000_000)

    @classmethod
    def initial_for(cls, key: ApiKey) -> dict:
        return {"name": key.name, "spend_period": key.spend_period,
                "spend_limit": None if key.spend_limit_micros is None
                else micros_to_usd(key.spend_limit_micros).quantize(Decimal("0.01")),
                "allowed_models": ", ".join(key.allowed_models or ()),
                "requests_per_minute": key.requests_per_minute,
                "tokens_per_minute": key.tokens_per_minute}

    def clean_allowed_models(self):
        names = [n.strip() for n in self.cleaned_data["allowed_models"].split(",")]
        names = list(dict.fromkeys(n for n in names if n))
        if any(len(n) > 200 for n in names):
            raise forms.ValidationError("A model name is at most 200 characters.")
        if len(names) > 100:
            raise forms.ValidationError("At most 100 models.")
        return names

    def key_fields(self) -> dict:
        """The keyword arguments of `billing.keys.api_key_create` / `api_key_update`."""
        data = self.cleaned_data
        return {"name": data["name"], "spend_period": data["spend_period"],
                "spend_limit_micros": None if data["spend_limit"] is None
                else usd_to_micros(data["spend_limit"]),
                "allowed_models": data["allowed_models"],
                "requests_per_minute": data["requests_per_minute"],
                "tokens_per_minute": data["tokens_per_minute"]}


class GrantCreditForm(forms.Form):
    """The operator's top-up in the admin."""

    email = forms.EmailField(label="User's email")
    amount = forms.DecimalField(label="Amount (USD)", min_value=Decimal("0.01"),
                                max_value=Decimal("1000000"), max_digits=13, decimal_places=2)
    memo = forms.CharField(max_length=200, required=False)
    idempotency_key = _idempotency_key_field()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.is_bound:
            self.initial.setdefault("idempotency_key", fresh_key())

    def clean_email(self):
        email = self.cleaned_data["email"].strip().lower()
        user = User.objects.filter(email__iexact=email).first()
        if user is None:
            raise forms.ValidationError("No user has this email address.")
        self.user = user
        return email

    def amount_micros(self) -> int:
        return usd_to_micros(self.cleaned_data["amount"])
