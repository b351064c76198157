"""Accounts that move money: verified email, two-factor, password reset and change, the
sessions and tokens that a change of proof closes, and the security emails. mallory tries every
door she can find."""

import re

import pytest
from allauth.account.models import EmailAddress
from allauth.mfa.models import Authenticator
from allauth.usersessions.models import UserSession
from django.core.cache import cache
from django.test import Client
from rest_framework.test import APIClient

from accounts.models import LoginDevice, PersonalToken
from accounts.services import personal_token_create
from billing import keys, services
from billing.models import ApiKey, Payout, PayoutDestination
from tests.factories import UserFactory, enable_two_factor, totp_code

pytestmark = pytest.mark.django_db

PASSWORD = "correct horse battery"
USD = 1_000_000


def log_in(client, email, password=PASSWORD, secret=None, user_agent="Firefox"):
    """Log in through allauth's form, answering the second step with a code when asked.
    The response of the last step."""
    headers = {"user-agent": user_agent}
    response = client.post("/accounts/login/", {"login": email, "password": password},
                           headers=headers)
    if response.status_code == 302 and response["Location"].startswith(
            "/accounts/2fa/authenticate/"):
        assert "_auth_user_id" not in client.session  # not logged in before the code
        response = client.post("/accounts/2fa/authenticate/", {"code": totp_code(secret)},
                               headers=headers)
    return response


def link_in(message, path_prefix: str) -> str:
    match = re.search(rf"https?://[^/\s]+({re.escape(path_prefix)}\S+)", message.body)
    assert match, f"no {path_prefix} link in: {message.body}"
    return match.group(1)


def turn_on_two_factor(client, password=PASSWORD) -> str:
    """Through allauth's pages, as a user does (it asks the password again first): the secret
    the page showed."""
    page = client.get("/accounts/2fa/totp/activate/")
    if page.status_code == 302 and page["Location"].startswith("/accounts/reauthenticate/"):
        assert client.post(page["Location"], {"password": password}).status_code == 302
        page = client.get("/accounts/2fa/totp/activate/")
    assert page.status_code == 200, page
    secret = page.context["form"].secret
    response = client.post("/accounts/2fa/totp/activate/", {"code": totp_code(secret)})
    assert response.status_code == 302, response.content.decode()[:2000]
    return secret


def earn(provider, payer, amount_micros):
    services.credits_grant(user=payer, amount_micros=amount_micros, idempotency_key=f"g{payer.pk}")
    services.time_charge(payer_id=payer.pk, provider_id=provider.pk, amount_micros=amount_micros,
                         idempotency_key=f"t{provider.pk}", reference="rental:1")


# --- email verification ---

def test_the_signup_link_verifies_the_address_and_only_a_post_does(client, mailoutbox):
    client.post("/accounts/signup/", {"email": "dana@example.com",
                                      "password1": "a-long-passphrase-9",
                                      "password2": "a-long-passphrase-9"})
    address = EmailAddress.objects.get(email="dana@example.com")
    assert address.primary and not address.verified
    link = link_in(mailoutbox[0], "/accounts/confirm-email/")
    assert client.get(link).status_code == 200  # a page with a button: a mail scanner's GET
    address.refresh_from_db()
    assert not address.verified
    assert client.post(link).status_code == 302
    address.refresh_from_db()
    assert address.verified


def test_mallory_cannot_verify_an_address_that_is_not_hers(client, mallory, alice, mailoutbox):
    log_in(client, mallory.email)
    # Adding an address someone holds answers as for any address (the page tells no one who
    # has an account); the link goes to its holder, and even their click cannot verify it for
    # mallory: an address is verified on one account only.
    client.post("/accounts/email/", {"action_add": "", "email": alice.email})
    assert mailoutbox[-1].to == [alice.email]
    Client().post(link_in(mailoutbox[-1], "/accounts/confirm-email/"))
    assert not EmailAddress.objects.filter(user=mallory, email=alice.email,
                                           verified=True).exists()
    assert EmailAddress.objects.get(user=alice, email=alice.email).verified
    # A free address can be added, but its link goes to that address, not to mallory.
    client.post("/accounts/email/", {"action_add": "", "email": "dana@example.com"})
    added = EmailAddress.objects.get(user=mallory, email="dana@example.com")
    assert mailoutbox[-1].to == ["dana@example.com"]
    # A guessed key, or mallory's own address's key shape, verifies nothing.
    for key in ["x" * 64, "MQ:1tZ0aa:" + "a" * 43]:
        assert client.post(f"/accounts/confirm-email/{key}/").status_code in (302, 404)
    added.refresh_from_db()
    assert not added.verified


