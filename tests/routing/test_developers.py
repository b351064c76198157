"""One way in for developers: the navigation's "Developers" entry and the page it leads to,
which explains and links every credential, doc and page an API consumer needs."""

import re

import pytest

pytestmark = pytest.mark.django_db


def nav(html: str) -> list[tuple[str, str]]:
    """(href, text) of the main navigation's links."""
    block = html.split('<nav aria-label="Main">')[1].split("</nav>")[0]
    return re.findall(r'<a href="([^"]+)"[^>]*>([^<]+)</a>', block)


LINKS = {"/billing/keys/": "API keys", "/accounts/tokens/": "Personal tokens",
         "/api/docs/": "REST API reference", "/models/": "Models", "/activity/": "Activity"}


@pytest.mark.parametrize("who", ["anonymous", "carol"])
def test_one_developers_entry_leads_to_keys_tokens_docs_models_and_activity(client, login,
                                                                            carol, who):
    if who == "carol":
        client = login(carol)
    links = nav(client.get("/").content.decode())
    texts = [text for _, text in links]
    assert ("/developers/", "Developers") in links
    assert ("/models/", "Models") in links
    assert not {"API keys", "API tokens", "API"} & set(texts)  # the three that confused
    page = client.get("/developers/")
    assert page.status_code == 200
    html = page.content.decode()
    for href, text in LINKS.items():
        assert re.search(rf'<a href="{re.escape(href)}"[^>]*>{re.escape(text)}</a>', html), href
    assert "http://testserver/v1" in html  # where an OpenAI client points
    assert "rs_…" in html and "rst_…" in html  # which credential goes where


def test_the_pages_it_replaced_in_the_navigation_still_answer(login, carol):
    client = login(carol)
    for path in ("/billing/keys/", "/accounts/tokens/", "/api/docs/", "/billing/usage/"):
        assert client.get(path).status_code == 200, path
