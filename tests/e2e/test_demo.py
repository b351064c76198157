"""`make demo` as a newcomer runs it: started, used, stopped with Ctrl-C, and started again on
the same clone (its machines enrolled already), each time with the fleet really online."""

import json
import os
import re
import signal
import sqlite3
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
# Two machines: the demo's rental is a 4090, and a restart passes "-,-" (one "-" per machine
# enrolled before), which must not read as an option.
FLEET = "2x-rtx-4090,m4-max-llamacpp"
BANNER = "Rigshare is running on"
START_DEADLINE_S = 240  # migrations on a fresh database, then the fleet's enrolment
STOP_DEADLINE_S = 15


@pytest.fixture
def demo_database(tmp_path):
    """SQLite, the demo's own zero-setup default, in a file of the test's own (the clone's
    db.sqlite3 is left alone)."""
    return f"sqlite:///{tmp_path / 'demo.sqlite3'}"


def demo_env(tmp_path: Path, port: int, database_url: str, fleet: str = FLEET) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "CELERY_BROKER_URL")}
    return env | {"PORT": str(port), "FLEET": fleet, "DEMO_STATE_DIR": str(tmp_path / "state"),
                  "DATABASE_URL": database_url}


def start_demo(tmp_path: Path, port: int, run: int, database_url: str):
    log = tmp_path / f"demo-{run}.out"
    env = demo_env(tmp_path, port, database_url)
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", "scripts/demo.sh"], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = time.monotonic() + START_DEADLINE_S
    while BANNER not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_demo(proc)
            pytest.fail(f"the demo did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.5)
    time.sleep(0.5)  # the rest of the banner
    return proc, log.read_text(errors="replace")


def stop_demo(proc) -> None:
    """Ctrl-C, as a terminal sends it: to the whole process group. Then nothing may be left."""
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGINT)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_DEADLINE_S
    while True:
        proc.poll()  # reap the script itself once it is done
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            left = subprocess.run(["ps", "-o", "pid,args", "-g", str(pgid)],
                                  capture_output=True, text=True).stdout
            os.killpg(pgid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"the demo still ran {STOP_DEADLINE_S} s after Ctrl-C:\n{left}")
        time.sleep(0.2)


@pytest.mark.e2e
def heartbeats_since(database_url: str, since: float) -> int:
    """How many of the demo's nodes have reported since `since` (epoch seconds)."""
    stamp = datetime.fromtimestamp(since, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
    conn = sqlite3.connect(database_url.removeprefix("sqlite:///"), timeout=10)
    try:  # Django keeps UTC datetimes in SQLite as ISO text, which sorts as time does
        return conn.execute("SELECT count(*) FROM marketplace_node WHERE last_heartbeat_at >= ?",
                            [stamp]).fetchone()[0]
    finally:
        conn.close()


# The demo's Mac runs its engine through its agent (scripts/demo.sh, --agent-engines).
OWN_ENGINE_MACHINE = "m4-max-llamacpp-1"


def own_engine(database_url: str) -> tuple[str, dict]:
    """The state and the process (docs/agent-protocol.md, section 4) of the engine that the
    Mac's agent runs, as its heartbeats told the platform."""
    conn = sqlite3.connect(database_url.removeprefix("sqlite:///"), timeout=10)
    try:
        row = conn.execute("SELECT engine_state, engine_process FROM marketplace_node "
                           "WHERE hostname = ?", [OWN_ENGINE_MACHINE]).fetchone()
    finally:
        conn.close()
    return (row[0], json.loads(row[1])) if row else ("", {})


def running(pid) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError, TypeError):
        return False


# Each demo user's pages, on the demo's own database (SQLite): a query written for PostgreSQL
# alone would answer 500 here and nowhere in the rest of the suite.
DEMO_USERS = {"alice": "demo-alice-2026", "bob": "demo-bob-2026", "carol": "demo-carol-2026",
              "admin": "demo-admin-2026"}
DEMO_PAGES = ["/", "/?q=4090&sort=-capacity", "/models/", "/developers/", "/rentals/",
              "/billing/", "/billing/transactions/", "/billing/transactions.csv",
              "/billing/usage/", "/billing/keys/", "/billing/payouts/",
              "/billing/payouts/destination/", "/billing/statement.csv", "/provider/",
              "/provider/earnings/", "/provider/alerts/", "/activity/", "/activity.csv",
              "/accounts/tokens/", "/api/cards/", "/api/docs/", "/staff/pool/", "/admin/",
              "/accounts/", "/accounts/email/", "/accounts/password/change/", "/accounts/2fa/",
              "/accounts/sessions/", "/accounts/data.json", "/accounts/close/",
              "/tools/vram", "/?model=Qwen/Qwen3-27B&context=32768&quant=fp8",
              "/tools/break-even", "/?sort=cost", "/api/cards/?sort=-cost"]


