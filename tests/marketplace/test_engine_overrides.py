"""The engine configuration on the provider's machine page: computed from what the node's
agent reported, with the owner's overrides beside the computed values; staff set them in the
admin; everyone else is refused."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from marketplace import selectors, services
from marketplace.models import EngineOverride
from tests.factories import CardFactory, NodeFactory, UserFactory

pytestmark = pytest.mark.django_db

SERVED = [{"id": "Qwen/Qwen3-27B", "engine": "vllm", "max_context": 65536,
           "quantization": "fp8"}]


def pair_of_4090s(owner, **kwargs):
    """The fleet's 2x RTX 4090 (fleetsim's 2x-rtx-4090): the 27B at FP8 over both."""
    node = NodeFactory(owner=owner, name="bobs-pair", os="Linux 6.8.0-45-generic",
                       has_nvidia=True, engine_models=["Qwen/Qwen3-27B"], engine_served=SERVED,
                       **kwargs)
    for index in range(2):
        CardFactory(node=node, index=index, bandwidth_gbs=905.0)
    return node


def url(node, suffix=""):
    return f"/provider/machines/{node.pk}/{suffix}"


def test_the_machine_page_shows_the_computed_command_with_its_reasons(client, bob):
    node = pair_of_4090s(bob)
    client.force_login(bob)
    html = client.get(url(node)).content.decode()
    assert 'id="engine-layout">tensor parallel 2<' in html
    assert "vllm serve Qwen/Qwen3-27B --quantization fp8 --tensor-parallel-size 2" in html
    assert "--prefix-match-unit 32" in html and "--mamba-cache-mode align" in html
    assert "do not fit the 19.6 GiB vLLM gets of one 24 GB card" in html
    assert "at the measured 905 GB/s" in html  # verification's bandwidth in the reason
    assert 'data-copy="engine-command"' in html
    assert "What differs from one command for the whole fleet" in html
    assert '<li data-flag="--kv-cache-dtype"><code>--kv-cache-dtype fp8</code> instead of ' \
           '<code>auto</code>' in html


def test_the_page_runs_a_fixed_number_of_queries(client, bob):
    node = pair_of_4090s(bob)
    services.engine_override_set(node_id=node.pk, owner=bob, set_by=bob,
                                 flag="--max-num-seqs", value="16", reason="fewer, faster")
    client.force_login(bob)
    with CaptureQueriesContext(connection) as first:
        assert client.get(url(node)).status_code == 200
    for flag, value in (("--gpu-memory-utilization", "0.85"), ("--kv-cache-dtype", "fp8")):
        services.engine_override_set(node_id=node.pk, owner=bob, set_by=bob, flag=flag,
                                     value=value, reason="r")
    with CaptureQueriesContext(connection) as more:
        client.get(url(node))
    assert len(more) == len(first)


def test_the_owner_sets_an_override_and_sees_it_beside_the_computed_value(client, bob):
    node = pair_of_4090s(bob)
    client.force_login(bob)
    response = client.post(url(node, "engine/"), {
        "flag": "--max-num-seqs", "value": " 16 ", "reason": "Long prompts, few users"})
    assert response.status_code == 302 and response["Location"].endswith("#engine")
    row = EngineOverride.objects.get(node=node)
    assert (row.flag, row.value, row.reason, row.set_by) == (
        "--max-num-seqs", "16", "Long prompts, few users", bob)
    html = client.get(url(node)).content.decode()
    assert "--max-num-seqs 16 " in html
    assert "computed: <code>32</code>" in html and "Long prompts, few users" in html
    config = selectors.node_engine(node).config
    assert config.flag("--max-num-seqs").computed == "32"


def test_an_override_the_arithmetic_follows(client, bob):
    """A lower share of each card: the KV pool shrinks and the limits with it."""
    node = pair_of_4090s(bob)
    before = selectors.node_engine(node).config
    client.force_login(bob)
    client.post(url(node, "engine/"), {"flag": "--gpu-memory-utilization", "value": "0.85",
                                       "reason": "the desktop runs on card #1"})
    after = selectors.node_engine(node).config
    assert after.value("--gpu-memory-utilization") == "0.85"
    assert int(after.value("--max-model-len")) < int(before.value("--max-model-len"))
    assert int(after.value("--max-num-seqs")) < int(before.value("--max-num-seqs"))


@pytest.mark.parametrize("flag, value, error", [
    ("--gpu-memory-utilization", "2", "takes 0.5 to 0.98"),
    ("--tensor-parallel-size", "1", "do not fit"),  # the FP8 weights on one 4090
    ("--max-model-len", "300000", "reads at most 262,144"),
    ("--prefix-match-unit", "64", "does not divide the 1,568-token block"),
    ("--max-num-seqs", "lots", "whole number"),
])
def test_a_bad_value_is_a_form_error_and_changes_nothing(client, bob, flag, value, error):
    node = pair_of_4090s(bob)
    client.force_login(bob)
    response = client.post(url(node, "engine/"), {"flag": flag, "value": value,
                                                  "reason": "trying"})
    assert response.status_code == 400
    assert error in response.content.decode()
    assert not EngineOverride.objects.exists()


def test_a_flag_nobody_may_set_is_not_offered(client, bob):
    node = pair_of_4090s(bob)
    client.force_login(bob)
    response = client.post(url(node, "engine/"), {"flag": "--api-key", "value": "mine",
                                                  "reason": "x"})
    assert response.status_code == 400 and "Select a valid choice" in response.content.decode()
    # llama.cpp's flags are not offered on a vLLM node either.
    assert '<option value="-ngl"' not in client.get(url(node)).content.decode()
    assert not EngineOverride.objects.exists()


def test_clearing_an_override_brings_the_computed_value_back(client, bob):
    node = pair_of_4090s(bob)
    services.engine_override_set(node_id=node.pk, owner=bob, set_by=bob,
                                 flag="--max-num-seqs", value="16", reason="r")
    client.force_login(bob)
    response = client.post(url(node, "engine/clear/"), {"flag": "--max-num-seqs"}, follow=True)
    assert "back to the computed value" in response.content.decode()
    assert not EngineOverride.objects.exists()
    assert selectors.node_engine(node).config.value("--max-num-seqs") == "32"


def test_an_override_the_node_outgrew_is_shown_apart_and_can_be_removed(client, bob):
    """A stored override that no longer applies (a card gone, another engine) is listed with
    why, not applied."""
    node = pair_of_4090s(bob)
    EngineOverride.objects.create(node=node, flag="-ngl", value="20", reason="old llama.cpp")
    client.force_login(bob)
    html = client.get(url(node)).content.decode()
    assert "Overrides not applied" in html and "This node runs vllm; -ngl is a llama.cpp flag" \
        in html
    assert " -ngl " not in selectors.node_engine(node).config.command()
    client.post(url(node, "engine/clear/"), {"flag": "-ngl"})
    assert not EngineOverride.objects.exists()


def test_a_node_without_a_reported_model_says_so(client, bob):
    node = NodeFactory(owner=bob, has_nvidia=True)
    CardFactory(node=node)
    client.force_login(bob)
    html = client.get(url(node)).content.decode()
    assert "The engine reports no model yet" in html and 'id="engine-command"' not in html
    response = client.post(url(node, "engine/"), {"flag": "--max-num-seqs", "value": "8",
                                                  "reason": "x"})
    assert response.status_code == 400 and not EngineOverride.objects.exists()


def test_mallory_is_refused_everywhere(client, bob, mallory):
    node = pair_of_4090s(bob)
    services.engine_override_set(node_id=node.pk, owner=bob, set_by=bob,
                                 flag="--max-num-seqs", value="16", reason="r")
    client.force_login(mallory)
    assert client.get(url(node)).status_code == 404
    assert client.post(url(node, "engine/"), {"flag": "--max-num-seqs", "value": "8",
                                              "reason": "mine now"}).status_code == 404
    assert client.post(url(node, "engine/clear/"),
                       {"flag": "--max-num-seqs"}).status_code == 404
    assert EngineOverride.objects.get(node=node).value == "16"
    with pytest.raises(node.DoesNotExist):
        services.engine_override_set(node_id=node.pk, owner=mallory, set_by=mallory,
                                     flag="--max-num-seqs", value="8", reason="x")
    assert not services.engine_override_clear(node_id=node.pk, owner=mallory,
                                              flag="--max-num-seqs")


def test_the_engine_pages_need_a_login(client, bob):
    node = pair_of_4090s(bob)
    for response in (client.get(url(node)),
                     client.post(url(node, "engine/"), {"flag": "--max-num-seqs", "value": "8"}),
                     client.post(url(node, "engine/clear/"), {"flag": "--max-num-seqs"})):
        assert response.status_code == 302 and "/accounts/login/" in response["Location"]
    assert client.get(url(node, "engine/")).status_code in (302, 405)


def test_staff_set_an_override_in_the_admin_with_the_same_checks(client, bob):
    node = pair_of_4090s(bob)
    operator = UserFactory(is_staff=True, is_superuser=True, two_factor=True)
    client.force_login(operator)
    add = "/admin/marketplace/engineoverride/add/"
    refused = client.post(add, {"node": node.pk, "flag": "--tensor-parallel-size", "value": "1",
                                "reason": "try one card"})
    assert refused.status_code == 200 and "do not fit" in refused.content.decode()
    assert not EngineOverride.objects.exists()
    client.post(add, {"node": node.pk, "flag": "--kv-cache-dtype", "value": "AUTO",
                      "reason": "quality complaint"})
    row = EngineOverride.objects.get(node=node)
    assert (row.value, row.set_by) == ("auto", operator)
    html = client.get(url(node), follow=True)  # staff do not see bob's page...
    assert html.status_code == 404
    client.force_login(bob)  # ...bob does, with staff named as who set it
    assert "Rigshare staff" in client.get(url(node)).content.decode()
    client.force_login(operator)
    client.post(f"/admin/marketplace/engineoverride/{row.pk}/delete/", {"post": "yes"})
    assert not EngineOverride.objects.exists()


def test_a_machine_too_small_for_the_model_says_why_and_shows_no_command(client, bob):
    node = NodeFactory(owner=bob, has_nvidia=True, engine_models=["Qwen/Qwen3-27B"],
                       engine_served=[{"id": "Qwen/Qwen3-27B", "quantization": "bf16"}])
    CardFactory(node=node)  # one 24 GB card for 54 GB of 16-bit weights
    client.force_login(bob)
    html = client.get(url(node)).content.decode()
    assert 'id="engine-problems"' in html and "do not fit" in html
    assert 'id="engine-command"' not in html and "Each flag and why" not in html
