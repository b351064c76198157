"""Browser and fleet fixtures for the end-to-end tests.

The browser is Debian's chromium driven by Playwright's sync API; the machine is a real
`python -m fleetsim up` process (engine server plus the real node agent) that reaches the
live server over HTTP, so the whole onboarding path runs as in production.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
# This machine has no network: without these flags Chromium's own background connections
# (updates, sync, QUIC probes) fail noisily and slow the start.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
VIEWPORT = {"width": 1280, "height": 800}
# How long the browser waits for an element or a navigation before failing.
BROWSER_TIMEOUT_MS = 10_000


@pytest.fixture
def page(live_server, monkeypatch):
    """A fresh Chromium page; closed before the database is flushed."""
    from django.contrib.staticfiles.handlers import StaticFilesHandler
    from django.db import connections
    from playwright import sync_api

    # The live server's own static handler finds only the source names; the pages link the
    # hashed names of collectstatic, which WhiteNoise serves (compressed, cached) as in
    # production.
    monkeypatch.setattr(StaticFilesHandler, "_should_handle", lambda self, path: False)

    if not Path(CHROMIUM).exists():
        # A missing browser is a broken set-up, not a reason to skip: `make test` installs it.
        pytest.fail(f"{CHROMIUM} is not installed: run `make chromium` (Debian's package).")
    # Playwright's sync API keeps an event loop in this thread, and Django refuses ORM calls
    # from a thread with a running loop unless told that this is deliberate.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport=VIEWPORT, base_url=live_server.url)
            context.set_default_timeout(BROWSER_TIMEOUT_MS)
            sync_api.expect.set_options(timeout=BROWSER_TIMEOUT_MS)
            yield context.new_page()
            context.close()
        finally:
            browser.close()
            # ORM calls made while Playwright's loop runs get their own connection (Django
            # keeps connections per async context); close it here or it outlives the test and
            # keeps the test database from being dropped.
            connections.close_all()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Fleet:
    """Starts `python -m fleetsim up` in its own process group; stop() ends the whole group."""

    def __init__(self, state_dir: Path, log_path: Path):
        self.state_dir = state_dir
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, *, platform: str, profile: str, token: str) -> subprocess.Popen:
        assert self.proc is None, "one fleet per test"
        args = [sys.executable, "-m", "fleetsim", "up", "--platform", platform,
                "--profiles", profile, "--tokens", token, "--state-dir", str(self.state_dir),
                "--base-port", str(free_port()), "--time-scale", "50",
                # The agent runs the engine, so verification can switch it to its yardstick.
                "--agent-engines", "all"]
        with open(self.log_path, "wb") as log:
            # A new session makes fleetsim and its agent one process group, killed together.
            self.proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self.proc

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid  # the session leader's pid is the group id
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            # fleetsim has exited; make sure no agent of its group outlived it.
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break


@pytest.fixture
def fleet(tmp_path, request):
    fleet = Fleet(tmp_path / "fleetsim", tmp_path / "fleetsim.log")
    yield fleet
    fleet.stop()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(f"\n--- fleetsim output ---\n{fleet.log()}", file=sys.stderr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # Lets fixtures see whether the test body failed (to print the fleet's log then).
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture
def screenshot_dir() -> Path:
    directory = REPO / "docs" / "img"
    directory.mkdir(parents=True, exist_ok=True)
    return directory

