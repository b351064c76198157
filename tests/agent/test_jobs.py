"""Jobs from heartbeat replies (docs/agent-protocol.md, section 3) against a real local HTTP
platform: run once in the background while heartbeats go on, the result posted once."""

import sys
import threading
import time

import pytest

from agent import probe_jobs, probes
from agent.cli import main
from tests.agent.conftest import NODE_REPLY

PROBES_JOB = {"id": 41, "kind": "probes", "params": {"warmup_s": 1.0, "iterations": 20,
                                                     "matmul_n": 8192, "copy_bytes": 268435456}}
RESULT_PATH = "/api/agent/jobs/41/result/"
FAKE_RESULT = {"device": "cuda", "kernel_release": "6.8.0-45-generic", "wsl": False,
               "gpus": [], "errors": []}


class JobPlatform:
    """Lists `jobs` in every heartbeat reply (every 0.02 s), answers result posts with
    `result_replies` in turn (the last one repeated), and once `results` posts have arrived
    keeps listing the jobs for `linger` more heartbeats (a platform that lags) before it
    answers 403, which ends the agent's loop."""

    def __init__(self, server, jobs, *, result_replies=((200, {}),), results=1, linger=2):
        self.server = server
        self.jobs = jobs
        self.result_replies = list(result_replies)
        self.expected_results = results
        self.linger = linger
        self.beats_after_result = 0
        server.respond = self.respond

    def respond(self, request):
        if request.path.startswith("/api/agent/jobs/"):
            reply = self.result_replies[0]
            if len(self.result_replies) > 1:
                self.result_replies.pop(0)
            return reply
        if len(self.results()) >= self.expected_results:
            self.beats_after_result += 1
            if self.beats_after_result > self.linger:
                return 403, {"detail": "enough"}
        if len(self.heartbeats()) > 400:  # a test that went wrong must still end
            return 403, {"detail": "runaway"}
        return 200, {**NODE_REPLY, "heartbeat_interval_s": 0.02, "jobs": self.jobs}

    def heartbeats(self):
        return [r for r in self.server.requests if r.path == "/api/agent/heartbeat/"]

    def results(self):
        return [r for r in self.server.requests if r.path.startswith("/api/agent/jobs/")]


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(probe_jobs, "RETRY_DELAYS_S", (0.01, 0.01))


@pytest.fixture
def probe_calls(monkeypatch):
    """run_probes standing in for the real one: takes 0.15 s (several heartbeats)."""
    calls = []

    def run_probes(params, *, nvml=None, device=None, log=None):
        calls.append({"params": params, "nvml": nvml, "thread": threading.current_thread()})
        time.sleep(0.15)
        return FAKE_RESULT

    monkeypatch.setattr(probes, "run_probes", run_probes)
    return calls


def run_agent(credential_file, engine_url, *extra):
    return main(["run", "--engine-url", engine_url, "--credential-file", str(credential_file),
                 "--interval", "0.05", *extra])


def test_a_job_runs_once_in_the_background_and_its_result_is_posted(
        platform, engine, credential_file, h200_machine, probe_calls, capsys):
    malformed = [{"kind": "probes"}, {"id": "../../x", "kind": "probes"}, "junk"]
    jobs = JobPlatform(platform, [*malformed, PROBES_JOB])
    assert run_agent(credential_file, engine.url) == 1  # the 403 at the end
    [call] = probe_calls  # listed in ~10 heartbeats, run once
    assert call["params"] == PROBES_JOB["params"]
    assert call["nvml"] is h200_machine
    assert call["thread"] is not threading.main_thread()
    [result] = jobs.results()
    assert (result.method, result.path) == ("POST", RESULT_PATH)
    assert result.headers["Authorization"] == "Bearer rsn_secret"
    assert result.body == {"status": "done", "result": FAKE_RESULT, "error": None}
    # Heartbeats went on while the probes ran (0.15 s at 0.02 s intervals).
    during = [h for h in jobs.heartbeats() if h.at < result.at]
    assert len(during) >= 3
    err = capsys.readouterr().err
    assert "Job 41 (probes) started." in err and "Job 41: result posted (done)." in err
    # Skipped, and said once rather than at every heartbeat that lists them.
    assert err.count("Ignoring a malformed job from the platform: {'kind': 'probes'}") == 1
    assert "Ignoring a malformed job from the platform: 'junk'" in err


