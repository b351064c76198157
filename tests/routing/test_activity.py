"""The API consumer's activity log: each of their own /v1 requests with what it cost, filtered,
a page at a time, and as a streamed CSV; never anyone else's."""

import csv
import io
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import async_to_sync
from django.db import connection
from django.test import AsyncClient
from django.test.utils import CaptureQueriesContext

from billing import metering
from billing.keys import KeyInfo, api_key_create, api_key_revoke
from billing.models import ModelPrice
from billing.services import credits_grant
from routing import views
from routing.forms import cursor_text
from routing.models import Deployment, RequestLog
from tests.factories import CardFactory, NodeFactory, price_at

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)
MODEL, OTHER = "qwen3-27b", "llama-3.1-8b"


@pytest.fixture(autouse=True)
def prices(db):
    for name in (MODEL, OTHER):
        ModelPrice.objects.create(model=name, input_micros_per_mtok=200_000,
                                  output_micros_per_mtok=800_000,
                                  effective_at=T0 - timedelta(days=30))


@pytest.fixture
def deployment(bob):
    """A worker on bob's machine, which he named after himself: the log must not say so."""
    node = NodeFactory(owner=bob, name="bob@example.com's rig")
    for i in range(2):
        CardFactory(node=node, index=i, name="NVIDIA GeForce RTX 4090")
    return Deployment.objects.create(node=node, engine_model_id="Qwen/Qwen3-27B",
                                     engine="vllm")


def key_of(user, name="laptop"):
    credits_grant(user=user, amount_micros=100_000_000, idempotency_key=f"t:{uuid.uuid4()}")
    row, _ = api_key_create(user=user, name=name, spend_limit_micros=10**12, by_operator=True)
    return row


def request(key, at, *, model=MODEL, status=200, error_code="", deployment=None,
            prompt=1_000, completion=500, charged=True, estimated=False, ttft_ms=123.4,
            latency_ms=2_345.6) -> RequestLog:
    """A /v1 request as the proxy leaves it: its log row and, when it was billed, its charge
    (reserved and settled through metering, as the proxy does)."""
    request_id = f"req-{uuid.uuid4().hex}"
    if charged:
        price = price_at(model, at)
        hold = metering.reserve(key=KeyInfo.of(key), model=model, price=price,
                                max_cost=metering.max_cost_micros(
                                    price, prompt_tokens=prompt, max_tokens=completion),
                                request_id=request_id, tokens=prompt + completion, now=at)
        metering.settle(hold=hold, usage=metering.Usage(prompt, completion, estimated),
                        worker=metering.Worker(deployment.node.owner_id, deployment.worker_ref)
                        if deployment else None, now=at)
    return RequestLog.objects.create(
        request_id=request_id, created_at=at, user_id=key.user_id, api_key_id=key.pk,
        endpoint="chat", model=model, deployment_id=deployment.pk if deployment else None,
        status=status, error_code=error_code, attempts=1, prompt_tokens=prompt,
        completion_tokens=completion, estimated=estimated, ttft_ms=ttft_ms,
        latency_ms=latency_ms)


def shown(response) -> list[str]:
    """The request ids of the page's rows, in order."""
    html = response.content.decode()
    return [part.split('"', 1)[0] for part in html.split('data-request="')[1:]]


def csv_rows(client_user, query: str = "") -> tuple[object, list[list[str]]]:
    """GET /activity.csv as an ASGI server serves it: the body is streamed, chunk by chunk."""

    async def fetch():
        client = AsyncClient()
        await client.aforce_login(client_user)
        response = await client.get("/activity.csv" + (f"?{query}" if query else ""))
        if not response.streaming:
            return response, None
        assert response.is_async  # an ASGI server sends each chunk as it comes
        chunks = [chunk async for chunk in response.streaming_content]
        return response, b"".join(chunks)

    response, body = async_to_sync(fetch)()
    rows = list(csv.reader(io.StringIO(body.decode()))) if body is not None else []
    return response, rows