# --- what needs a verified email and two-factor ---

@pytest.mark.parametrize("verified, two_factor, allowed", [
    (False, False, False), (False, True, False), (True, False, False), (True, True, True)])
def test_payouts_need_a_verified_email_and_two_factor(
        client, carol, settings, verified, two_factor, allowed, mailoutbox,
        django_capture_on_commit_callbacks):
    settings.RIGSHARE_MIN_PAYOUT_MICROS = USD
    dana = UserFactory(email="dana@example.com", verified=verified, two_factor=two_factor)
    earn(dana, carol, 10 * USD)
    client.force_login(dana)
    with django_capture_on_commit_callbacks(execute=True):
        destination = client.post("/billing/payouts/destination/", {
            "method": "paypal", "holder_name": "Dana", "paypal_email": "dana@example.com"})
    assert PayoutDestination.objects.filter(provider=dana).exists() is allowed
    if not allowed:  # sent to Account settings, told what is missing
        assert destination["Location"] == "/accounts/"
        page = client.get("/billing/payouts/").content.decode()
        assert 'id="payout-needs"' in page
        PayoutDestination.objects.create(provider=dana, method="paypal", holder_name="Dana",
                                         paypal_email="dana@example.com")
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post("/billing/payouts/", {"amount": "5"})
    assert Payout.objects.filter(provider=dana).exists() is allowed
    if not allowed:
        missing = "Verify your email" if not verified else "Turn on two-factor"
        assert missing in response.content.decode()
    else:
        assert [m.subject for m in mailoutbox if "Payout" in m.subject] == [
            "[Rigshare] Payout destination changed", "[Rigshare] Payout requested: $5.00"]


def test_a_key_without_a_spend_limit_needs_two_factor_on_the_page_and_in_the_api(
        client, mallory, carol, mailoutbox, django_capture_on_commit_callbacks):
    client.force_login(mallory)
    page = client.post("/billing/keys/", {"name": "all of it", "spend_period": "monthly"})
    assert "Turn on two-factor" in page.content.decode()
    limited = client.post("/billing/keys/", {"name": "capped", "spend_limit": "5",
                                             "spend_period": "monthly"})
    assert limited.status_code == 200 and ApiKey.objects.filter(user=mallory).count() == 1
    key = ApiKey.objects.get(user=mallory)
    # Nor may a capped key lose its cap.
    edit = client.post(f"/billing/keys/{key.pk}/", {"name": "capped", "spend_period":
                                                          "monthly"})
    assert "Turn on two-factor" in edit.content.decode()
    key.refresh_from_db()
    assert key.spend_limit_micros == 5 * USD

    api = APIClient()
    api.force_authenticate(mallory)
    refused = api.post("/api/keys/", {"name": "no cap"}, format="json")
    assert refused.status_code == 403 and "two-factor" in refused.json()["detail"]
    refused = api.patch(f"/api/keys/{key.pk}/", {"spend_limit_usd": None}, format="json")
    assert refused.status_code == 403
    assert ApiKey.objects.filter(user=mallory).count() == 1

    api.force_authenticate(carol)
    with django_capture_on_commit_callbacks(execute=True):
        made = api.post("/api/keys/", {"name": "no cap"}, format="json")
    assert made.status_code == 201
    assert mailoutbox[-1].to == [carol.email] and "no spend limit" in mailoutbox[-1].body


