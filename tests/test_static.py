"""Static files as production serves them: hashed names, compressed, cached for a year."""

import pytest
from django.templatetags.static import static

pytestmark = pytest.mark.django_db

YEAR_IMMUTABLE = "max-age=315360000, public, immutable"


def get(client, url, encoding):
    response = client.get(url, headers={"accept-encoding": encoding})
    assert response.status_code == 200, url
    return response, b"".join(response.streaming_content)


def test_a_hashed_static_file_is_served_compressed_with_a_long_max_age(client):
    url = static("css/site.css")
    assert url.startswith("/static/css/site.") and url != "/static/css/site.css"

    brotli, br_body = get(client, url, "gzip, deflate, br")
    assert brotli["Content-Encoding"] == "br"
    assert brotli["Cache-Control"] == YEAR_IMMUTABLE
    assert "Accept-Encoding" in brotli["Vary"]

    gzip, gz_body = get(client, url, "gzip")
    assert gzip["Content-Encoding"] == "gzip"
    plain, body = get(client, url, "identity")
    assert "Content-Encoding" not in plain
    assert len(br_body) < len(gz_body) < len(body) / 2
    assert b".skip-link" in body


def test_swagger_ui_is_served_compressed(client):
    html = client.get("/api/docs/").content.decode()
    bundle = static("drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js")
    assert f'src="{bundle}"' in html
    response, body = get(client, bundle, "gzip, deflate, br")
    assert response["Content-Encoding"] == "br"
    assert response["Cache-Control"] == YEAR_IMMUTABLE
    assert len(body) < 600_000  # 1.6 MB uncompressed


def test_pages_link_the_svg_favicon_which_is_served(client):
    icon = static("favicon.svg")
    for page in ("/", "/accounts/login/", "/api/docs/"):
        assert f'<link rel="icon" href="{icon}" type="image/svg+xml">' in (
            client.get(page).content.decode()), page
    response, body = get(client, icon, "identity")
    assert response["Content-Type"] == "image/svg+xml"
    assert response["Cache-Control"] == YEAR_IMMUTABLE
    assert body.startswith(b"<svg")


def test_the_api_docs_page_says_its_language(client):
    assert client.get("/api/docs/").content.decode().startswith('<!doctype html>\n<html lang="en">')