def test_each_request_shows_its_tokens_cost_latency_worker_status_and_key(login, carol,
                                                                           deployment):
    key = key_of(carol, "laptop")
    ok = request(key, T0, deployment=deployment, prompt=1_234, completion=567)
    refused = request(key, T0 + timedelta(minutes=1), status=429, error_code="rate_limited",
                      charged=False, prompt=0, completion=0, ttft_ms=None, latency_ms=3.2)
    big = request(key, T0 + timedelta(minutes=2), deployment=deployment, prompt=1_000_000,
                  completion=1_000_000, estimated=True)
    response = login(carol).get("/activity/")
    assert response.status_code == 200
    assert shown(response) == [big.request_id, refused.request_id, ok.request_id]
    html = response.content.decode()
    rows = html.split("<tr data-request=")[1:]
    # 1,234 x $0.20/M + 567 x $0.80/M = $0.0007004, rounded up to the micro-dollar: more
    # digits where a request's cost needs them, cents where they are enough.
    assert ">$0.000701<" in rows[2] and "1,234" in rows[2] and "567" in rows[2]
    assert '<td class="cost">$1.00 <span' in rows[0] and "estimated" in rows[0]
    assert "not charged" in rows[1] and "429 rate_limited" in rows[1]
    assert "123" in rows[2] and "2346" in rows[2]  # first token and total, in ms
    assert f"deployment:{deployment.pk} · 2× NVIDIA GeForce RTX 4090" in rows[2]
    assert "laptop" in rows[1]
    assert "bob@example.com" not in html  # the machine's name is the provider's own


def test_filters_select_by_dates_model_key_and_status(login, carol, deployment):
    laptop, server = key_of(carol, "laptop"), key_of(carol, "server")
    first = request(laptop, T0 - timedelta(days=2), deployment=deployment)
    other = request(server, T0, model=OTHER, deployment=deployment)
    failed = request(server, T0 + timedelta(hours=1), status=502,
                     error_code="upstream_disconnected", charged=False)
    client = login(carol)

    def ids(query):
        response = client.get("/activity/?" + query)
        assert response.status_code == 200, response.content
        return shown(response)

    day = T0.date().isoformat()
    assert ids(f"since={day}") == [failed.request_id, other.request_id]
    assert ids(f"until={(T0 - timedelta(days=1)).date()}") == [first.request_id]
    assert ids(f"since={day}&until={day}") == [failed.request_id, other.request_id]
    assert ids(f"model={OTHER}") == [other.request_id]
    assert ids(f"key={laptop.pk}") == [first.request_id]
    assert ids("status=error") == [failed.request_id]
    assert ids(f"status=ok&key={server.pk}") == [other.request_id]
    assert ids("") == [failed.request_id, other.request_id, first.request_id]


def test_a_revoked_keys_requests_stay_and_it_can_be_chosen(login, carol):
    key = key_of(carol, "old")
    old = request(key, T0)
    api_key_revoke(user=carol, key_id=key.pk)
    response = login(carol).get(f"/activity/?key={key.pk}")
    assert shown(response) == [old.request_id]
    assert "old (rs_" in response.content.decode()


def test_pages_go_newest_first_by_keyset(login, carol, monkeypatch):
    monkeypatch.setattr(views, "ACTIVITY_PAGE_SIZE", 2)
    key = key_of(carol)
    # Two requests at the same instant: the id breaks the tie, none is shown twice or lost.
    made = [request(key, T0 + timedelta(seconds=s), charged=False) for s in (0, 1, 1, 2, 3)]
    newest_first = [r.request_id for r in sorted(made, key=lambda r: (r.created_at, r.pk),
                                                 reverse=True)]
    client = login(carol)
    seen, query = [], "status=ok"
    page = client.get(f"/activity/?{query}")
    while True:
        seen += shown(page)
        html = page.content.decode()
        if 'id="activity-older"' not in html:
            break
        older = html.split('id="activity-older"')[0].rsplit('href="?', 1)[1].split('"')[0]
        assert "status=ok" in older  # the filters go along
        if len(seen) == 2:  # a request that arrives meanwhile does not shift older pages
            request(key, T0 + timedelta(hours=1), charged=False)
        page = client.get("/activity/?" + older.replace("&amp;", "&"))
    assert seen == newest_first


def test_the_page_costs_the_same_queries_for_3_requests_as_for_40(login, carol, deployment):
    key = key_of(carol)
    client = login(carol)

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert client.get("/activity/").status_code == 200
        return len(captured)

    for i in range(3):
        request(key, T0 + timedelta(seconds=i), deployment=deployment)
    few = queries()
    other = NodeFactory()
    CardFactory(node=other, index=0, name="NVIDIA H200")
    elsewhere = Deployment.objects.create(node=other, engine_model_id="x", engine="vllm")
    for i in range(37):
        request(key, T0 + timedelta(minutes=i), deployment=elsewhere if i % 2 else deployment,
                model=OTHER if i % 3 else MODEL, charged=i % 4 != 0)
    assert queries() == few