def test_a_key_that_may_spend_a_lot_needs_two_factor_as_one_without_a_limit(client, mallory,
                                                                             carol, settings):
    """A stolen session cannot sidestep the rule with a huge limit: past
    RIGSHARE_KEY_SPEND_WITHOUT_2FA_MICROS a month ($100 here; a daily limit counts 31 times, a
    weekly one 5), a key needs what a key without a limit needs."""
    settings.RIGSHARE_KEY_SPEND_WITHOUT_2FA_MICROS = 100 * USD
    client.force_login(mallory)
    for limit, period in (("1000000", "monthly"), ("4", "daily"), ("25", "weekly")):
        page = client.post("/billing/keys/", {"name": "big", "spend_limit": limit,
                                              "spend_period": period})
        assert "Turn on two-factor" in page.content.decode(), (limit, period)
        assert "more than $100.00 a month" in page.content.decode()
    assert not ApiKey.objects.filter(user=mallory).exists()
    for limit, period in (("100", "monthly"), ("3", "daily"), ("20", "weekly")):
        client.post("/billing/keys/", {"name": f"small {period}", "spend_limit": limit,
                                       "spend_period": period})
    assert ApiKey.objects.filter(user=mallory).count() == 3
    # Nor may a small key be raised past it, by its limit or by its period; lowered, it may.
    key = ApiKey.objects.get(user=mallory, name="small monthly")
    for limit, period in (("101", "monthly"), ("100", "daily")):
        edit = client.post(f"/billing/keys/{key.pk}/", {"name": "small monthly",
                                                        "spend_limit": limit,
                                                        "spend_period": period})
        assert "Turn on two-factor" in edit.content.decode()
    client.post(f"/billing/keys/{key.pk}/", {"name": "small monthly", "spend_limit": "50",
                                             "spend_period": "monthly"})
    key.refresh_from_db()
    assert (key.spend_limit_micros, key.spend_period) == (50 * USD, "monthly")
    api = APIClient()
    api.force_authenticate(mallory)
    refused = api.post("/api/keys/", {"name": "big", "spend_limit_usd": "1000000"},
                       format="json")
    assert refused.status_code == 403 and "two-factor" in refused.json()["detail"]
    # With two-factor on, any limit.
    api.force_authenticate(carol)
    assert api.post("/api/keys/", {"name": "big", "spend_limit_usd": "1000000"},
                    format="json").status_code == 201


# --- a recent proof before money, secrets or addresses move ---

GUARDED = [  # (what, path, what it posts)
    ("an API key", "/billing/keys/", {"name": "k", "spend_limit": "5",
                                      "spend_period": "monthly"}),
    ("a key's limits", "/billing/keys/{key}/", {"name": "k", "spend_limit": "9",
                                                "spend_period": "monthly"}),
    ("a payout", "/billing/payouts/", {"amount": "10"}),
    ("where payouts go", "/billing/payouts/destination/",
     {"method": "paypal", "holder_name": "Bob", "paypal_email": "thief@example.com"}),
    ("a REST token", "/accounts/tokens/", {"name": "script"}),
    # (alice: allauth adds no address to an account with two-factor on)
    ("an email address", "/accounts/email/", {"action_add": "", "email": "new@example.com"}),
    ("closing the account", "/accounts/close/", {"confirm_email": "bob@example.com",
                                                   "give_up_credit": "on"}),
]


@pytest.mark.reauth
@pytest.mark.parametrize("what, path, data", GUARDED, ids=[g[0] for g in GUARDED])
def test_a_session_alone_moves_no_money_secret_or_address(client, bob, alice, what, path,
                                                          data):
    """A session whose last proof is older than ACCOUNT_REAUTHENTICATION_TIMEOUT (a stolen
    cookie) is asked for the password again before anything of these moves; the page itself
    still opens."""
    user = alice if what == "an email address" else bob
    key, _ = keys.api_key_create(user=user, name="k", spend_limit_micros=USD)
    path = path.format(key=key.pk)
    log_in(client, user.email, secret=getattr(user, "totp_secret", None))
    before = (ApiKey.objects.count(), Payout.objects.count(), PersonalToken.objects.count(),
              EmailAddress.objects.count(), PayoutDestination.objects.count())
    assert client.get(path).status_code == 200
    asked = client.post(path, data)
    assert asked.status_code == 302 and asked["Location"].startswith(
        "/accounts/reauthenticate/"), (what, asked.status_code, asked.get("Location"))
    assert (ApiKey.objects.count(), Payout.objects.count(), PersonalToken.objects.count(),
            EmailAddress.objects.count(), PayoutDestination.objects.count()) == before
    key.refresh_from_db()
    assert key.spend_limit_micros == USD
    user.refresh_from_db()
    assert user.is_active


