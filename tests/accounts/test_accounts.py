import pytest
from django.core.cache import cache
from django.core.exceptions import ImproperlyConfigured

from accounts.models import PersonalToken, User
from accounts.secrets import secret_digest, secret_issue, secret_matches, secret_prefix
from config.env import env_bool, env_int

pytestmark = pytest.mark.django_db


def test_signup_logs_in_sends_the_verification_link_and_refuses_duplicates(client, mailoutbox):
    response = client.post("/accounts/signup/", {
        "email": "Dana@Example.com", "password1": "a-long-passphrase-9", "password2":
        "a-long-passphrase-9"}, follow=True)
    assert response.context["user"].email == "dana@example.com"
    assert [m.to for m in mailoutbox] == [["dana@example.com"]]
    assert "/accounts/confirm-email/" in mailoutbox[0].body
    client.logout()
    again = client.post("/accounts/signup/", {
        "email": "dana@example.com", "password1": "another-long-one-7", "password2":
        "another-long-one-7"})
    # Sign-up logs in before the address is verified, so a taken address cannot be hidden.
    assert "already registered" in again.content.decode()
    assert User.objects.count() == 1 and len(mailoutbox) == 1


def test_probing_sign_up_for_taken_addresses_is_slowed_per_client(client):
    """Sign-up says an address is taken (the test above says why): one client can ask a few
    times a minute and a hundred times a day, not the thousands a list of addresses needs."""
    User.objects.create_user("dana@example.com", "a-long-passphrase-9")
    cache.clear()
    probe = {"email": "dana@example.com", "password1": "x-long-passphrase-1",
             "password2": "x-long-passphrase-1"}
    answers = [client.post("/accounts/signup/", probe, REMOTE_ADDR="198.51.100.7").status_code
               for _ in range(11)]
    assert answers[:10] == [200] * 10 and answers[10] == 429
    # Another client is not slowed by it.
    assert client.post("/accounts/signup/", probe, REMOTE_ADDR="198.51.100.8").status_code == 200


def test_signup_form_errors_are_shown(client):
    html = client.post("/accounts/signup/", {"email": "nope", "password1": "x",
                                             "password2": "y"}).content.decode()
    assert "Enter a valid email address" in html
    assert not User.objects.exists()


def test_a_weak_password_is_refused_under_the_password_field(client):
    response = client.post("/accounts/signup/", {"email": "dana@example.com",
                                                 "password1": "short", "password2": "short"})
    form = response.context["form"]
    assert "This password is too short" in " ".join(form.errors["password1"])
    assert "password2" not in form.errors
    # On the page the message sits inside the password field's block, before the confirmation.
    html = response.content.decode()
    assert html.index("This password is too short") < html.index('for="id_password2"')
    assert html.index('for="id_password1"') < html.index("This password is too short")
    assert not User.objects.exists()


def test_a_mismatched_confirmation_is_refused_under_the_confirmation(client):
    form = client.post("/accounts/signup/", {
        "email": "dana@example.com", "password1": "a-long-passphrase-9",
        "password2": "a-long-passphrase-8"}).context["form"]
    assert list(form.errors) == ["password2"]


def test_login_with_email_and_password(client, alice):
    response = client.post("/accounts/login/", {"login": "alice@example.com",
                                                "password": "correct horse battery"})
    assert response.status_code == 302 and client.session["_auth_user_id"] == str(alice.pk)
    client.logout()
    bad = client.post("/accounts/login/", {"login": "alice@example.com",
                                           "password": "wrong"})
    assert "not correct" in bad.content.decode().lower()
    assert "_auth_user_id" not in client.session


def test_personal_tokens_page_shows_a_token_once_and_revokes(client, alice, mallory):
    client.force_login(alice)
    html = client.post("/accounts/tokens/", {"name": "laptop"}).content.decode()
    row = PersonalToken.objects.get(user=alice)
    assert f"rst_{row.prefix}_" in html and 'id="new-token"' in html
    assert 'id="new-token"' not in client.get("/accounts/tokens/").content.decode()
    client.force_login(mallory)
    client.post(f"/accounts/tokens/{row.pk}/revoke/")
    row.refresh_from_db()
    assert row.revoked_at is None
    assert "laptop" not in client.get("/accounts/tokens/").content.decode()
    client.force_login(alice)
    client.post(f"/accounts/tokens/{row.pk}/revoke/")
    row.refresh_from_db()
    assert row.revoked_at is not None


def test_secrets_are_prefix_plus_hmac():
    issued = secret_issue("rse")
    assert issued.token.startswith(f"rse_{issued.prefix}_")
    assert secret_prefix(issued.token, "rse") == issued.prefix
    assert secret_prefix(issued.token, "rsn") is None
    assert secret_prefix("rse_short_x", "rse") is None
    assert issued.digest == secret_digest(issued.token) and issued.token not in issued.digest
    assert secret_matches(issued.token, issued.digest)
    assert not secret_matches(issued.token + "x", issued.digest)


def test_secret_digest_depends_on_the_server_secret(settings):
    issued = secret_issue("rst")
    settings.SECRET_KEY = "another-secret-key-for-this-test-only-0123456789"
    assert not secret_matches(issued.token, issued.digest)


def test_env_helpers_refuse_bad_values(monkeypatch):
    monkeypatch.setenv("X_BOOL", "maybe")
    with pytest.raises(ImproperlyConfigured, match="X_BOOL"):
        env_bool("X_BOOL", False)
    monkeypatch.setenv("X_INT", "ten")
    with pytest.raises(ImproperlyConfigured, match="X_INT"):
        env_int("X_INT", 1)
    monkeypatch.setenv("X_INT", "0")
    with pytest.raises(ImproperlyConfigured, match="at least 1"):
        env_int("X_INT", 1, minimum=1)
    monkeypatch.setenv("X_INT", "12")
    assert env_int("X_INT", 1, minimum=1) == 12


@pytest.mark.parametrize("target, lands", [
    ("https://evil.example/phish", "/"),
    ("//evil.example/", "/"),
    ("/rentals/", "/rentals/"),
])
def test_signup_next_never_leaves_the_site(client, target, lands):
    response = client.post(f"/accounts/signup/?next={target}", {
        "email": "erin@example.com", "password1": "a-long-passphrase-9",
        "password2": "a-long-passphrase-9"})
    assert response.status_code == 302 and response["Location"] == lands


def test_repeated_wrong_passwords_lock_the_login_out_for_a_while(client, alice, bob, settings):
    """30 wrong passwords in a few seconds used to go through. Now allauth refuses the 6th in
    five minutes, and past the limit over a longer while django-axes refuses even the right
    password from that address, while other accounts log in as usual."""
    def wrong():
        return client.post("/accounts/login/", {"login": "alice@example.com", "password": "nope"})

    for _ in range(5):
        assert "not correct" in wrong().content.decode()
    assert "Too many failed login attempts" in wrong().content.decode()
    for _ in range(settings.AXES_FAILURE_LIMIT - 5):
        cache.clear()  # five minutes later: allauth lets the address try again
        wrong()
    cache.clear()
    for _ in range(4):
        locked = wrong()
        assert locked.status_code == 429
    cache.clear()  # allauth would let the address try again; axes still refuses it
    right = client.post("/accounts/login/", {"login": "alice@example.com",
                                             "password": "correct horse battery"})
    assert right.status_code == 429 and 'id="locked-out"' in right.content.decode()
    assert "_auth_user_id" not in client.session
    other = client.post("/accounts/login/", {"login": "bob@example.com",
                                             "password": "correct horse battery"})
    assert other.status_code == 302