def test_a_failing_probe_posts_failed(platform, engine, credential_file, h200_machine,
                                      monkeypatch):
    def broken(params, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(probes, "run_probes", broken)
    jobs = JobPlatform(platform, [PROBES_JOB])
    assert run_agent(credential_file, engine.url) == 1
    [result] = jobs.results()
    assert result.body == {
        "status": "failed", "result": None,
        "error": "RuntimeError: CUDA error: an illegal memory access was encountered"}


def test_an_unknown_kind_and_bad_params_post_failed(platform, engine, credential_file,
                                                     h200_machine):
    jobs = JobPlatform(platform, [{"id": 42, "kind": "burn-in", "params": {}},
                                  {**PROBES_JOB, "params": {"iterations": 0}}], results=2)
    assert run_agent(credential_file, engine.url) == 1
    unknown, bad_params = jobs.results()
    assert unknown.path == "/api/agent/jobs/42/result/"
    assert unknown.body["status"] == "failed" and unknown.body["result"] is None
    assert unknown.body["error"].startswith("unknown job kind 'burn-in'")
    assert bad_params.path == RESULT_PATH and bad_params.body["status"] == "failed"
    assert "params.iterations must be an integer from 1 to 1000" in bad_params.body["error"]


def test_a_refused_result_is_not_posted_again(platform, engine, credential_file, h200_machine,
                                              probe_calls, capsys):
    # 409: answered already, the first answer stands (404, not this node's job, goes the same
    # way).
    jobs = JobPlatform(platform, [PROBES_JOB],
                       result_replies=[(409, {"detail": "This job has an answer."})])
    assert run_agent(credential_file, engine.url) == 1
    assert len(jobs.results()) == 1 and len(probe_calls) == 1
    assert ("Job 41: result refused (HTTP 409): This job has an answer.; dropped."
            in capsys.readouterr().err)


def test_an_undelivered_result_is_sent_when_the_job_is_listed_again(
        platform, engine, credential_file, h200_machine, probe_calls, capsys):
    # A post and its two retries (network errors and 5xx are retried) meet 503s; the next
    # listing of the job sends the result again, and does not run the job again.
    jobs = JobPlatform(platform, [PROBES_JOB],
                       result_replies=[(503, {}), (502, {}), (503, {}), (200, {})], results=4)
    assert run_agent(credential_file, engine.url) == 1
    assert [r.body["status"] for r in jobs.results()] == ["done"] * 4
    assert len(probe_calls) == 1
    err = capsys.readouterr().err
    assert err.count("Job 41: result not delivered (platform answered HTTP 503)") == 1
    assert err.count("Job 41: result posted (done).") == 1


def test_two_jobs_run_one_after_the_other(platform, engine, credential_file, h200_machine,
                                          probe_calls):
    second = {**PROBES_JOB, "id": 43}
    jobs = JobPlatform(platform, [PROBES_JOB, second], results=2)
    assert run_agent(credential_file, engine.url) == 1
    assert [r.path for r in jobs.results()] == [RESULT_PATH, "/api/agent/jobs/43/result/"]
    assert len(probe_calls) == 2
    assert jobs.results()[1].at - jobs.results()[0].at >= 0.15  # not side by side


def test_once_runs_no_job(platform, engine, credential_file, h200_machine, probe_calls, capsys):
    JobPlatform(platform, [PROBES_JOB])
    assert run_agent(credential_file, engine.url, "--once") == 0
    assert probe_calls == []
    assert "1 job(s) left for run" in capsys.readouterr().err


def test_the_real_probes_without_torch(platform, engine, credential_file, h200_machine,
                                       monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    jobs = JobPlatform(platform, [PROBES_JOB])
    assert run_agent(credential_file, engine.url) == 1
    [result] = jobs.results()
    assert result.body["status"] == "done"
    assert result.body["result"]["device"] == "none"
    assert result.body["result"]["message"].startswith("no GPU: torch is not installed")


def test_probes_of_a_handed_machine(platform, engine, credential_file, monkeypatch):
    asked = []

    class Simulated:
        def hostname(self):
            return "sim-1"

        def facts(self):
            return {"os": "Linux 6.8", "simulated": True, "nvidia": False,
                    "driver_version": None, "cuda_version": None, "gpus": []}, None

        def probes(self, params, *, device=None, log=None):
            asked.append(params)
            return FAKE_RESULT

    monkeypatch.setattr(probes, "run_probes", lambda *a, **k: pytest.fail("measured"))
    jobs = JobPlatform(platform, [PROBES_JOB])
    assert main(["run", "--engine-url", engine.url, "--credential-file", str(credential_file),
                 "--interval", "0.05"], machine=Simulated()) == 1
    assert asked == [PROBES_JOB["params"]]
    [result] = jobs.results()
    assert result.body == {"status": "done", "result": FAKE_RESULT, "error": None}