@pytest.mark.reauth
def test_the_password_given_again_lets_the_asked_request_through_once(client, carol):
    log_in(client, carol.email, secret=carol.totp_secret)
    asked = client.post("/billing/keys/", {"name": "ci", "spend_limit": "5",
                                           "spend_period": "monthly"})
    assert asked["Location"] == "/accounts/reauthenticate/?next=%2Fbilling%2Fkeys%2F"
    assert not ApiKey.objects.filter(user=carol).exists()
    wrong = client.post(asked["Location"], {"password": "not it"})
    assert wrong.status_code == 200 and not ApiKey.objects.filter(user=carol).exists()
    done = client.post(asked["Location"], {"password": PASSWORD})
    # The request that was asked for is replayed: the key exists, its secret on the page.
    (row,) = ApiKey.objects.filter(user=carol)
    assert row.name == "ci" and f"rs_{row.prefix}_" in done.content.decode()
    # Proven a moment ago: the next one goes through at once.
    client.post("/billing/keys/", {"name": "ci 2", "spend_limit": "5", "spend_period": "monthly"})
    assert ApiKey.objects.filter(user=carol).count() == 2


@pytest.mark.reauth
def test_the_rest_api_asks_a_session_for_a_recent_proof_and_a_token_for_nothing(client, carol):
    log_in(client, carol.email, secret=carol.totp_secret)
    refused = client.post("/api/keys/", {"name": "k", "spend_limit_usd": "5"},
                          content_type="application/json")
    assert refused.status_code == 403 and "re-authenticate" in refused.json()["detail"]
    key, _ = keys.api_key_create(user=carol, name="old", spend_limit_micros=USD)
    refused = client.patch(f"/api/keys/{key.pk}/", {"spend_limit_usd": "50"},
                           content_type="application/json")
    assert refused.status_code == 403
    # Revoking never needs it; the REST token proves its holder.
    assert client.post(f"/api/keys/{key.pk}/revoke/").status_code == 200
    _, token = personal_token_create(user=carol, name="script")
    rest = APIClient()
    rest.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert rest.post("/api/keys/", {"name": "k", "spend_limit_usd": "5"},
                     format="json").status_code == 201


# --- two-factor log-in ---

def test_with_two_factor_the_password_alone_logs_nobody_in(client, bob):
    response = client.post("/accounts/login/", {"login": bob.email, "password": PASSWORD})
    assert response["Location"].startswith("/accounts/2fa/authenticate/")
    assert "_auth_user_id" not in client.session
    # Nothing behind the log-in opens in the half-logged-in state.
    for url in ["/billing/payouts/", "/accounts/", "/accounts/tokens/", "/api/keys/"]:
        assert client.get(url).status_code in (302, 401, 403), url
    assert client.post("/accounts/2fa/authenticate/", {"code": "000000"}).status_code == 200
    assert "_auth_user_id" not in client.session
    assert client.post("/accounts/2fa/authenticate/",
                       {"code": totp_code(bob.totp_secret)}).status_code == 302
    assert client.session["_auth_user_id"] == str(bob.pk)


def test_wrong_codes_are_limited_so_a_code_cannot_be_guessed(client, bob):
    client.post("/accounts/login/", {"login": bob.email, "password": PASSWORD})
    for _ in range(5):
        assert "Incorrect code" in client.post("/accounts/2fa/authenticate/",
                                               {"code": "000000"}).content.decode()
    refused = client.post("/accounts/2fa/authenticate/", {"code": totp_code(bob.totp_secret)})
    assert "Too many failed login attempts" in refused.content.decode()
    assert "_auth_user_id" not in client.session


