"""The heartbeat's host facts (CPU, RAM, disk, network): stored on the node, optional one by
one, absent from older agents, refused out of bounds, and no reason to take the full path."""

import json

import pytest

from marketplace import heartbeat_fast
from marketplace.models import Node
from tests.marketplace.test_agent_api import beat, enroll, report

pytestmark = pytest.mark.django_db

HOST = {"cpu_model": "AMD EPYC 9654 96-Core Processor", "cpu_cores": 192,
        "ram_mib": 1_547_364, "disk_free_gb": 3412, "net_link_mbps": 100_000}


def test_host_facts_are_stored_on_the_node(api, bob):
    enrolled = enroll(api, bob)
    assert beat(api, enrolled["credential"], report(host=HOST)).status_code == 200
    node = Node.objects.get(pk=enrolled["node_id"])
    assert (node.cpu_model, node.cpu_cores, node.ram_mib, node.disk_free_gb,
            node.net_link_mbps) == tuple(HOST.values())

    # A fact the agent can no longer read is no longer shown.
    partial = {"cpu_cores": 192, "ram_mib": 1_547_364}
    assert beat(api, enrolled["credential"], report(host=partial)).status_code == 200
    node.refresh_from_db()
    assert node.cpu_model == "" and node.net_link_mbps is None and node.cpu_cores == 192


def test_an_agent_older_than_host_facts_still_reports(api, bob):
    enrolled = enroll(api, bob)
    body = report()
    assert "host" not in body
    assert beat(api, enrolled["credential"], body).status_code == 200
    node = Node.objects.get(pk=enrolled["node_id"])
    assert node.is_online and node.cpu_model == "" and node.ram_mib is None


@pytest.mark.parametrize("fact, value", [
    ("cpu_cores", 0), ("cpu_cores", "many"), ("ram_mib", -1), ("net_link_mbps", 10**9),
    ("disk_free_gb", 3_000_000_000), ("cpu_model", "x" * 257),
])
def test_a_host_fact_out_of_bounds_is_refused_naming_it(api, bob, fact, value):
    enrolled = enroll(api, bob)
    response = beat(api, enrolled["credential"], report(host=dict(HOST, **{fact: value})))
    assert response.status_code == 400
    assert fact in response.json()["host"]
    assert Node.objects.get(pk=enrolled["node_id"]).cpu_cores is None


def test_free_disk_space_moving_does_not_make_a_report_new():
    body = report(host=HOST)
    moved = report(host=dict(HOST, disk_free_gb=3398))
    other_cpu = report(host=dict(HOST, cpu_cores=96))
    digest = heartbeat_fast.report_digest
    assert digest(json.dumps(body).encode()) == digest(json.dumps(moved).encode())
    assert digest(json.dumps(body).encode()) != digest(json.dumps(other_cpu).encode())
