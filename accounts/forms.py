from allauth.account import forms as allauth_forms
from django import forms


class SignUpForm(allauth_forms.SignupForm):
    """allauth's sign-up, in the site's words."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["email"].label = "Email address"
        self.fields["password2"].label = "Password confirmation"
        for field in self.fields.values():
            field.widget.attrs.pop("placeholder", None)  # the labels say it


class LoginForm(allauth_forms.LoginForm):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["login"].label = "Email address"
        for field in self.fields.values():
            field.widget.attrs.pop("placeholder", None)


class PersonalTokenForm(forms.Form):
    name = forms.CharField(max_length=100)


class ResetPasswordKeyForm(allauth_forms.ResetPasswordKeyForm):
    """allauth's new-password form of a reset link, offering to revoke the account's /v1 API
    keys too: they survive a password change, and a reset is often what follows a takeover."""

    revoke_keys = forms.BooleanField(
        required=False, label="Also revoke all my API keys",
        help_text="Do this if someone else may have used your account: every /v1 API key stops "
                  "working at once, and you make new ones under Billing > API keys.")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from billing.keys import api_keys_active
        active = api_keys_active(self.user) if self.user is not None else []
        if not active:
            del self.fields["revoke_keys"]
        else:
            self.fields["revoke_keys"].label = (
                f"Also revoke all my API keys ({len(active)}: {', '.join(active)})")

    def save(self) -> None:
        from billing.keys import api_keys_revoke_all
        if self.cleaned_data.get("revoke_keys"):
            api_keys_revoke_all(user=self.user)
        super().save()  # the email it sends names the keys still active