def test_a_recovery_code_logs_in_once(client, bob):
    from allauth.mfa.recovery_codes.internal.auth import RecoveryCodes

    codes = RecoveryCodes(Authenticator.objects.get(
        user=bob, type=Authenticator.Type.RECOVERY_CODES)).get_unused_codes()
    client.post("/accounts/login/", {"login": bob.email, "password": PASSWORD})
    assert client.post("/accounts/2fa/authenticate/", {"code": codes[0]}).status_code == 302
    client.logout()
    client.post("/accounts/login/", {"login": bob.email, "password": PASSWORD})
    assert client.post("/accounts/2fa/authenticate/", {"code": codes[0]}).status_code == 200
    assert "_auth_user_id" not in client.session


def test_the_django_admin_log_in_form_is_never_a_way_around_the_code(client, bob):
    bob.is_staff = bob.is_superuser = True
    bob.save()
    # The admin's own log-in sends to the site's log-in (which asks the code).
    response = client.get("/admin/login/?next=/admin/")
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")
    response = client.post("/admin/login/", {"username": bob.email, "password": PASSWORD})
    assert response.status_code == 302 and "_auth_user_id" not in client.session


def test_staff_need_two_factor_for_the_admin_and_the_pool_page(client):
    ops = UserFactory(email="ops@example.com", is_staff=True, is_superuser=True)
    client.force_login(ops)
    for url in ["/admin/", "/admin/billing/payout/", "/staff/pool/"]:
        response = client.get(url, follow=True)
        # to turn it on (allauth asks the password again before it adds a second factor)
        assert response.redirect_chain[-1][0] in (
            "/accounts/2fa/totp/activate/",
            "/accounts/reauthenticate/?next=%2Faccounts%2F2fa%2Ftotp%2Factivate%2F"), url
    enable_two_factor(ops)
    assert client.get("/admin/").status_code == 200
    assert client.get("/staff/pool/").status_code == 200
    client.force_login(UserFactory(two_factor=True))  # not staff: two-factor is not enough
    assert client.get("/admin/", follow=True).status_code == 403
    assert client.get("/staff/pool/").status_code == 302


# --- what a change of proofs closes ---

@pytest.mark.django_db(transaction=True)  # allauth acts on commit, inside the request
def test_turning_two_factor_on_revokes_older_tokens_and_ends_other_sessions(alice, mailoutbox):
    laptop, phone = Client(), Client()
    log_in(laptop, alice.email)
    log_in(phone, alice.email)
    _, old_token = personal_token_create(user=alice, name="script")
    rest = APIClient()
    rest.credentials(HTTP_AUTHORIZATION=f"Bearer {old_token}")
    assert rest.get("/api/keys/").status_code == 200
    secret = turn_on_two_factor(laptop)
    assert Authenticator.objects.filter(user=alice, type="totp").exists()
    assert rest.get("/api/keys/").status_code == 401  # the token from before is dead
    assert phone.get("/accounts/").status_code == 302  # the other session is over
    assert laptop.get("/accounts/").status_code == 200  # the one that proved the code stays
    assert "Two-factor authentication was turned on" in mailoutbox[-1].body
    # A token made now, by the session that passed the second factor, works.
    _, new_token = personal_token_create(user=alice, name="script 2")
    rest.credentials(HTTP_AUTHORIZATION=f"Bearer {new_token}")
    assert rest.get("/api/keys/").status_code == 200
    # And a new log-in needs the code.
    cache.clear()
    fresh = Client()
    assert log_in(fresh, alice.email, secret=secret).status_code == 302
    assert fresh.session["_auth_user_id"] == str(alice.pk)


def test_a_password_change_ends_other_sessions_and_tokens_and_tells_the_holder(
        alice, mailoutbox):
    laptop, phone = Client(), Client()
    log_in(laptop, alice.email)
    log_in(phone, alice.email)
    token = PersonalToken.objects.get(pk=personal_token_create(user=alice, name="ci")[0].pk)
    response = laptop.post("/accounts/password/change/", {
        "oldpassword": PASSWORD, "password1": "a-new-long-passphrase-3",
        "password2": "a-new-long-passphrase-3"})
    assert response.status_code == 302
    assert laptop.get("/accounts/").status_code == 200
    assert phone.get("/accounts/").status_code == 302
    token.refresh_from_db()
    assert token.revoked_at is not None
    changed = [m for m in mailoutbox if "Password" in m.subject]
    assert changed and "REST API tokens were revoked" in changed[-1].body
    assert UserSession.objects.filter(user=alice).count() == 1


