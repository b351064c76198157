"""The Add-machine page's install command: shown with its checksum, copied with a button that
works from the keyboard."""

import pytest

from tests.e2e.test_browser import sign_up

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_the_install_command_is_copied_from_the_keyboard(page, live_server):
    from playwright.sync_api import expect

    from marketplace.agent_wheel import agent_wheel

    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    sign_up(page, "bob@example.com")
    page.goto("/provider/")
    page.locator("#add-machine").click()
    wheel = agent_wheel()
    command = (f'pip install "{live_server.url}/downloads/agent/{wheel.filename}'
               f'#sha256={wheel.sha256}"')
    expect(page.locator("#install-command")).to_have_text(command)
    expect(page.locator("#agent-sha256")).to_have_text(wheel.sha256)

    # From the command, Tab reaches its button; Enter presses it.
    page.locator("#install-command").click()
    page.keyboard.press("Tab")
    button = page.get_by_role("button", name="Copy the install command")
    expect(button).to_be_focused()
    page.keyboard.press("Enter")
    expect(page.locator("#install-command-status")).to_have_text("Copied.")
    assert page.evaluate("navigator.clipboard.readText()") == command

    page.get_by_role("button", name="Copy the enrol command").press("Space")
    expect(page.locator("#enroll-command-status")).to_have_text("Copied.")
    assert page.evaluate("navigator.clipboard.readText()").startswith(
        f"python -m agent enroll --platform {live_server.url} --token rse_")
