"""The agent's end of engine keys: kept in the state directory, the one before beside it, and
part of the engine's configuration wherever the command carries the key."""

import stat

from agent import supervisor
from agent.supervisor import KEY_PLACEHOLDER, Launch


def test_a_new_key_is_kept_with_the_previous_beside_it(tmp_path, monkeypatch):
    monkeypatch.delenv(supervisor.KEY_ENV, raising=False)
    state = tmp_path / "state"
    assert supervisor.engine_keys(state) == []
    assert supervisor.write_engine_key(state, "rsk_one")
    assert not supervisor.write_engine_key(state, "rsk_one")  # held already: nothing changes
    assert supervisor.write_engine_key(state, "rsk_two")
    assert supervisor.engine_keys(state) == ["rsk_two", "rsk_one"]
    for name in (supervisor.KEY_FILE, supervisor.PREVIOUS_KEY_FILE):
        assert stat.S_IMODE((state / name).stat().st_mode) == 0o600
    assert supervisor.key_fingerprint("rsk_two") == supervisor.key_fingerprint("rsk_two")
    assert len(supervisor.key_fingerprint("rsk_two")) == 16
    assert supervisor.key_fingerprint(None) is None


def test_the_key_is_part_of_the_configuration_only_where_the_command_carries_it():
    keyed = ("vllm", "serve", "m", "--api-key", KEY_PLACEHOLDER)
    plain = ("vllm", "serve", "m")
    assert supervisor._keyed(keyed, "aaaa") == "aaaa" and supervisor._keyed(plain, "aaaa") is None
    one = Launch(keyed, "platform", "v1", key_fingerprint="aaaa")
    two = Launch(keyed, "platform", "v1", key_fingerprint="bbbb")
    assert one.digest != two.digest  # a new key drains and restarts the engine
    assert Launch(plain, "command").digest == Launch(plain, "command").digest


def test_the_supervisor_asks_its_engine_with_the_key_it_was_started_with(tmp_path, monkeypatch):
    monkeypatch.delenv(supervisor.KEY_ENV, raising=False)
    state = tmp_path / "state"
    supervisor.write_engine_key(state, "rsk_old")
    supervisor.write_engine_key(state, "rsk_new")
    sup = supervisor.Supervisor(state_dir=state, engine_url="http://127.0.0.1:9",
                                command=["engine", "--api-key", KEY_PLACEHOLDER])
    assert sup.headers() == {"Authorization": "Bearer rsk_new"}  # none runs: the newest
    sup._running = supervisor._Running(digest="d", mode="command", version=None, argv=[],
                                       key_fingerprint=supervisor.key_fingerprint("rsk_old"))
    # Draining on the old key: its own calls still use it.
    assert sup.headers() == {"Authorization": "Bearer rsk_old"}
    assert sup.key_in_use() == supervisor.key_fingerprint("rsk_old")
    assert sup._wanted().key_fingerprint == supervisor.key_fingerprint("rsk_new")
    sup._http.close()