def test_password_reset_by_email_and_its_link_works_once(client, alice, mailoutbox):
    other = Client()
    log_in(other, alice.email)
    client.post("/accounts/password/reset/", {"email": alice.email})
    link = link_in(mailoutbox[-1], "/accounts/password/reset/key/")
    form = client.get(link, follow=True)
    set_url = form.redirect_chain[-1][0] if form.redirect_chain else link
    done = client.post(set_url, {"password1": "a-brand-new-pass-77",
                                 "password2": "a-brand-new-pass-77"})
    assert done.status_code == 302
    assert "_auth_user_id" not in client.session  # a reset never logs in
    assert other.get("/accounts/").status_code == 302  # every session ended
    # The link is spent: mallory finding it later changes nothing.
    again = Client().get(link, follow=True)
    assert "a-brand-new-pass-77" not in again.content.decode()
    assert again.context.get("token_fail") or "invalid" in again.content.decode().lower()
    mallory = Client()
    again = mallory.post(set_url, {"password1": "mallorys-password-1",
                                   "password2": "mallorys-password-1"})
    alice.refresh_from_db()
    assert alice.check_password("a-brand-new-pass-77")
    assert log_in(Client(), alice.email, "a-brand-new-pass-77").status_code == 302


@pytest.mark.django_db(transaction=True)  # allauth mails on commit
@pytest.mark.parametrize("revoke", [False, True])
def test_a_reset_offers_to_revoke_the_api_keys_and_its_email_names_them(client, alice, carol,
                                                                       mailoutbox, revoke):
    """API keys survive a password reset. The reset's page offers to revoke them all, and the
    email about the reset names those still working."""
    laptop, _ = keys.api_key_create(user=alice, name="laptop", spend_limit_micros=USD)
    ci, ci_token = keys.api_key_create(user=alice, name="ci", spend_limit_micros=USD)
    carols, carols_token = keys.api_key_create(user=carol, name="carol's", spend_limit_micros=USD)
    assert keys.api_key_authenticate(ci_token) is not None  # cached, as in use
    client.post("/accounts/password/reset/", {"email": alice.email})
    link = link_in(mailoutbox[-1], "/accounts/password/reset/key/")
    form = client.get(link, follow=True)
    page = form.content.decode()
    assert "Also revoke all my API keys (2: laptop (rs_" in page and "carol" not in page
    set_url = form.redirect_chain[-1][0] if form.redirect_chain else link
    data = {"password1": "a-brand-new-pass-77", "password2": "a-brand-new-pass-77"}
    done = client.post(set_url, data | ({"revoke_keys": "on"} if revoke else {}))
    assert done.status_code == 302
    active = ApiKey.objects.filter(user=alice, revoked_at__isnull=True)
    assert active.count() == (0 if revoke else 2)
    assert (keys.api_key_authenticate(ci_token) is None) is revoke  # its cached copy too
    assert keys.api_key_authenticate(carols_token) is not None  # nobody else's
    (mail,) = [m for m in mailoutbox if "reset" in m.body and "Your password was reset" in m.body]
    if revoke:
        assert "no active /v1 API key" in mail.body
    else:
        assert f"- laptop (rs_{laptop.prefix}_…)" in mail.body
        assert f"- ci (rs_{ci.prefix}_…)" in mail.body


def test_a_reset_of_a_two_factor_account_still_asks_the_code(client, bob, mailoutbox):
    client.post("/accounts/password/reset/", {"email": bob.email})
    link = link_in(mailoutbox[-1], "/accounts/password/reset/key/")
    set_url = client.get(link, follow=True).redirect_chain[-1][0]
    client.post(set_url, {"password1": "a-brand-new-pass-77", "password2": "a-brand-new-pass-77"})
    response = client.post("/accounts/login/", {"login": bob.email,
                                                "password": "a-brand-new-pass-77"})
    assert response["Location"].startswith("/accounts/2fa/authenticate/")
    assert "_auth_user_id" not in client.session


# --- security emails, sessions ---

