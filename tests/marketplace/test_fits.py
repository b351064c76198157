""""Runs MODEL at CONTEXT tokens": the catalog's filter (page and /api/cards/) and /tools/vram.
The answer comes from marketplace.modelmath, so each test checks the listing against plan() for
the same card rather than against a number of its own."""

import re
from html import unescape

import pytest
from django.core.cache import cache
from django.db import connection
from django.test.utils import CaptureQueriesContext

from marketplace import modelmath
from marketplace.filters import CARD_SIZES
from marketplace.model_data import architecture_for
from marketplace.models import Card, Listing, Node
from tests.factories import NodeFactory, RentalFactory, listed_card

pytestmark = pytest.mark.django_db

MIB = 2**20
QWEN = "Qwen/Qwen3.5-27B"


def ids(response):
    if response["Content-Type"].startswith("application/json"):
        return sorted(row["id"] for row in response.json()["results"])
    return sorted(card.pk for card in response.context["page"].cards)


@pytest.fixture
def offer():
    """One card of each size the catalog meets, cheapest first."""
    node = NodeFactory(region="eu-central")
    sizes = {"4090": ("NVIDIA GeForce RTX 4090", 24_564), "5090": ("NVIDIA GeForce RTX 5090",
                                                                      32_607),
             "l40s": ("NVIDIA L40S", 46_068), "h100": ("NVIDIA H100 80GB HBM3", 81_559),
             "pro6000": ("NVIDIA RTX PRO 6000 Blackwell", 97_887),
             "h200": ("NVIDIA H200", 143_771)}
    return {key: listed_card(node=node, name=name, memory_total_mib=mib,
                             listing__price_per_hour_micros=100_000 * (i + 1))
            for i, (key, (name, mib)) in enumerate(sizes.items())}


@pytest.fixture(params=["page", "api"])
def fetch(request, client):
    path = "/" if request.param == "page" else "/api/cards/"
    return lambda **params: client.get(path, params)


def fitting(offer, model, context, quant="bf16", kv=None):
    """The offer's cards that plan() says run it: the listing must be exactly these."""
    arch = architecture_for(model)
    engine = modelmath.engine_for(quant, kv)
    return sorted(card.pk for card in offer.values()
                  if modelmath.plan(arch, quantization=quant, context=context,
                                    vram_bytes=card.memory_total_mib * MIB,
                                    engine=engine).fits)


@pytest.mark.parametrize("model, context, quant, kv", [
    (QWEN, 262_144, "bf16", None),
    (QWEN, 32_768, "bf16", None),
    (QWEN, 262_144, "fp8", "fp8"),
    (QWEN, 131_072, "awq", None),
    (QWEN, 131_072, "q4_k_m", None),
    (QWEN, 262_144, "q8_0", "q8_0"),
    ("meta-llama/Llama-3.1-8B-Instruct", 131_072, "bf16", None),
    ("meta-llama/Llama-3.1-8B-Instruct", 2_048, "bf16", None),
])
def test_the_filter_lists_exactly_the_cards_that_plan_says_fit(fetch, offer, model, context,
                                                               quant, kv):
    params = {"model": model, "context": context, "quant": quant} | (
        {"kv_cache": kv} if kv else {})
    expected = fitting(offer, model, context, quant, kv)
    assert ids(fetch(**params)) == expected
    assert 0 < len(expected) < len(offer) or context == 2_048  # the cases tell cards apart


def test_the_27b_at_full_context_needs_a_big_card(fetch, offer):
    """The 27B's BF16 weights (50.3 GiB) and 262,144 tokens of KV (16.3 GiB in vLLM's blocks)
    need ~76 GiB: the H100, the PRO 6000 and the H200."""
    assert ids(fetch(model=QWEN, context=262_144)) == sorted(
        offer[k].pk for k in ("h100", "pro6000", "h200"))


def test_the_model_filter_joins_the_others(fetch, offer):
    assert ids(fetch(model=QWEN, context=262_144, max_price="0.45")) == [offer["h100"].pk]
    # A floor asked for above the model's need wins, and below it changes nothing.
    assert ids(fetch(model=QWEN, context=262_144, min_vram_gb=96)) == sorted(
        [offer["pro6000"].pk, offer["h200"].pk])
    assert ids(fetch(model=QWEN, context=262_144, min_vram_gb=24)) == ids(
        fetch(model=QWEN, context=262_144))


def test_aliases_and_any_case_name_the_same_model(fetch, offer):
    expected = ids(fetch(model=QWEN, context=100_000))
    assert ids(fetch(model="Qwen/Qwen3-27B", context=100_000)) == expected  # the fleet's id
    assert ids(fetch(model="qwen3.5-27b", context=100_000)) == expected


def test_rented_and_unlisted_cards_stay_out(fetch, offer):
    RentalFactory(card=offer["h200"])
    assert offer["h200"].pk not in ids(fetch(model=QWEN, context=262_144))


