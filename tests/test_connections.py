"""PostgreSQL connections under load, on a production-like deployment (uvicorn with two worker
processes, tests/deployment.py): catalog pages, REST reads and agent heartbeats at once never
answer 5xx, and the connections PostgreSQL sees stay within the per-process pool's bound,
during the load and after it."""

import asyncio
import collections
import copy
import time

import httpx
import pytest
from django.db import connection

from marketplace import services
from tests.deployment import Deployment
from tests.marketplace.test_agent_api import H200, report

pytestmark = pytest.mark.django_db(transaction=True)

WORKERS = 2
POOL = 4  # connections per process: far fewer than the clients, so they must share
CLIENTS = 24
AGENTS = 16
SECONDS = 6.0


def _agents(owner) -> list[str]:
    credentials = []
    for i in range(AGENTS):
        _, token = services.enrolment_token_create(owner=owner)
        credentials.append(services.node_enroll(token=token, hostname=f"box-{i}",
                                                agent_version="0.1.0").credential)
    return credentials


def _report(i: int, n: int) -> dict:
    # Every other report differs from the last (the PCIe link's current generation moves
    # with load): half the heartbeats take the full path.
    gpu = copy.deepcopy(H200) | {"uuid": f"GPU-{i:08d}-0000-0000-0000-000000000000",
                                 "pcie_gen_current": 4 + n % 2}
    return report(hostname=f"box-{i}", gpus=[gpu])


async def _drive(url: str, credentials: list[str]) -> collections.Counter:
    statuses: collections.Counter = collections.Counter()
    end = time.monotonic() + SECONDS

    async def client(c: int):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            n = 0
            while time.monotonic() < end:
                n += 1
                if c % 3 == 0:
                    resp = await http.get("/")
                elif c % 3 == 1:
                    resp = await http.get("/api/cards/")
                else:
                    i = (c * 7 + n) % len(credentials)
                    resp = await http.post("/api/agent/heartbeat/", json=_report(i, n),
                                           headers={"Authorization":
                                                    f"Bearer {credentials[i]}"})
                statuses[resp.status_code] += 1

    await asyncio.gather(*(client(c) for c in range(CLIENTS)))
    return statuses


def test_pages_and_heartbeats_share_a_bounded_pool(transactional_db, pg_gate, redis_server,
                                                   tmp_path, bob):
    credentials = _agents(bob)
    deployment = Deployment(database=connection.settings_dict["NAME"], gate=pg_gate,
                            redis_url=redis_server.url, directory=tmp_path, workers=WORKERS,
                            env={"RIGSHARE_DB_POOL_SIZE": str(POOL)}).start()
    try:
        statuses = asyncio.run(_drive(deployment.url, credentials))
        time.sleep(1.0)
        idle = pg_gate.connections
    finally:
        deployment.stop()
    print(f"\n{sum(statuses.values())} requests in {SECONDS:.0f} s from {CLIENTS} clients: "
          f"{dict(statuses)}; at most {pg_gate.peak} PostgreSQL connections, {idle} idle after")
    assert statuses[200] > 100
    assert not [s for s in statuses if s >= 500], statuses
    assert pg_gate.peak <= WORKERS * POOL
    assert idle <= WORKERS * POOL
