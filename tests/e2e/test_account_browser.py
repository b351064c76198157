"""An account's life in Chromium: sign up, verify the address from the email, turn on
two-factor (the code computed here with pyotp, as an authenticator app would), log out, log in
with the code, reset a forgotten password, and request a payout behind the second factor.

The live server runs in this process, so the emails land in Django's locmem outbox."""

from __future__ import annotations

import re
import time

import pyotp
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

EMAIL = "dana@example.com"
PASSWORD = "correct horse battery staple"
NEW_PASSWORD = "a different long passphrase"
USD = 1_000_000


def link_in(message, path: str) -> str:
    match = re.search(rf"https?://[^/\s]+({re.escape(path)}\S+)", message.body)
    assert match, message.body
    return match.group(1)


def fresh_code(secret: str, used: set[str]) -> str:
    """The authenticator's current code, waiting for the next one when this one was used
    (a code logs in once)."""
    totp = pyotp.TOTP(secret)
    while (code := totp.now()) in used:
        time.sleep(1)
    used.add(code)
    return code


@pytest.mark.reauth  # the password asked again, as a real session has it asked
def test_an_account_from_sign_up_to_a_payout_behind_two_factor(
        page, live_server, mailoutbox, screenshot_dir, settings, carol):
    from playwright.sync_api import expect

    from billing import services
    from billing.models import Payout

    settings.RIGSHARE_MIN_PAYOUT_MICROS = USD
    main = page.locator("main")

    # 1. Sign up: logged in at once, the verification link on its way.
    page.goto("/accounts/signup/")
    page.get_by_label("Email address").fill(EMAIL)
    page.get_by_label("Password:", exact=True).fill(PASSWORD)
    page.get_by_label("Password confirmation").fill(PASSWORD)
    main.get_by_role("button", name="Sign up").click()
    expect(page.locator("header .who")).to_have_text(EMAIL)
    assert mailoutbox[-1].to == [EMAIL]
    page.goto("/accounts/")
    expect(page.locator("#email-status")).to_contain_text("not verified")

    # 2. Verify: the link opens a page whose button confirms.
    page.goto(link_in(mailoutbox[-1], "/accounts/confirm-email/"))
    main.get_by_role("button", name="Confirm").click()
    page.goto("/accounts/")
    expect(page.locator("#email-status")).to_have_text("verified")
    expect(page.locator("#mfa-status")).to_contain_text("off")

    # A payout is refused until two-factor is on.
    page.goto("/billing/payouts/")
    expect(page.locator("#payout-needs")).to_contain_text("Turn on two-factor")

    # 3. Turn on two-factor: the password again, then the app's code.
    page.goto("/accounts/")
    page.locator("#mfa-status").get_by_role("link", name="turn it on").click()
    page.get_by_label("Password").fill(PASSWORD)
    main.get_by_role("button", name="Confirm").click()
    expect(page.get_by_role("heading", name="Activate Authenticator App")).to_be_visible()
    page.screenshot(path=screenshot_dir / "two-factor-activate.png", full_page=True)
    secret = page.locator("#authenticator_secret").input_value()
    used: set[str] = set()
    page.get_by_label("Authenticator code").fill(fresh_code(secret, used))
    main.get_by_role("button", name="Activate").click()
    expect(page.get_by_role("heading", name="Recovery Codes")).to_be_visible()
    assert any("Two-factor authentication was turned on" in m.body for m in mailoutbox)

    # 4. Log out; the password alone no longer logs in: the code does.
    page.locator("header").get_by_role("button", name="Log out").click()
    page.goto("/accounts/login/")
    page.get_by_label("Email address").fill(EMAIL)
    page.get_by_label("Password").fill(PASSWORD)
    main.get_by_role("button", name="Log in").click()
    expect(page.locator("header .who")).to_have_count(0)
    page.screenshot(path=screenshot_dir / "two-factor-login.png", full_page=True)
    page.get_by_label("Code", exact=True).fill(fresh_code(secret, used))
    main.get_by_role("button", name="Log in").click()
    expect(page.locator("header .who")).to_have_text(EMAIL)

    # 5. Forgot the password: reset it by email, then log in with the new one and the code.
    page.locator("header").get_by_role("button", name="Log out").click()
    page.goto("/accounts/login/")
    main.get_by_role("link", name="Forgot your password?").click()
    page.get_by_label("Email").fill(EMAIL)
    main.get_by_role("button", name="Reset My Password").click()
    reset_link = link_in(mailoutbox[-1], "/accounts/password/reset/key/")
    page.goto(reset_link)
    page.get_by_label("New Password:", exact=True).fill(NEW_PASSWORD)
    page.get_by_label("New Password (again):").fill(NEW_PASSWORD)
    main.get_by_role("button", name="Change Password").click()
    expect(page.locator("header .who")).to_have_count(0)  # a reset never logs in
    page.goto(reset_link)  # the link works once
    expect(main).to_contain_text("invalid")
    page.goto("/accounts/login/")
    page.get_by_label("Email address").fill(EMAIL)
    page.get_by_label("Password").fill(NEW_PASSWORD)
    main.get_by_role("button", name="Log in").click()
    page.get_by_label("Code", exact=True).fill(fresh_code(secret, used))
    main.get_by_role("button", name="Log in").click()
    expect(page.locator("header .who")).to_have_text(EMAIL)

    # 6. Paid behind the second factor: earnings from carol's rental of dana's card.
    from accounts.models import User

    dana = User.objects.get(email=EMAIL)
    services.credits_grant(user=carol, amount_micros=20 * USD, idempotency_key="e2e:grant")
    services.time_charge(payer_id=carol.pk, provider_id=dana.pk, amount_micros=20 * USD,
                         idempotency_key="e2e:rental", reference="rental:1")
    page.goto("/billing/payouts/destination/")
    page.get_by_label("PayPal", exact=True).check()
    page.get_by_label("Account holder's name").fill("Dana Example")
    page.get_by_label("PayPal address").fill("dana@example.com")
    main.get_by_role("button", name="Save").click()
    # Where money goes: the password again first (a session alone is not enough), and the
    # form sent before it is taken as it was.
    expect(page).to_have_url(re.compile(r"/accounts/reauthenticate/"))
    page.get_by_label("Password").fill(NEW_PASSWORD)
    main.get_by_role("button", name="Confirm").click()
    expect(page.get_by_role("status").filter(has_text="Payouts will go by")).to_be_visible()
    page.get_by_label("Amount (USD)").fill("10")
    main.get_by_role("button", name="Request payout").click()
    expect(page.get_by_role("status").filter(has_text="Payout of $10.00 requested")).to_be_visible()
    payout = Payout.objects.get(provider=dana)
    assert payout.amount_micros == 10 * USD and "dana@example.com" in payout.destination
    page.goto("/accounts/")
    page.screenshot(path=screenshot_dir / "account-settings.png", full_page=True)
    subjects = [m.subject for m in mailoutbox]
    assert "[Rigshare] Payout requested: $10.00" in subjects
    assert "[Rigshare] Payout destination changed" in subjects