@pytest.mark.parametrize("params, field, shown", [
    ({"model": "gpt-5", "context": "1000"}, "model",
     "Runs model: Unknown model 'gpt-5'. Rigshare knows Qwen3.5-27B, Qwen3.5-4B"),
    ({"model": QWEN, "context": "lots"}, "context", "At context (tokens): Enter a whole number."),
    ({"model": QWEN, "context": "0"}, "context", "At context (tokens): Ensure this value is"),
    ({"model": QWEN, "context": "300000"}, "context",
     "At context (tokens): Qwen3.5-27B reads at most 262,144 tokens."),
    ({"model": QWEN}, "context", "At context (tokens): Say how many tokens of context it needs."),
    ({"context": "4096"}, "model", "Runs model: Pick a model for this question."),
    ({"quant": "fp8"}, "model", "Runs model: Pick a model for this question."),
    ({"model": QWEN, "context": "4096", "quant": "int3"}, "quant",
     "Weights: Select a valid choice."),
    ({"model": QWEN, "context": "4096", "kv_cache": "q4_0"}, "kv_cache",
     "KV cache: Q4_0 (llama.cpp) is not a cache of vLLM, which loads BF16 weights."),
    ({"model": QWEN, "context": "4096", "quant": "q4_k_m", "kv_cache": "fp8"}, "kv_cache",
     "KV cache: FP8 (vLLM) is not a cache of llama.cpp, which loads GGUF Q4_K_M weights."),
])
def test_a_bad_question_is_an_error_never_an_unfiltered_list(client, offer, params, field,
                                                             shown):
    page = client.get("/", params)
    assert page.status_code == 400
    html = unescape(page.content.decode())
    assert 'role="alert"' in html and shown in html, html
    assert page.context["page"] is None

    response = client.get("/api/cards/", params)
    assert response.status_code == 400
    assert field in response.json(), response.json()


def test_the_page_says_what_the_filter_asked(client, offer):
    html = client.get("/", {"model": QWEN, "context": 262_144}).content.decode()
    need = modelmath.min_vram_mib(architecture_for(QWEN), quantization="bf16", context=262_144)
    assert f"Cards with at least {need / 1024:,.1f} GiB of memory run Qwen3.5-27B at 262,144 " \
           f"tokens, BF16 weights on vLLM: the weights and one sequence" in html
    assert 'href="/tools/vram?model=Qwen%2FQwen3.5-27B&amp;context=262144&amp;quant=bf16"' in html
    assert re.search(r'<option value="Qwen/Qwen3.5-27B" selected>', html)


def test_the_schema_documents_the_question(client):
    schema = client.get("/api/schema/?format=json").json()
    params = {p["name"]: p for p in schema["paths"]["/api/cards/"]["get"]["parameters"]}
    assert {"model", "context", "quant", "kv_cache"} <= set(params)
    assert "`Qwen/Qwen3.5-27B`" in params["model"]["description"]
    assert params["context"]["schema"]["type"] == "integer"
    assert "q4_k_m" in params["quant"]["schema"]["enum"]
    assert "fp8" in params["kv_cache"]["schema"]["enum"]


# --- /tools/vram ----------------------------------------------------------------------------------

def test_the_vram_page_is_public_and_answers_each_size_as_plan_does(client, offer):
    response = client.get("/tools/vram", {"model": QWEN, "context": 131_072, "quant": "fp8",
                                          "kv_cache": "fp8"})
    assert response.status_code == 200
    arch = architecture_for(QWEN)
    engine = modelmath.engine_for("fp8", "fp8")
    rows = response.context["rows"]
    assert [size.mib for size, _ in rows] == [size.mib for size in CARD_SIZES]
    html = response.content.decode()
    for size, plan in rows:
        assert plan == modelmath.plan(arch, quantization="fp8", context=131_072,
                                      vram_bytes=size.mib * MIB, engine=engine)
        row = re.search(rf'<tr data-mib="{size.mib}" class="(fits|too-small)">(.*?)</tr>', html,
                        re.S)
        assert row[1] == ("fits" if plan.fits else "too-small")
        assert f"{plan.weights_bytes / 2**30:,.1f} GiB" in row[2]
        assert f"{plan.kv_bytes / 2**30:,.1f} GiB" in row[2]
        assert f">{plan.sequences:,}<" in row[2]
    assert {plan.fits for _, plan in rows} == {True, False}
    for size in ("24 GB", "RTX 4090", "RTX 5090", "L40S", "H100", "RTX PRO 6000", "H200"):
        assert size in html


def test_the_vram_page_links_the_listed_cards_that_fit_and_the_filtered_catalog(client, offer):
    html = client.get("/tools/vram", {"model": QWEN, "context": 262_144}).content.decode()
    linked = {int(n) for n in re.findall(r'<li data-card="(\d+)"><a href="/cards/\1/">', html)}
    assert linked == set(fitting(offer, QWEN, 262_144))
    assert 'href="/?model=Qwen%2FQwen3.5-27B&amp;context=262144&amp;quant=bf16"' in html
    assert "All 3 in the catalog" in html