def pages_that_fail(url: str) -> list[str]:
    failed = []
    for user, password in DEMO_USERS.items():
        with httpx.Client(base_url=url, timeout=30) as client:
            form = client.get("/accounts/login/")
            token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text)[1]
            client.post("/accounts/login/", data={
                "csrfmiddlewaretoken": token, "login": f"{user}@rigshare.test",
                "password": password}, headers={"Referer": url + "/accounts/login/"})
            assert client.get("/rentals/").status_code == 200, f"{user} could not log in"
            paths = list(DEMO_PAGES)
            paths += sorted(set(re.findall(r'href="(/rentals/\d+/)"',
                                           client.get("/rentals/").text)))
            paths += sorted(set(re.findall(r'href="(/cards/\d+/)"', client.get("/").text)))[:3]
            # The provider's own cards: each one's break-even calculator; their machines' pages.
            provider = client.get("/provider/").text
            paths += sorted(set(re.findall(r'href="(/provider/cards/\d+/break-even)"',
                                           provider)))[:3]
            paths += sorted(set(re.findall(r'href="(/provider/machines/\d+/)"', provider)))
            failed += [f"{path} as {user}: {status}" for path in paths
                       if (status := client.get(path).status_code) >= 500]
    return failed


def test_the_demo_runs_twice_on_the_same_clone(tmp_path, demo_database):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    banners = []
    for run in (1, 2):
        started = time.time()
        proc, out = start_demo(tmp_path, port, run, demo_database)
        banners.append(out)
        process: dict = {}
        try:
            # The machine really runs: it reports after this start, not only in the last one.
            deadline = time.monotonic() + 30
            while heartbeats_since(demo_database, started) < 2:
                assert time.monotonic() < deadline, f"run {run}: the fleet is not reporting"
                time.sleep(0.5)
            # One machine's agent runs its engine as its child: started, and answering.
            while (engine := own_engine(demo_database))[0] != "ready":
                assert time.monotonic() < deadline, f"run {run}: the Mac's engine: {engine}"
                time.sleep(0.5)
            state, process = engine
            assert process["mode"] == "command" and process["argv"][1:4] == [
                "-m", "fleetsim", "serve"] and running(process["pid"])
            key = re.search(r"^\s+(rs_\S+)$", out, re.M)[1]
            catalog = httpx.get(url + "/", timeout=30)
            assert catalog.status_code == 200
            assert catalog.text.count("RTX 4090") >= 2, out  # both cards of the machine
            # What fits: the fleet's 27B at 4-bit and 8,192 tokens fits a 24 GB card on its own,
            # so /tools/vram links the 4090 that is for rent (alice rents the other).
            fits = httpx.get(url + "/tools/vram", params={
                "model": "Qwen/Qwen3-27B", "context": 8192, "quant": "awq"}, timeout=30)
            assert fits.status_code == 200
            assert len(re.findall(r'<li data-card="\d+"><a href="/cards/\d+/">NVIDIA GeForce '
                                  r'RTX 4090</a>', fits.text)) == 1, fits.text
            models = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                               timeout=30)
            assert models.status_code == 200 and models.json()["object"] == "list"
            if run == 1:
                assert pages_that_fail(url) == []
            assert proc.poll() is None
        finally:
            stop_demo(proc)
        # Ctrl-C stopped the agent, and the agent its engine (in a session of its own).
        assert not running(process.get("pid")), f"run {run}: the Mac's engine outlived the demo"
    # The banner says what is true: how many of the machines reported since this start.
    assert all("2 of 2 simulated machines online and listed." in out for out in banners)
    state = tmp_path / "state"
    assert (state / "tokens").read_text() == "-,-"  # the second run reused the enrolments


@pytest.mark.e2e
def test_a_fleet_that_cannot_start_says_why_on_the_terminal(tmp_path, demo_database):
    env = demo_env(tmp_path, free_port(), demo_database, fleet="no-such-card")
    result = subprocess.run(["bash", "scripts/demo.sh"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=START_DEADLINE_S, start_new_session=True)
    assert result.returncode != 0
    assert "The simulated fleet stopped: fleetsim: unknown fleetsim profile 'no-such-card'" in (
        result.stderr), result.stdout + result.stderr
    assert BANNER not in result.stdout
