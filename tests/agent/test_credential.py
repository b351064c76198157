import os
import stat

import pytest

from agent import credential
from agent.credential import CredentialError, read_credential, write_credential

NODE = {"platform": "https://rigshare.example", "node_id": 7, "credential": "rsn_secret"}


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def permissive_umask():
    # umask 0 would make a carelessly created file 0666: the modes must not rely on the umask.
    old = os.umask(0)
    yield
    os.umask(old)


def test_credential_file_is_0600_in_new_0700_dirs_and_round_trips(tmp_path, permissive_umask):
    path = tmp_path / "config" / "rigshare" / "agent.json"
    write_credential(path, NODE)
    assert mode(path) == 0o600
    assert mode(tmp_path / "config") == 0o700
    assert mode(tmp_path / "config" / "rigshare") == 0o700
    assert read_credential(path) == NODE
    assert os.listdir(path.parent) == ["agent.json"]  # no temp file left behind


def test_the_secret_is_never_readable_by_others_even_before_it_is_in_place(
    tmp_path, permissive_umask, monkeypatch
):
    modes_before_replace = []
    real_replace = os.replace

    def replace(src, dst):
        modes_before_replace.append(mode(src))
        real_replace(src, dst)

    monkeypatch.setattr(credential.os, "replace", replace)
    write_credential(tmp_path / "agent.json", NODE)
    assert modes_before_replace == [0o600]


def test_replacing_a_readable_file_leaves_a_private_one(tmp_path, permissive_umask):
    path = tmp_path / "agent.json"
    path.write_text("{}")
    path.chmod(0o644)
    write_credential(path, NODE)
    assert mode(path) == 0o600
    assert read_credential(path) == NODE


def test_existing_directories_are_left_alone(tmp_path):
    tmp_path.chmod(0o755)
    write_credential(tmp_path / "agent.json", NODE)
    assert mode(tmp_path) == 0o755


def test_missing_credential_says_to_enrol(tmp_path):
    with pytest.raises(CredentialError, match="enrol first: python -m agent enroll"):
        read_credential(tmp_path / "agent.json")


@pytest.mark.parametrize("content", ["not json", '{"platform": "https://x"}', "[]"])
def test_broken_credential_file_is_refused(tmp_path, content):
    path = tmp_path / "agent.json"
    path.write_text(content)
    with pytest.raises(CredentialError, match=str(path)):
        read_credential(path)
