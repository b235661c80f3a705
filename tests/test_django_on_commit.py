"""A Django project's tasks keep Celery's ``delay_on_commit``/``apply_async_on_commit`` with
``base=OJSTask``.

Since Celery 5.4 the Django fixup makes ``celery.contrib.django.task.DjangoTask`` the default
base of a Django project's tasks, so ``task.delay_on_commit(...)`` is how a project sends a task
once its transaction commits. ``base=OJSTask`` takes the place of that default class.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ojs_celery.embedded import embedded_settings
from ojs_celery.testing import CeleryProcess

from .workers import wait_for

pytest.importorskip("django")

ROOT = Path(__file__).resolve().parent.parent

SETTINGS = """
import json, os
SECRET_KEY = "x"
INSTALLED_APPS = ["ojs_celery.contrib.django", "shop"]
DATABASES = {{"default": {{"ENGINE": "django.db.backends.sqlite3",
                           "NAME": {db!r}}}}}
USE_TZ = True
_EMBEDDED = json.loads(os.environ["SHOP_EMBEDDED"])
CELERY_BROKER_URL = _EMBEDDED["broker_url"]
CELERY_BROKER_TRANSPORT_OPTIONS = _EMBEDDED["broker_transport_options"]
CELERY_RESULT_BACKEND = _EMBEDDED["result_backend"]
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_OJS = _EMBEDDED["ojs"]
"""

CELERY = """
import os
from celery import Celery
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
"""

TASKS = """
from pathlib import Path
from celery import shared_task
from ojs_celery import OJSTask

@shared_task(base=OJSTask, soft_time_limit=20, time_limit=30)
def record(value, *, folder):
    (Path(folder) / str(value)).write_text("ran")
    return value
"""

PRODUCER = """
import sys
import django
django.setup()
from django.db import transaction
import ojs_celery
from shop.tasks import record

folder, job_id = sys.argv[1], sys.argv[2]
with transaction.atomic():
    print("delay_on_commit", record.delay_on_commit(1, folder=folder))
    record.apply_async_on_commit((2,), {"folder": folder}, task_id=job_id)
    # nothing is stored before the transaction commits
    print("before commit", ojs_celery.get_job(job_id))
print("after commit", ojs_celery.get_job(job_id).state)
try:
    with transaction.atomic():
        record.delay_on_commit(3, folder=folder)
        raise RuntimeError("roll back")
except RuntimeError:
    pass
"""


def _project(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "__init__.py").write_text("from .celery import app\n")
    (tmp_path / "proj" / "celery.py").write_text(textwrap.dedent(CELERY))
    (tmp_path / "proj" / "settings.py").write_text(
        textwrap.dedent(SETTINGS.format(db=str(tmp_path / "db.sqlite3"))))
    (tmp_path / "shop").mkdir()
    (tmp_path / "shop" / "__init__.py").write_text("")
    (tmp_path / "shop" / "tasks.py").write_text(textwrap.dedent(TASKS))
    (tmp_path / "producer.py").write_text(textwrap.dedent(PRODUCER))
    (tmp_path / "done").mkdir()
    return {**os.environ, "DJANGO_SETTINGS_MODULE": "proj.settings",
            "SHOP_EMBEDDED": json.dumps(embedded_settings(tmp_path / "ojs")),
            "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}


def test_delay_on_commit_and_apply_async_on_commit_send_the_job_when_the_transaction_commits(
    tmp_path: Path,
) -> None:
    env = _project(tmp_path)
    done = tmp_path / "done"
    job_id = "0190f0c2-7a55-7c4e-9d3e-1c2b3a4d5e6f"
    produced = subprocess.run(
        [sys.executable, "producer.py", str(done), job_id], cwd=tmp_path, env=env, text=True,
        capture_output=True, timeout=120)
    assert produced.returncode == 0, produced.stderr[-4000:]
    assert "delay_on_commit None" in produced.stdout  # Celery's returns None too
    assert "before commit None" in produced.stdout
    assert "after commit available" in produced.stdout

    worker = CeleryProcess(
        ["-A", "proj", "worker", "--pool", "prefork", "--concurrency", "1", "--loglevel",
         "INFO", "--without-gossip", "--without-mingle"],
        tmp_path / "worker.log", env, cwd=tmp_path)
    try:
        worker.wait_ready()
        wait_for(lambda: {p.name for p in done.iterdir()} >= {"1", "2"}, 60,
                 "both jobs sent on commit to run")
        # the rolled-back transaction's call was never sent (its message, sent first,
        # would have run first on the single pool process)
        assert {p.name for p in done.iterdir()} == {"1", "2"}
        state = subprocess.run(
            [sys.executable, "-c", "import django; django.setup(); import ojs_celery, sys; "
             "print(ojs_celery.get_job(sys.argv[1]).state)", job_id],
            cwd=tmp_path, env=env, text=True, capture_output=True, timeout=60)
        assert state.stdout.strip() == "completed", state.stderr[-4000:]
    finally:
        worker.stop()