@pytest.mark.parametrize("query, message", [
    ("since=yesterday", "Enter a valid date."),
    ("since=2026-02-30", "Enter a valid date."),
    ("since=2026-11-20&until=2026-11-19", "The end of the range is before its start."),
    ("key=abc", "Select a valid choice."),
    ("key=99999999999999999999", "Select a valid choice."),
    ("status=teapot", "Select a valid choice."),
    ("before=yesterday", "This page link is not valid"),
    ("before=999999999999999999-1", "This page link is not valid"),
    ("model=" + "m" * 201, "Ensure this value has at most 200 characters"),
])
def test_bad_filters_are_form_errors(login, carol, query, message):
    request(key_of(carol), T0)
    client = login(carol)
    for path in ("/activity/", "/activity.csv"):
        response = client.get(f"{path}?{query}")
        assert response.status_code == 400
        assert message in response.content.decode()
        assert 'data-request="' not in response.content.decode()


def test_mallory_never_sees_carols_requests_by_any_parameter(client, login, carol, mallory,
                                                            deployment):
    carols_key = key_of(carol, "carol-secret-key")
    carols = [request(carols_key, T0 + timedelta(minutes=i), deployment=deployment)
              for i in range(3)]
    own = request(key_of(mallory, "mine"), T0)
    mine = login(mallory)
    cursor = cursor_text((carols[-1].created_at + timedelta(seconds=1), carols[-1].pk + 1))
    secret = {r.request_id for r in carols}
    for query in ("", f"model={MODEL}", f"before={cursor}", "status=ok",
                  f"since={T0.date()}&until={T0.date()}"):
        response = mine.get(f"/activity/?{query}")
        assert response.status_code == 200
        assert set(shown(response)) <= {own.request_id}
        assert not any(s in response.content.decode() for s in secret)
        assert "carol-secret-key" not in response.content.decode()
        _, rows = csv_rows(mallory, query)
        assert {row[-1] for row in rows[1:]} <= {own.request_id}
    response = mine.get(f"/activity/?key={carols_key.pk}")  # her key is no choice of mallory's
    assert response.status_code == 400 and "Select a valid choice." in response.content.decode()
    response, rows = csv_rows(mallory, f"key={carols_key.pk}")
    assert response.status_code == 400 and rows == []
    # Logged out: to the log-in page, nothing else.
    client.logout()
    for path in ("/activity/", "/activity.csv"):
        response = client.get(path)
        assert response.status_code == 302 and "/accounts/login/" in response["Location"]


def test_the_csv_streams_every_filtered_row_with_the_pages_columns(carol, deployment,
                                                                   monkeypatch):
    monkeypatch.setattr(views, "ACTIVITY_CSV_CHUNK", 2)  # several queries, one file
    key = key_of(carol, "=cmd|' /C calc'!A0")
    made = [request(key, T0 + timedelta(minutes=i), deployment=deployment) for i in range(5)]
    request(key, T0 + timedelta(hours=1), model=OTHER)
    hostile = request(key, T0 + timedelta(minutes=10), model="=HYPERLINK(\"x\")", charged=False,
                      status=404, error_code="model_not_found")
    response, rows = csv_rows(carol, f"model={MODEL}")
    assert response.status_code == 200
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert response["Content-Disposition"].startswith('attachment; filename="rigshare-activity-')
    assert rows[0] == views.ACTIVITY_HEADER
    assert [row[-1] for row in rows[1:]] == [r.request_id for r in reversed(made)]
    first = dict(zip(rows[0], rows[-1], strict=True))
    assert first == {
        "time_utc": T0.isoformat(), "model": MODEL, "input_tokens": "1000",
        "output_tokens": "500", "cost_usd": "0.000600", "cost_estimated": "",
        "ttft_ms": "123", "latency_ms": "2346",
        "worker": f"deployment:{deployment.pk} · 2× NVIDIA GeForce RTX 4090",
        "status": "ok", "api_key": "'=cmd|' /C calc'!A0", "request_id": made[0].request_id}
    _, rows = csv_rows(carol, "status=error")
    assert [(row[1], row[4], row[9]) for row in rows[1:]] == [
        ("'=HYPERLINK(\"x\")", "", "404 model_not_found")]
    assert rows[1][-1] == hostile.request_id
