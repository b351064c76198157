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
