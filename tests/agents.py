"""Real node agents for tests: `python -m fleetsim agent ... run` processes that report to a live
platform (Django's live server or uvicorn on a thread) and run their simulated engines as their
children, as a provider's machine does; and the verification pipeline's steps run on them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.utils import timezone

from agent.credential import write_credential
from fleetsim.fleet import Machine, agent_run_args
from fleetsim.profiles import get_profile
from marketplace import services as marketplace
from marketplace.models import Node
from tests.engine import free_port
from verification import services
from verification.models import ProbeJob, VerificationRun

REPO = Path(__file__).resolve().parents[1]


class Agents:
    """start(profile key, machine id, own_engine=True, engine_key=False, engine_tls=False)
    enrols a simulated machine of `owner`'s and starts its agent (with `engine_key`, its engine
    answers only with the engine key the platform hands the agent; with `engine_tls`, over
    HTTPS with the certificate its agent makes); leaving the block stops every agent (their
    logs printed, for a test that failed)."""

    def __init__(self, platform_url: str, owner, tmp_path: Path):
        self.platform_url, self.owner, self.tmp_path = platform_url, owner, tmp_path
        self.env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
                    "PYTHONPATH": str(REPO)}
        self.started: list[tuple[subprocess.Popen, Path]] = []
        self.machines: dict[int, Machine] = {}

    def __enter__(self) -> Agents:
        return self

    def _spawn(self, args: list[str], log: Path) -> None:
        with open(log, "ab") as out:
            self.started.append((subprocess.Popen(args, cwd=REPO, stdout=out,
                                                  stderr=subprocess.STDOUT, env=self.env,
                                                  start_new_session=True), log))

    def start(self, key: str, machine_id: str, *, own_engine: bool = True,
              engine_key: bool = False, engine_tls: bool = False) -> int:
        _, token = marketplace.enrolment_token_create(owner=self.owner)
        enrolment = marketplace.node_enroll(token=token, hostname=machine_id,
                                            agent_version="0.1.0")
        credential = self.tmp_path / f"{machine_id}.json"
        write_credential(credential, {"platform": self.platform_url,
                                      "node_id": enrolment.node.pk,
                                      "credential": enrolment.credential})
        machine = Machine(machine_id, get_profile(key), free_port(), credential, None,
                          own_engine=own_engine, engine_key=engine_key, engine_tls=engine_tls)
        log = self.tmp_path / f"{machine_id}.log"
        if not own_engine:  # the provider runs the engine: the agent only reports on it
            self._spawn([sys.executable, "-m", "fleetsim", "serve", "--profile", key, "--port",
                         str(machine.port)], log)
        self._spawn([sys.executable, "-m", "fleetsim", "agent", "--profile", key,
                     "--machine-id", machine_id, *agent_run_args(machine)], log)
        self.machines[enrolment.node.pk] = machine
        return enrolment.node.pk

    def __exit__(self, *exc) -> None:
        for proc, _ in self.started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in self.started:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        for log in dict.fromkeys(log for _, log in self.started):
            print(f"\n--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}",
                  file=sys.stderr)


def wait_for(what: str, check, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:g} s")
        time.sleep(0.2)
    return found


def verify(node_id: int, run: VerificationRun | None = None) -> VerificationRun:
    """The node's run (by default its first), once its probes are in, through the pipeline's
    steps."""
    run = run or wait_for("verification run", lambda: VerificationRun.objects.filter(
        node_id=node_id).first())
    wait_for("probes answered", lambda: not ProbeJob.objects.filter(
        run=run, status="pending").exists())
    for _ in range(2):
        wait_for("engine ready", lambda: Node.objects.get(pk=node_id).engine_takes_work
                 and Node.objects.get(pk=node_id).engine_reachable)
        assert services.run_load_test(run_id=run.pk)
        if services.run_evaluate(run_id=run.pk):
            break
        # Serving read short is read again before a card is flagged on it: now, not later.
        run.refresh_from_db()
        assert run.status == "probing" and run.first_reading
        VerificationRun.objects.filter(pk=run.pk).update(measure_after=timezone.now())
        wait_for("the run ready for its second reading",
                 lambda: run.pk in services.runs_ready_for_load_test())
    assert services.run_publish(run_id=run.pk)
    run.refresh_from_db()
    return run
