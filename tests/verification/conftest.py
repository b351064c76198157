import pytest

from fleetsim.profiles import get_profile
from fleetsim.server import EngineServer, ServerThread
from verification import loadtest

SCALE = 3  # the simulated engine runs 3x faster than the card, so rates read 3x higher;
# faster still, and this process could not read 24,000 streamed tokens a second


@pytest.fixture
def h200_engine(settings, monkeypatch):
    settings.RIGSHARE_LOAD_TEST_LEVELS = (1, 8, 32)
    # Sped up, HTTP overhead (which does not scale) would hide a 4,000-word prefill.
    monkeypatch.setattr(loadtest, "PREFIX_WORDS", 20_000)
    with ServerThread(EngineServer(get_profile("h200"), time_scale=SCALE)) as server:
        yield server.url


