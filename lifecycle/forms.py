from django import forms


class CloseAccountForm(forms.Form):
    confirm_email = forms.EmailField(
        label="Type your email address to confirm",
        widget=forms.EmailInput(attrs={"autocomplete": "off"}))
    give_up_credit = forms.BooleanField(
        required=False, label="I give up the credit left in my account")

    def __init__(self, *args, user, credit_micros: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.user = user
        if credit_micros <= 0:
            del self.fields["give_up_credit"]

    def clean_confirm_email(self):
        value = self.cleaned_data["confirm_email"].strip().lower()
        if value != self.user.email.lower():
            raise forms.ValidationError("This is not your account's email address.")
        return value

    def clean(self):
        data = super().clean()
        data.setdefault("give_up_credit", False)
        return data
