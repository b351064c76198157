"""A simulated machine's GPU power draw: idle when its engine runs nothing, near its power limit
(FACTS.md's spec table) under load, from its profile; and what the real agent sends for it."""

import threading
import time

import httpx
import pytest

from fleetsim.machine import SimulatedMachine, engine_running
from fleetsim.profiles import get_profile, power_draw_w


@pytest.mark.parametrize(("key", "running", "watts"), [
    # Idle: the card's own idle figure.
    ("2x-rtx-4090", 0, 25),
    # Its top measured load (32): 90% of the RTX 4090's 450 W limit, 405 W.
    ("2x-rtx-4090", 32, 405),
    # One stream: half the way up, plus half of 94/435 of the rest:
    # 25 + 380 x (0.5 + 0.5 x 0.2161) = 256.1.
    ("2x-rtx-4090", 1, 256),
    # The H200 (700 W) at its top load, 128: 630 W; idle 80.
    ("h200", 128, 630), ("h200", 0, 80),
    # Capped at 250 W by its owner: 25 + (225 - 25) = 225 at full load.
    ("liar-power-capped", 32, 225),
    # No busier than its top measured load: 64 running draws what 32 does.
    ("rtx-4090", 64, 405),
    # A Mac: NVML reads no power.
    ("m4-max-llamacpp", 2, None),
])
def test_the_draw_follows_the_load(key, running, watts):
    assert power_draw_w(get_profile(key), running) == watts


def test_the_machine_reads_its_engines_batch(engine, client):
    """Idle with nothing running; with requests in flight, each GPU draws what the batch
    says; idle again once they are done."""
    url, app = engine("2x-rtx-4090")
    machine = SimulatedMachine("2x-rtx-4090", "box-1", engine_url=url)
    assert machine.power_draw() == {0: 25, 1: 25}

    def ask():
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
                "model": app.profile.model, "stream": True, "max_tokens": 64,
                "messages": [{"role": "user", "content": "hello"}]}) as response:
            for _ in response.iter_lines():
                pass

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while engine_running(url) < 4:
        assert time.monotonic() < deadline, "the requests never ran"
        time.sleep(0.05)
    under_load = power_draw_w(app.profile, 4)
    assert 25 < under_load < 405
    assert machine.power_draw() == {0: under_load, 1: under_load}
    for thread in threads:
        thread.join()
    assert machine.power_draw() == {0: 25, 1: 25}


def test_an_engine_that_cannot_be_asked_reads_as_idle():
    assert engine_running(None) == 0
    assert engine_running("http://127.0.0.1:9") == 0  # nothing listens there
    assert SimulatedMachine("h200", "m1").power_draw() == {0: 80}
    assert SimulatedMachine("m4-max-llamacpp", "m1").power_draw() == {}
