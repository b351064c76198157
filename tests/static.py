"""`collectstatic` for the tests, once per set of sources.

Collecting (hashing, then gzip and brotli) takes some ten seconds, so the result is kept under
var/test-static/, in a folder named by a digest of every source file's path, size and time and
of the storage settings: any change to a stylesheet, an app's files or the settings collects
afresh. It is built in a folder of its own and renamed into place, so test runs that start
together never read a half-written one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from django.conf import settings
from django.contrib.staticfiles.finders import get_finders
from django.core.management import call_command
from django.test import override_settings

CACHE = Path(settings.BASE_DIR) / "var" / "test-static"
MANIFEST = "staticfiles.json"
STALE_AFTER_S = 24 * 3600


def sources_digest() -> str:
    digest = hashlib.sha256()
    digest.update(repr((settings.STORAGES["staticfiles"], settings.STATIC_URL,
                        getattr(settings, "WHITENOISE_KEEP_ONLY_HASHED_FILES", False),
                        getattr(settings, "WHITENOISE_SKIP_COMPRESS_EXTENSIONS", None))
                       ).encode())
    for finder in get_finders():
        for path, storage in sorted(finder.list(["CVS", ".*", "*~"]), key=lambda p: p[0]):
            stat = os.stat(storage.path(path))
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def collected_static_root() -> Path:
    root = CACHE / sources_digest()
    if (root / MANIFEST).exists():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=CACHE))
    try:
        with override_settings(STATIC_ROOT=building):
            call_command("collectstatic", interactive=False, verbosity=0)
        try:
            building.rename(root)
        except OSError:
            if not (root / MANIFEST).exists():  # not a run that finished first: a real error
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    for stale in CACHE.iterdir():  # earlier sources' copies, unused for a day
        if stale != root and time.time() - stale.stat().st_mtime > STALE_AFTER_S:
            shutil.rmtree(stale, ignore_errors=True)
    return root
