import httpx
import pytest

from fleetsim.profiles import get_profile
from fleetsim.server import EngineServer, ServerThread


@pytest.fixture(scope="session")
def _servers():
    """Every engine server the session started, joined at the end. uvicorn takes ~0.2 s to
    stop, so each test only asks its servers to stop and the next test does not wait."""
    servers: list[ServerThread] = []
    yield servers
    for server in servers:
        server.__exit__(None, None, None)


@pytest.fixture
def engine(_servers):
    """engine(profile_key, **EngineServer options) -> (base URL, EngineServer): a fresh app on
    a real uvicorn server on 127.0.0.1 with an OS-assigned port."""
    mine: list[ServerThread] = []

    def start(key: str, **options):
        app = EngineServer(get_profile(key), **options)
        server = ServerThread(app).__enter__()
        mine.append(server)
        _servers.append(server)
        return server.url, app

    yield start
    for server in mine:
        server.server.should_exit = True


@pytest.fixture(scope="session")
def client():
    # One client for the session: creating an httpx.Client loads CA certificates (~0.2 s).
    with httpx.Client(timeout=10) as c:
        yield c
