"""``ojs_celery.contrib.django`` in a project that forgot to import its Celery app."""

from __future__ import annotations

import json
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


def _django_project(root: Path) -> None:
    """A project as Celery's Django guide makes it: ``proj/celery.py`` reads the ``CELERY_``
    settings, an app module holds an OJS task, the job store is in ``CELERY_OJS``."""
    (root / "proj").mkdir()
    (root / "proj" / "__init__.py").write_text("from .celery import app as celery_app\n")
    (root / "proj" / "celery.py").write_text(textwrap.dedent("""
        import os
        from celery import Celery
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
        app = Celery("proj")
        app.config_from_object("django.conf:settings", namespace="CELERY")
        app.autodiscover_tasks()
    """))
    (root / "proj" / "settings.py").write_text(textwrap.dedent(f"""
        SECRET_KEY = "x"
        INSTALLED_APPS = ["ojs_celery.contrib.django", "jobs"]
        CELERY_BROKER_URL = "filesystem://"
        CELERY_BROKER_TRANSPORT_OPTIONS = {{"data_folder_in": {str(root / 'b')!r},
                                           "data_folder_out": {str(root / 'b')!r}}}
        CELERY_OJS = {{"store_url": "sqlite:///{root / 'jobs.sqlite3'}", "events": False}}
    """))
    (root / "proj" / "broken.py").write_text("raise RuntimeError('boom in the settings')\n")
    (root / "b").mkdir()
    (root / "jobs").mkdir()
    (root / "jobs" / "__init__.py").write_text("")
    (root / "jobs" / "tasks.py").write_text(textwrap.dedent("""
        from celery import shared_task
        from ojs_celery import OJSTask

        @shared_task(name="dj.add", base=OJSTask)
        def add(a, b):
            return a + b
    """))


def _ojs_celery(root: Path, *args: str, stdin: str = "",
                **environ: str) -> subprocess.CompletedProcess[str]:
    cli = str(Path(sys.executable).parent / "ojs-celery")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), **environ}
    return subprocess.run([cli, "-A", "proj", *args], input=stdin, cwd=root, text=True,
                          capture_output=True, timeout=60, env=env)


def test_the_cli_on_a_django_project_reads_celery_ojs(tmp_path: Path) -> None:
    """``ojs-celery -A proj enqueue`` and ``get`` use the job store ``CELERY_OJS`` names."""
    _django_project(tmp_path)
    out = _ojs_celery(tmp_path, "enqueue", "-", stdin='{"type":"dj.add","args":[1,2]}')
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "jobs.sqlite3").exists()
    job_id = json.loads(out.stdout)["id"]
    got = _ojs_celery(tmp_path, "get", job_id)
    assert got.returncode == 0 and json.loads(got.stdout)["state"] == "available", got.stderr


def test_the_cli_with_django_settings_that_do_not_load_is_one_line_and_status_2(
    tmp_path: Path,
) -> None:
    """A ``DJANGO_SETTINGS_MODULE`` that does not import (a typo, a settings module that
    raises) ended ``ojs-celery -A proj ...`` with a traceback and status 1: Django reads it
    while the app's task modules are imported, after the app itself loaded."""
    _django_project(tmp_path)
    for settings, reason in [("proj.nosuch", "No module named 'proj.nosuch'"),
                             ("proj.broken", "boom in the settings")]:
        out = _ojs_celery(tmp_path, "get", "x", DJANGO_SETTINGS_MODULE=settings)
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr
        assert "cannot load app 'proj'" in out.stderr and reason in out.stderr, out.stderr
