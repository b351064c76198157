import threading
from datetime import timedelta

import pytest
from django.db import connection

from fleetsim.__main__ import build_parser
from fleetsim.machine import simulated_engine_argv
from fleetsim.physics import SPEC_TOKENS_PER_PASS
from fleetsim.profiles import Profile, get_profile
from fleetsim.server import EngineServer, ServerThread
from marketplace import services as marketplace
from verification import loadtest, services

SCALE = 3  # the simulated engine runs 3x faster than the card, so rates read 3x higher;
# faster still, and this process could not read 24,000 streamed tokens a second


class SwitchingEngine:
    """One machine's simulated engine as an ASGI app, which the agent's part below switches to
    the platform's yardstick and back, as the agent's supervisor restarts a real engine."""

    def __init__(self, profile: Profile, time_scale: float = SCALE):
        self.profile, self.time_scale = profile, time_scale
        self.own = self.app = EngineServer(profile, time_scale=time_scale)

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)

    def serve(self, argv: list[str]) -> None:
        """Serve what the platform's engine command asks (fleetsim's reading of it)."""
        words = simulated_engine_argv(argv, self.profile.key, time_scale=self.time_scale)
        args = build_parser().parse_args(words[3:])
        served = self.profile.serving(
            args.model, args.quantization, engine=args.engine, tp=args.tensor_parallel_size,
            context_length=args.max_model_len, max_concurrency=args.max_concurrency,
            tokens_per_pass=SPEC_TOKENS_PER_PASS if args.speculative else None)
        self.app = EngineServer(served, time_scale=self.time_scale)

    def restore(self) -> None:
        self.app = self.own


class YardstickAgent(threading.Thread):
    """The node agent's part in the yardstick, through the heartbeat service: it reports the
    engine it runs every `every` s, and when the platform asks for the yardstick
    (yardstick_for_agent, what the heartbeat answer carries) it switches the engine and says
    so; when the platform no longer asks, the engine is its own again. What the real agent does
    with a real engine is tests/verification/test_yardstick_agents.py's."""

    def __init__(self, node_id: int, engine: SwitchingEngine, report: dict, every=0.2):
        super().__init__(daemon=True)
        self.node_id, self.engine, self.report, self.every = node_id, engine, report, every
        self.stop = threading.Event()
        self.served_yardstick = False
        self.failure: BaseException | None = None

    def run(self):
        serving = None
        try:
            while not self.stop.is_set():
                asked = services.yardstick_for_agent(node_id=self.node_id)
                if asked and serving != asked["run"]:
                    self.engine.serve(asked["config"]["argv"])
                    serving, self.served_yardstick = asked["run"], True
                elif not asked and serving is not None:
                    self.engine.restore()
                    serving = None
                supervisor = {"state": "ready", "mode": "command", "argv": ["engine"]}
                if serving is not None:
                    supervisor["yardstick"] = {"run": serving,
                                               "version": asked["config"]["version"]}
                report = {**self.report, "engine": {**self.report["engine"],
                                                    "supervisor": supervisor}}
                marketplace.node_heartbeat_record(node_id=self.node_id, report=report)
                self.stop.wait(self.every)
        except BaseException as exc:  # the test says so rather than wait for a switch
            self.failure = exc
        finally:
            connection.close()


@pytest.fixture
def h200_engine(settings, monkeypatch):
    settings.RIGSHARE_LOAD_TEST_LEVELS = (1, 8, 32)
    # Sped up, HTTP overhead (which does not scale) would hide a 4,000-word prefill.
    monkeypatch.setattr(loadtest, "PREFIX_WORDS", 20_000)
    with ServerThread(EngineServer(get_profile("h200"), time_scale=SCALE)) as server:
        yield server.url


@pytest.fixture
def switching_h200(settings, monkeypatch, gpu_specs):
    """An H200's engine that its agent (a YardstickAgent) switches to the yardstick and back:
    (url, engine)."""
    settings.RIGSHARE_LOAD_TEST_LEVELS = (1, 8, 32)
    settings.RIGSHARE_YARDSTICK_READY = timedelta(seconds=30)
    monkeypatch.setattr(loadtest, "PREFIX_WORDS", 20_000)
    engine = SwitchingEngine(get_profile("h200"))
    with ServerThread(engine) as server:
        yield server.url, engine
