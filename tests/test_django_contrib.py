"""``ojs_celery.contrib.django`` in a project that forgot to import its Celery app."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("django")


def test_a_project_whose_celery_app_is_not_imported_is_told_how_to_fix_it(
    tmp_path: Path,
) -> None:
    """Without ``from .celery import app`` in the project package (and no ``OJS_CELERY_APP``),
    Celery's current app is its unconfigured default: ``manage.py`` stops naming both fixes,
    instead of every ``.delay()`` raising ``NotInstalled`` and ``manage.py ojs inspect``
    reporting nothing."""
    (tmp_path / "noapp_settings.py").write_text(textwrap.dedent("""
        SECRET_KEY = "x"
        INSTALLED_APPS = ["ojs_celery.contrib.django"]
        CELERY_BROKER_URL = "memory://"
        CELERY_OJS = {"store_url": "sqlite:///:memory:"}
    """))
    env = {"DJANGO_SETTINGS_MODULE": "noapp_settings", "PYTHONPATH": str(tmp_path),
           "PATH": "/usr/bin:/bin"}

    def setup(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", "import django; django.setup()"], cwd=tmp_path, text=True,
            capture_output=True, timeout=60, env={**env, **extra})

    result = setup()
    assert result.returncode != 0
    assert "ojs_celery found no Celery app" in result.stderr
    assert "OJS_CELERY_APP" in result.stderr
    # Celery's default app configured from the environment is a real one: it is used
    assert setup(CELERY_BROKER_URL="memory://").returncode == 0
