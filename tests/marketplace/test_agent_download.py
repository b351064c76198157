"""The node agent as the platform serves it: a wheel built from agent/, its sha256 on the
Add-machine page, and the page's install command run for real in a clean virtualenv."""

import hashlib
import html
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile

import pytest
from django.urls import reverse

import agent
from marketplace.agent_wheel import AGENT_DIR, agent_requirements, agent_wheel, build_wheel


def pre(page, element_id: str) -> str:
    found = re.search(rf'<pre id="{element_id}">(.*?)</pre>', page.content.decode(), re.S)
    assert found, element_id
    return html.unescape(found[1]).strip()


def test_the_wheel_is_the_agent_and_its_pinned_dependencies():
    wheel = agent_wheel()
    assert wheel.filename == f"rigshare_agent-{agent.__version__}-py3-none-any.whl"
    archive = zipfile.ZipFile(io.BytesIO(wheel.data))
    names = archive.namelist()
    sources = sorted(f"agent/{p.name}" for p in AGENT_DIR.glob("*.py"))
    dist_info = f"rigshare_agent-{agent.__version__}.dist-info"
    assert names == [*sources, f"{dist_info}/METADATA", f"{dist_info}/WHEEL",
                     f"{dist_info}/entry_points.txt", f"{dist_info}/RECORD"]
    metadata = archive.read(f"{dist_info}/METADATA").decode()
    # One place for the pins: pyproject's `agent` extra.
    assert agent_requirements() == ["httpx==0.28.1", "nvidia-ml-py==13.615.71",
                                    "cryptography==50.0.2"]
    assert [line.split(": ", 1)[1] for line in metadata.splitlines()
            if line.startswith("Requires-Dist")] == agent_requirements()
    assert hashlib.sha256(wheel.data).hexdigest() == wheel.sha256


def test_the_wheel_is_built_the_same_from_the_same_sources(tmp_path):
    copy = tmp_path / "agent"
    shutil.copytree(AGENT_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for path in copy.iterdir():
        os.utime(path, (1_900_000_000, 1_900_000_000))  # other times than the originals
    (copy / "__pycache__").mkdir()
    (copy / "__pycache__" / "cli.cpython-311.pyc").write_bytes(b"compiled")
    built = build_wheel(copy, version=agent.__version__, requires=agent_requirements())
    assert built == agent_wheel()
    (copy / "cli.py").write_text((copy / "cli.py").read_text() + "\n# changed\n")
    assert build_wheel(copy, version=agent.__version__,
                       requires=agent_requirements()).sha256 != built.sha256


def test_anyone_downloads_the_current_version_only(client):
    wheel = agent_wheel()
    url = reverse("marketplace:agent_download", args=[wheel.filename])
    response = client.get(url)  # no session: pip on the provider's machine has none
    assert response.status_code == 200
    assert response.content == wheel.data
    assert response["ETag"] == f'"{wheel.sha256}"'
    assert client.get(url.replace(agent.__version__, "0.0.1")).status_code == 404
    assert client.post(url).status_code == 405


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_the_pages_install_command_installs_a_working_agent_in_a_clean_venv(
        client, bob, live_server, settings, tmp_path):
    settings.RIGSHARE_PUBLIC_URL = live_server.url
    client.force_login(bob)
    page = client.post(reverse("marketplace:machine_add"))
    assert page.status_code == 200
    wheel = agent_wheel()
    assert re.search(rf'<code id="agent-sha256">{wheel.sha256}</code>', page.content.decode())
    command = shlex.split(pre(page, "install-command"))
    assert command == ["pip", "install", f"{live_server.url}/downloads/agent/{wheel.filename}"
                                         f"#sha256={wheel.sha256}"]

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "DJANGO_SETTINGS_MODULE")}

    def run(*argv):
        # Outside the repository, so nothing of it can be imported by accident.
        return subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    installed = run("python", "-m", "pip", "install", "--disable-pip-version-check",
                    *command[2:])
    assert installed.returncode == 0, installed.stdout + installed.stderr
    version = run("python", "-m", "agent", "--version")
    assert (version.returncode, version.stdout.strip()) == (0, agent.__version__), version.stderr
    facts = run("rigshare-agent", "facts")  # the console script; this machine has no GPU
    assert facts.returncode == 0, facts.stderr
    assert '"nvidia": false' in facts.stdout
    assert facts.stderr.count("No NVIDIA GPU found") == 1
    simulator = run("python", "-c", "import fleetsim")
    assert simulator.returncode == 1 and "No module named 'fleetsim'" in simulator.stderr

    # pip checks the #sha256= fragment: a wheel with other bytes is refused.
    tampered = command[2].rsplit("=", 1)[0] + "=" + "0" * 64
    refused = run("python", "-m", "pip", "install", "--disable-pip-version-check",
                  "--force-reinstall", "--no-deps", tampered)
    assert refused.returncode != 0 and "HASH" in refused.stderr.upper()
