"""Behind a real reverse proxy: nginx in front of uvicorn (two workers), as a load balancer is
in front of production, RIGSHARE_TRUSTED_PROXIES=1. uvicorn does not trust the proxy's headers
itself here (FORWARDED_ALLOW_IPS names another host, as when the balancer is not on the web
machine), so every connection the platform sees comes from the proxy's address; clients come
from their own loopback addresses (127.0.0.2, 127.0.0.3). What limits, locks out and records
by address must see each client, never the proxy, and never what a client wrote itself."""

import re
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from axes.models import AccessAttempt
from django.conf import global_settings
from django.db import connection

from accounts.models import LoginDevice, User
from tests.conftest import PASSWORD
from tests.deployment import Deployment, free_port, wait_for_port

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

ATTACKER, HONEST, DIRECT = "127.0.0.2", "127.0.0.3", "127.0.0.4"


@contextmanager
def nginx_in_front(upstream_port: int, directory: Path):
    """nginx on a port of its own, passing every request to the upstream and appending the
    address it was reached from to X-Forwarded-For, as a load balancer does."""
    port = free_port()
    conf = directory / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
pid {directory}/nginx.pid;
error_log {directory}/nginx-error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {directory}/nginx-body;
    proxy_temp_path {directory}/nginx-proxy;
    fastcgi_temp_path {directory}/nginx-fastcgi;
    uwsgi_temp_path {directory}/nginx-uwsgi;
    scgi_temp_path {directory}/nginx-scgi;
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://127.0.0.1:{upstream_port};
            proxy_set_header Host $http_host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
        }}
    }}
}}
""")
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    process = subprocess.Popen([nginx, "-p", str(directory), "-c", str(conf), "-g",
                                "daemon off;"], stderr=subprocess.STDOUT,
                               stdout=open(directory / "nginx.log", "w"))  # noqa: SIM115
    try:
        wait_for_port(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


def browser(base: str, source: str) -> httpx.Client:
    return httpx.Client(base_url=base, timeout=30, transport=httpx.HTTPTransport(
        local_address=source), headers={"user-agent": f"Browser at {source}"})


def log_in(client: httpx.Client, email: str, password: str, **headers) -> httpx.Response:
    page = client.get("/accounts/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    return client.post("/accounts/login/", data={"login": email, "password": password,
                                                  "csrfmiddlewaretoken": token},
                       headers={"referer": str(page.url), **headers})


@pytest.fixture
def honest(settings):
    # The deployment checks passwords with the platform's hashers, not the tests' fast one.
    settings.PASSWORD_HASHERS = global_settings.PASSWORD_HASHERS
    return User.objects.create_user("honest@example.com", PASSWORD)


def test_limits_and_lockouts_count_each_client_behind_the_proxy(pg_gate, redis_server, tmp_path,
                                                                settings, honest):
    deployment = Deployment(database=connection.settings_dict["NAME"], gate=pg_gate,
                            redis_url=redis_server.url, directory=tmp_path,
                            env={"RIGSHARE_TRUSTED_PROXIES": "1",
                                 "RIGSHARE_TRUSTED_PROXY_NETWORKS": "127.0.0.1/32",
                                 "FORWARDED_ALLOW_IPS": "192.0.2.1"}).start()
    try:
        with nginx_in_front(deployment.port, tmp_path) as site, \
                browser(site, ATTACKER) as attacker, browser(site, HONEST) as user, \
                browser(f"http://127.0.0.1:{deployment.port}", DIRECT) as direct:
            # One client spends the log-in limit of its address (allauth: 10 failures a
            # minute), forging the header its proxy would write, to pass for someone else.
            answers = [log_in(attacker, f"guess{i}@example.com", "wrong",
                              **{"x-forwarded-for": HONEST}).text for i in range(12)]
            assert "Too many failed login attempts" not in answers[0]
            assert "Too many failed login attempts" in answers[-1]
            # Another reaches a replica directly, past the proxy, and writes the header as the
            # proxy would: it is not the proxy, so nothing it says of the client is believed.
            answers = [log_in(direct, f"guess{i}@example.com", "wrong",
                              **{"x-forwarded-for": HONEST}).text for i in range(12)]
            assert "Too many failed login attempts" in answers[-1]
            # Another client, behind the same proxy, is not limited by it.
            answer = log_in(user, honest.email, PASSWORD)
            assert answer.status_code == 302 and answer.headers["location"] != "/accounts/login/"
            assert user.get("/accounts/").status_code == 200
    finally:
        deployment.stop()
    # django-axes counted the failures against the attacker's address, the forged one ignored.
    assert set(AccessAttempt.objects.values_list("ip_address", flat=True)) == {ATTACKER, DIRECT}
    # The log-in's device (what security emails name) is at the honest client's address.
    assert list(LoginDevice.objects.filter(user=honest).values_list("ip", flat=True)) == [HONEST]