def test_a_log_in_from_a_new_browser_is_emailed_once(alice, mailoutbox):
    home = Client()
    log_in(home, alice.email, user_agent="Firefox at home")
    assert not mailoutbox  # the first browser the account uses is not news
    assert LoginDevice.objects.filter(user=alice).count() == 1
    home.post("/accounts/logout/")  # (the test client's logout() would drop every cookie)
    assert "_auth_user_id" not in home.session
    log_in(home, alice.email, user_agent="Firefox at home")
    assert not mailoutbox  # the cookie says it knows this browser
    log_in(Client(), alice.email, user_agent="Chrome somewhere else")
    assert [m.subject for m in mailoutbox] == ["[Rigshare] New log-in to your account"]
    assert "Chrome somewhere else" in mailoutbox[0].body
    # A forged cookie is a browser nobody knows.
    forged = Client()
    forged.cookies["rs_device"] = "not-signed"
    log_in(forged, alice.email)
    assert len(mailoutbox) == 2


def test_log_out_everywhere_ends_every_session_and_optionally_the_tokens(alice):
    laptop, phone = Client(), Client()
    log_in(laptop, alice.email)
    log_in(phone, alice.email)
    _, token = personal_token_create(user=alice, name="ci")
    assert "2 active" in laptop.get("/accounts/").content.decode()
    assert phone.post("/accounts/logout-everywhere/", {"revoke_tokens": "on"}).status_code == 302
    assert laptop.get("/accounts/").status_code == 302
    assert phone.get("/accounts/").status_code == 302
    assert not UserSession.objects.filter(user=alice).exists()
    rest = APIClient()
    rest.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert rest.get("/api/keys/").status_code == 401


def test_the_sessions_page_lists_this_accounts_sessions_only(alice, mallory):
    mine, hers = Client(), Client()
    log_in(mine, alice.email, user_agent="Alice's browser")
    log_in(hers, mallory.email, user_agent="Mallory's browser")
    page = mine.get("/accounts/sessions/").content.decode()
    assert "Alice" in page and "Mallory" not in page


def test_settings_pages_are_for_their_holder_only(client):
    for url in ["/accounts/", "/accounts/email/", "/accounts/password/change/",
                "/accounts/2fa/", "/accounts/sessions/", "/accounts/data.json",
                "/accounts/close/", "/accounts/tokens/"]:
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith(
            "/accounts/login/"), url
    assert client.post("/accounts/logout-everywhere/").status_code == 302


def test_the_settings_page_says_what_is_missing(client):
    dana = UserFactory(verified=False)
    client.force_login(dana)
    html = client.get("/accounts/").content.decode()
    assert "not verified" in html and "<strong>off</strong>" in html
    client.force_login(UserFactory(two_factor=True))
    html = client.get("/accounts/").content.decode()
    assert 'id="email-status">verified' in html and "on (authenticator app, recovery codes)" in html


def test_keys_and_tokens_are_emailed_when_made(client, carol, mailoutbox,
                                                django_capture_on_commit_callbacks):
    client.force_login(carol)
    with django_capture_on_commit_callbacks(execute=True):
        client.post("/accounts/tokens/", {"name": "laptop"})
        keys.api_key_create(user=carol, name="capped", spend_limit_micros=3 * USD)
    subjects = [m.subject for m in mailoutbox]
    assert subjects == ["[Rigshare] New REST API token: laptop", "[Rigshare] New API key: capped"]
    assert "$3.00" in mailoutbox[1].body


@pytest.mark.django_db(transaction=True)  # allauth acts on commit, inside the request
def test_sessions_the_list_never_saw_end_too(alice):
    """A session from before sessions were listed (or made without the log-in form) is not on
    the sessions page; "log out everywhere" and turning two-factor on end it all the same."""
    old = Client()
    old.force_login(alice)
    assert not UserSession.objects.filter(user=alice).exists()
    me = Client()
    log_in(me, alice.email)
    turn_on_two_factor(me)
    assert old.get("/accounts/").status_code == 302
    assert me.get("/accounts/").status_code == 200
    old.force_login(alice)
    me.post("/accounts/logout-everywhere/")
    assert old.get("/accounts/").status_code == 302
    assert me.get("/accounts/").status_code == 302
