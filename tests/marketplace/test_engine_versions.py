"""The engine versions the agent reports: validated and stored on the node, and the engine
command computed for the vLLM the node has (flags an older release lacks are left out)."""

import pytest

from marketplace import engine_config as ec
from marketplace import selectors
from marketplace.models import Node
from tests.marketplace.test_agent_api import beat, enroll, report
from tests.marketplace.test_engine_config import config
from tests.marketplace.test_engine_overrides import pair_of_4090s, url

VERSIONS = {"vllm": "0.30.1", "llama-server": "6500", "llama-cpp-python": "0.3.16"}


@pytest.mark.parametrize("text, version", [
    ("0.30.1", (0, 30)),
    ("0.11.0rc2", (0, 11)),
    ("0.9.2.dev123+gabc1234", (0, 9)),
    ("v0.27.0", (0, 27)),
    (" 1.2 ", (1, 2)),
    ("0.30", (0, 30)),
    ("1", None),
    ("", None),
    ("latest", None),
    ("0.30.1 (abc)", None),
    ("0.x", None),
    (None, None),
    (30, None),
])
def test_parse_vllm_version(text, version):
    assert ec.parse_vllm_version(text) == version


def test_the_flags_follow_the_vllm_the_node_has():
    """The hybrid 27B on the 4090 pair: --prefix-match-unit from vLLM 0.27, --mamba-cache-mode
    from 0.16; the command says for which version it was computed."""
    new, old, older = (config("2x-rtx-4090", vllm_version=v) for v in ((0, 30), (0, 26), (0, 15)))
    assert new.value("--prefix-match-unit") == "32"
    assert new.engine_version == "vLLM 0.30 (as the agent reported)"
    assert old.flag("--prefix-match-unit") is None
    assert old.value("--mamba-cache-mode") == "align"
    assert old.engine_version == "vLLM 0.26 (as the agent reported)"
    assert any("vLLM 0.26 has no --prefix-match-unit" in note for note in old.notes)
    assert older.flag("--mamba-cache-mode") is None and older.flag("--prefix-match-unit") is None
    assert older.value("--enable-prefix-caching") == "on"
    assert config("2x-rtx-4090").engine_version == "vLLM 0.30 (assumed: the agent did not say)"
    assert config("2x-rtx-4090").to_json()["engine_version"].startswith("vLLM 0.30 (assumed")
    assert config("m4-max-llamacpp").engine_version == ""


def test_an_override_the_old_engine_lacks_is_refused_saying_why():
    c = config("2x-rtx-4090", vllm_version=(0, 26), overrides={"--prefix-match-unit": "16"})
    [ignored] = c.ignored
    assert ignored.flag == "--prefix-match-unit" and "older than vLLM 0.27" in ignored.reason


@pytest.mark.django_db
def test_the_versions_land_on_the_node_and_an_older_agent_sends_none(api, bob):
    enrolled = enroll(api, bob)
    assert beat(api, enrolled["credential"], report(engine_versions=VERSIONS)).status_code == 200
    node = Node.objects.get(pk=enrolled["node_id"])
    assert node.engine_versions == VERSIONS
    assert beat(api, enrolled["credential"], report()).status_code == 200
    node.refresh_from_db()
    assert node.engine_versions == {}


@pytest.mark.django_db
@pytest.mark.parametrize("versions, error", [
    ({"vllm": "0.30.1; rm -rf /"}, "is not a version"),
    ({"vllm": "0." + "1" * 63}, "no more than 64 characters"),
    ({"vllm": ""}, "may not be blank"),
    ({"vllm": ["0.30.1"]}, "Not a valid string"),
    ({"vllm": None}, "may not be null"),
    ({"Bad Key": "1.0"}, "is not an engine name"),
    ({f"engine{i}": "1.0" for i in range(9)}, "At most 8 engines"),
    ("0.30.1", "Expected a dictionary"),
])
def test_junk_versions_are_refused_naming_the_field(api, bob, versions, error):
    enrolled = enroll(api, bob)
    assert beat(api, enrolled["credential"], report(engine_versions=VERSIONS)).status_code == 200
    response = beat(api, enrolled["credential"], report(engine_versions=versions))
    assert response.status_code == 400
    assert error in str(response.json()["engine_versions"])
    assert Node.objects.get(pk=enrolled["node_id"]).engine_versions == VERSIONS  # unchanged


@pytest.mark.django_db
@pytest.mark.parametrize("versions, expected, unit", [
    ({"vllm": "0.26.2"}, (0, 26), None),
    ({"vllm": "0.30.1"}, (0, 30), "32"),
    ({"vllm": "nightly"}, None, "32"),  # unparsable: the assumed version
    ({"llama-server": "6500"}, None, "32"),
    ({}, None, "32"),
])
def test_the_node_reporting_vllm_gets_its_flags(bob, versions, expected, unit):
    node = pair_of_4090s(bob, engine_versions=versions)
    assert selectors.node_engine_inputs(node).get("vllm_version") == expected
    config = selectors.node_engine(node).config
    assert config.value("--prefix-match-unit") == unit
    assert config.engine_version == ec.vllm_version_text(expected)


@pytest.mark.django_db
def test_the_machine_page_shows_the_reported_versions(client, bob):
    node = pair_of_4090s(bob, engine_versions={"vllm": "0.26.2", "llama-server": "6500"})
    client.force_login(bob)
    html = client.get(url(node)).content.decode()
    assert "vllm <code>0.26.2</code>, llama-server <code>6500</code>" in html
    assert '<span id="engine-version">vLLM 0.26 (as the agent reported)</span>' in html
    assert "--prefix-match-unit" not in html.split('id="engine-command">')[1].split("</pre>")[0]
    node.engine_versions = {}
    node.save()
    html = client.get(url(node)).content.decode()
    assert "The agent reports no installed engine version" in html
    assert "vLLM 0.30 (assumed: the agent did not say)" in html
