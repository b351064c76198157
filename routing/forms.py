"""The activity log's filters: what a consumer may ask for, checked before any query. A value
that does not parse, or names a key that is not the user's own, is a form error."""

import re
from datetime import UTC, datetime, time, timedelta

from django import forms
from django.http import QueryDict

from billing.models import ApiKey
from routing.selectors import ActivityFilters, Cursor

STATUSES = [("", "Any status"), ("ok", "OK"), ("error", "Errors")]
_CURSOR = re.compile(r"^(\d{1,18})-(\d{1,18})$")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def cursor_text(cursor: Cursor) -> str:
    """A page's cursor as a query parameter: the last row's time in microseconds and its id."""
    at, pk = cursor
    return f"{(at - _EPOCH) // timedelta(microseconds=1)}-{pk}"


class DateInput(forms.DateInput):
    input_type = "date"


class ActivityFilterForm(forms.Form):
    since = forms.DateField(required=False, label="From (UTC)", widget=DateInput)
    until = forms.DateField(required=False, label="To (UTC)", widget=DateInput)
    model = forms.CharField(required=False, max_length=200, label="Model",
                            widget=forms.TextInput(attrs={"list": "model-names"}))
    key = forms.TypedChoiceField(required=False, coerce=int, empty_value=None, label="API key")
    status = forms.ChoiceField(required=False, choices=STATUSES, label="Status")
    before = forms.CharField(required=False, widget=forms.HiddenInput)

    def __init__(self, data=None, *, user_id: int):
        super().__init__(data)
        # The user's own keys, revoked ones too (their requests stay in the log); any other
        # id is "not one of the available choices". One query.
        self.keys = list(ApiKey.objects.filter(user_id=user_id).order_by("-created_at", "-id"))
        self.fields["key"].choices = [("", "All keys")] + [
            (k.pk, f"{k.name} (rs_{k.prefix}_…){' revoked' if k.revoked_at else ''}")
            for k in self.keys]

    def clean_before(self) -> Cursor | None:
        text = self.cleaned_data["before"].strip()
        if not text:
            return None
        match = _CURSOR.match(text)
        try:
            if match is None:
                raise ValueError(text)
            at = _EPOCH + timedelta(microseconds=int(match[1]))
        except (ValueError, OverflowError):
            raise forms.ValidationError("This page link is not valid: start from the newest "
                                        "requests.") from None
        return at, int(match[2])

    def clean(self):
        data = super().clean()
        since, until = data.get("since"), data.get("until")
        if since and until and since > until:
            self.add_error("until", "The end of the range is before its start.")
        return data

    def filters(self) -> ActivityFilters:
        data = self.cleaned_data
        return ActivityFilters(
            since=datetime.combine(data["since"], time.min, tzinfo=UTC) if data["since"]
            else None,
            until=datetime.combine(data["until"], time.max, tzinfo=UTC) if data["until"]
            else None,
            model=data["model"].strip(), api_key_id=data["key"], status=data["status"])

    def query(self, **extra) -> str:
        """The filters as a query string (for the CSV link and the next page), plus `extra`."""
        query = QueryDict(mutable=True)
        for name in ("since", "until", "model", "key", "status"):
            value = self.data.get(name, "") if self.is_bound else ""
            if value:
                query[name] = value
        for name, value in extra.items():
            if value:
                query[name] = value
        return query.urlencode()
