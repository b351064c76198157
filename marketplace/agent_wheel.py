"""The node agent as a wheel that the platform serves to providers (the Add-machine page).

Built in memory from this repository's agent/ sources, byte for byte the same from the same
sources (fixed timestamps, order and permissions), once per process: its sha256 is a stable
fact the page shows and pip checks through the download URL's `#sha256=` fragment. The wheel
holds the agent package and nothing else; its dependencies are pyproject's `agent` extra, the
one place they are pinned. No ORM here.
"""

import base64
import functools
import hashlib
import io
import re
import tomllib
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import agent

DIST_NAME = "rigshare-agent"
REPO_ROOT = Path(__file__).resolve().parent.parent
AGENT_DIR = Path(agent.__file__).resolve().parent
# The oldest Python the agent runs on (and is tested on); providers' machines may be newer.
REQUIRES_PYTHON = ">=3.11"
# ZIP's earliest date: a wheel built today and tomorrow from the same sources is the same.
ZIP_DATE = (1980, 1, 1, 0, 0, 0)
ZIP_FILE_MODE = 0o100644 << 16


@dataclass(frozen=True)
class Wheel:
    version: str
    filename: str
    data: bytes
    sha256: str


def agent_requirements(pyproject: Path = REPO_ROOT / "pyproject.toml") -> list[str]:
    """The `agent` extra of pyproject.toml: what pip installs with the agent. Where the platform
    runs from an installed package rather than a checkout, the package's metadata says it."""
    if not pyproject.exists():
        marker = re.compile(r"""\s*;\s*extra\s*==\s*["']agent["']\s*$""")
        return [marker.sub("", r) for r in metadata.requires("rigshare") or [] if marker.search(r)]
    with pyproject.open("rb") as f:
        return list(tomllib.load(f)["project"]["optional-dependencies"]["agent"])


@functools.cache
def agent_wheel() -> Wheel:
    """This platform's agent wheel, built on first use and kept for the process."""
    return build_wheel(AGENT_DIR, version=agent.__version__, requires=agent_requirements())


def build_wheel(source_dir: Path, *, version: str, requires: list[str]) -> Wheel:
    """A py3-none-any wheel of the package in `source_dir` (its .py files), installed as
    `agent` with a `rigshare-agent` command."""
    package = source_dir.name
    files = {f"{package}/{path.relative_to(source_dir).as_posix()}": path.read_bytes()
             for path in sorted(source_dir.rglob("*.py"))
             if "__pycache__" not in path.parts}
    stem = f"{DIST_NAME.replace('-', '_')}-{version}"
    dist_info = f"{stem}.dist-info"
    metadata = [
        "Metadata-Version: 2.1",
        f"Name: {DIST_NAME}",
        f"Version: {version}",
        "Summary: Rigshare node agent: reports a GPU machine and its engine to a Rigshare "
        "platform",
        f"Requires-Python: {REQUIRES_PYTHON}",
        *(f"Requires-Dist: {requirement}" for requirement in requires),
    ]
    files[f"{dist_info}/METADATA"] = _lines(metadata)
    files[f"{dist_info}/WHEEL"] = _lines([
        "Wheel-Version: 1.0", "Generator: rigshare (marketplace/agent_wheel.py)",
        "Root-Is-Purelib: true", "Tag: py3-none-any"])
    files[f"{dist_info}/entry_points.txt"] = _lines([
        "[console_scripts]", f"rigshare-agent = {package}.cli:main"])
    record = [f"{name},sha256={_digest(data)},{len(data)}" for name, data in files.items()]
    files[f"{dist_info}/RECORD"] = _lines([*record, f"{dist_info}/RECORD,,"])

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in files.items():  # sources first, dist-info last, as the spec asks
            info = zipfile.ZipInfo(name, date_time=ZIP_DATE)
            info.external_attr = ZIP_FILE_MODE
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data, compresslevel=9)
    data = buffer.getvalue()
    return Wheel(version=version, filename=f"{stem}-py3-none-any.whl", data=data,
                 sha256=hashlib.sha256(data).hexdigest())


def _lines(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
