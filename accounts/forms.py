from django import forms
from django.contrib.auth.forms import AuthenticationForm, UserCreationForm

from accounts.models import User


class SignUpForm(UserCreationForm):
    class Meta:
        model = User
        fields = ("email",)

    def validate_password_for_user(self, user, **kwargs):
        # Django attaches a too-short or too-common password's errors to the confirmation
        # field; they are about the password itself, so they show under it.
        super().validate_password_for_user(user, password_field_name="password1")

    def clean_email(self):
        email = self.cleaned_data["email"].lower()
        if User.objects.filter(email=email).exists():
            raise forms.ValidationError("An account with this email already exists.")
        return email


class LoginForm(AuthenticationForm):
    username = forms.EmailField(label="Email", widget=forms.EmailInput(attrs={"autofocus": True}))


class PersonalTokenForm(forms.Form):
    name = forms.CharField(max_length=100)
