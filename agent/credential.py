"""The node credential on disk: {"platform", "node_id", "credential"}, for its owner's eyes only."""

import json
import os
import tempfile
from pathlib import Path

DEFAULT_CREDENTIAL_FILE = "~/.config/rigshare/agent.json"


class CredentialError(Exception):
    pass


def write_credential(path: Path, data: dict) -> None:
    """Write through a temp file in the same directory: mkstemp creates it 0600, so the secret
    is never readable by others, not even between create and chmod, and os.replace swaps it in
    whole, so a crash never leaves half a credential."""
    _make_private_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read_credential(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CredentialError(
            f"No credential at {path}; enrol first: "
            "python -m agent enroll --platform URL --token TOKEN"
        ) from None
    except (OSError, ValueError) as exc:
        raise CredentialError(f"Cannot read the credential file {path}: {exc}") from None
    if not (
        isinstance(data, dict)
        and isinstance(data.get("platform"), str)
        and isinstance(data.get("credential"), str)
        and "node_id" in data
    ):
        raise CredentialError(f"The credential file {path} is not valid; enrol again.")
    return data


def _make_private_dirs(directory: Path) -> None:
    # Only directories we create are made 0700; existing ones are the owner's choice.
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for d in reversed(missing):
        os.mkdir(d, 0o700)
