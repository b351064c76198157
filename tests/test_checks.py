"""Django's system checks pass with no warning, on PostgreSQL and on the demo's SQLite."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core import checks

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.django_db
def test_no_check_warns_on_postgresql():
    assert checks.run_checks(databases=["default"]) == []


def test_no_check_warns_on_sqlite(tmp_path):
    # The demo's database: a constraint SQLite cannot enforce (models.W047) is a warning there.
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path / 'check.sqlite3'}"}
    env.pop("REDIS_URL", None)
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--database", "default", "--fail-level", "WARNING"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "W047" not in result.stdout + result.stderr
