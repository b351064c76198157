"""Jobs from heartbeat replies (docs/agent-protocol.md, section 3): one at a time, in one
background thread, so heartbeats go on while probes run; each outcome is posted once."""

import queue
import re
import threading
import time

import httpx

from agent import __version__, client

# Waits before each retry of a result post the platform could not take (network, 5xx).
RETRY_DELAYS_S = (2.0, 5.0, 15.0)
JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_STOP = object()


class JobRunner:
    """`offer(reply["jobs"])` after each heartbeat; `executors` maps a job kind to a function
    of its params returning the result (raising: the job failed)."""

    def __init__(self, *, platform: str, credential: str, executors: dict, log):
        self.platform = platform
        self.credential = credential
        self.executors = executors
        self.log = log
        self._queue = queue.Queue()
        self._lock = threading.Lock()
        self._seen = set()  # ids queued, running or finished: a job listed again is not rerun
        self._undelivered = {}  # id -> outcome the platform could not take; sent when relisted
        self._malformed = set()  # logged once, not once per heartbeat
        self._thread = None

    def offer(self, jobs) -> None:
        if not isinstance(jobs, list):
            return
        for job in jobs:
            job_id = job.get("id") if isinstance(job, dict) else None
            if not _valid_id(job_id):
                self._log_malformed(job)
                continue
            with self._lock:
                if job_id in self._undelivered:
                    self._queue.put(("post", job_id, self._undelivered.pop(job_id)))
                elif job_id not in self._seen:
                    self._seen.add(job_id)
                    self._queue.put(("run", job_id, job))
                else:
                    continue
            self._start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop after the job in hand; a probe still running is abandoned when the agent exits
        (the worker is a daemon thread) and the platform times the job out."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout)

    def _start(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="jobs", daemon=True)
            self._thread.start()

    def _log_malformed(self, job):
        text = repr(job)[:200]
        if text not in self._malformed:
            self._malformed.add(text)
            self.log(f"Ignoring a malformed job from the platform: {text}")

    def _work(self):
        with httpx.Client() as http:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    return
                action, job_id, payload = item
                outcome = self._execute(job_id, payload) if action == "run" else payload
                self._deliver(http, job_id, outcome)

    def _execute(self, job_id, job: dict) -> dict:
        kind = job.get("kind")
        params = job.get("params")
        execute = self.executors.get(kind)
        if execute is None:
            known = ", ".join(sorted(self.executors))
            self.log(f"Job {job_id}: unknown kind {kind!r}; answering failed.")
            return _failed(f"unknown job kind {kind!r}; agent {__version__} runs: {known}.")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            return _failed(f"params must be a JSON object, not {type(params).__name__}.")
        self.log(f"Job {job_id} ({kind}) started.")
        started = time.monotonic()
        try:
            result = execute(params)
        except Exception as exc:
            self.log(f"Job {job_id} ({kind}) failed: {client.describe(exc)}")
            return _failed(client.describe(exc))
        self.log(f"Job {job_id} ({kind}) done in {time.monotonic() - started:.1f} s.")
        return {"status": "done", "result": result, "error": None}

    def _deliver(self, http: httpx.Client, job_id, outcome: dict) -> None:
        delays = list(RETRY_DELAYS_S)
        while True:
            try:
                client.post_job_result(http, self.platform, self.credential, job_id, outcome)
            except client.Refused as exc:
                # 404 not ours, 409 answered already (the first answer stands), 400 malformed,
                # 401/403 the node is gone (the heartbeat stops the agent): posting it again
                # would get the same answer.
                self.log(f"Job {job_id}: result refused (HTTP {exc.status}): {exc}; dropped.")
                return
            except client.Unavailable as exc:
                if delays:
                    time.sleep(delays.pop(0))
                    continue
                with self._lock:
                    self._undelivered[job_id] = outcome
                self.log(f"Job {job_id}: result not delivered ({exc}); it is sent again if "
                         "the platform lists the job again.")
                return
            self.log(f"Job {job_id}: result posted ({outcome['status']}).")
            return


def _valid_id(job_id) -> bool:
    if isinstance(job_id, bool):
        return False
    if isinstance(job_id, int):
        return job_id >= 0
    return isinstance(job_id, str) and JOB_ID.fullmatch(job_id) is not None  # goes in a URL


def _failed(error: str) -> dict:
    return {"status": "failed", "result": None, "error": error[:client.MAX_STRING]}