def test_the_vram_page_has_defaults_and_names_what_it_ignores(client, offer):
    response = client.get("/tools/vram")
    assert response.status_code == 200 and response.context["fit"].model == QWEN
    assert response.context["fit"].context == 32_768
    ignored = client.get("/tools/vram", {"model": QWEN, "context": 4096, "utm_source": "x"})
    assert "ignored: utm_source." in ignored.content.decode()


@pytest.mark.parametrize("params, shown", [
    ({"model": "nope", "context": "4096"}, "Runs model: Unknown model 'nope'."),
    ({"model": QWEN, "context": "-5"}, "At context (tokens): Ensure this value is greater"),
    ({"model": QWEN}, "At context (tokens): Say how many tokens of context it needs."),
    ({"model": "meta-llama/Llama-3.1-8B-Instruct", "context": "200000"},
     "At context (tokens): Llama-3.1-8B reads at most 131,072 tokens."),
])
def test_the_vram_page_shows_a_bad_question_as_a_form_error(client, offer, params, shown):
    response = client.get("/tools/vram", params)
    assert response.status_code == 400
    html = unescape(response.content.decode())
    assert 'role="alert"' in html and shown in html
    assert response.context["rows"] == [] and response.context["page"] is None
    assert "data-card=" not in html


def test_the_vram_page_only_reads(client):
    assert client.post("/tools/vram", {"model": QWEN, "context": 1}).status_code == 405
    assert client.head("/tools/vram").status_code == 200


def test_the_navigation_links_the_page(client):
    assert 'href="/tools/vram"' in client.get("/").content.decode()


# --- constant queries ----------------------------------------------------------------------------

def _bulk_listings(owner, count: int, start: int = 0):
    """`count` listed cards, a quarter of them 96 GB ones (the 27B at full context fits those
    alone): the filter has something to keep and something to drop at every size."""
    nodes = Node.objects.bulk_create([
        Node(owner=owner, name=f"fit-{i}", region="eu-central",
             credential_prefix=f"fit{i:09d}", credential_digest="0",
             status=Node.Status.ONLINE, reliability_pct=98)
        for i in range(start, start + count // 4)])
    cards = Card.objects.bulk_create([
        Card(node=nodes[i // 4], index=i % 4, uuid=f"GPU-fit-{start}-{i}",
             name="NVIDIA RTX PRO 6000 Blackwell" if i % 4 == 0 else "NVIDIA GeForce RTX 4090",
             memory_total_mib=97_887 if i % 4 == 0 else 24_564) for i in range(count)])
    Listing.objects.bulk_create([
        Listing(card=card, is_listed=True, price_per_hour_micros=300_000 + i)
        for i, card in enumerate(cards)])


FIT = {"model": QWEN, "context": 262_144}
PAGES = [
    ("/", {}),
    ("/", FIT),
    ("/", FIT | {"quant": "fp8", "kv_cache": "fp8", "sort": "-vram", "min_vram_gb": 24}),
    ("/api/cards/", {}),
    ("/api/cards/", FIT | {"quant": "awq", "context": 8_192}),
    ("/tools/vram", FIT),
    ("/tools/vram", {"model": "meta-llama/Llama-3.1-8B-Instruct", "context": 4_096}),
]


def _queries(client, path, params) -> int:
    with CaptureQueriesContext(connection) as captured:
        response = client.get(path, params)
    assert response.status_code == 200, response.content
    return len(captured.captured_queries)


def test_query_count_is_the_same_for_12_and_10012_listings(client, bob):
    """The question is answered in Python and asked of the database as a floor on the card's
    memory: a filtered page takes the queries an unfiltered one does, at 10,012 listings as at
    12, and so does /tools/vram."""
    _bulk_listings(bob, 12)
    client.get("/")  # the drop-downs' choices, cached: each page below finds them so
    small = [_queries(client, path, params) for path, params in PAGES]
    assert small[1] == small[0] and small[4] == small[3]  # the filter adds no query
    first = client.get("/", FIT).context["page"]
    assert first.count == 3 and not first.count_estimated  # the three PRO 6000s

    _bulk_listings(bob, 10_000, start=100)
    connection.cursor().execute("ANALYZE")
    cache.clear()
    client.get("/")
    assert [_queries(client, path, params) for path, params in PAGES] == small
    page = client.get("/", FIT).context["page"]
    assert page.count_estimated and 2_000 <= page.count <= 3_000
    assert {card.memory_total_mib for card in page.cards} == {97_887}
    tool = client.get("/tools/vram", FIT)
    assert len(tool.context["page"].cards) == 10
    print(f"queries per page: {small}")
