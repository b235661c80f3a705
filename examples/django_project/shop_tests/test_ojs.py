"""What ojs_celery adds to the shop (run with ``SHOP_OJS=1`` only): the view that accepts OJS
job envelopes from other services, ``manage.py ojs``, ``CELERY_OJS`` read at the right moment,
and the sweep scheduled by django-celery-beat's DatabaseScheduler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import HERE, wait_for
from django.test import Client
from shop.celery import app

pytestmark = pytest.mark.ojs_only
TIMEOUT = 60


def post_job(envelope: object) -> tuple[int, dict]:  # type: ignore[type-arg]
    body = envelope if isinstance(envelope, str) else json.dumps(envelope)
    response = Client().post("/jobs/", body, content_type="application/json")
    return response.status_code, response.json()


def manage(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "manage.py", *args], cwd=HERE, text=True,
                          capture_output=True, timeout=60, env={**os.environ, **env})


def test_invalid_envelope_is_a_400_naming_each_field() -> None:
    status, body = post_job({"type": "Not A Type!", "args": "nope", "priority": 1000})
    assert status == 400
    fields = {error["field"] for error in body["errors"]}
    assert {"type", "args", "priority"} <= fields


def test_envelope_for_a_task_that_is_no_ojs_task_is_refused() -> None:
    status, body = post_job({"type": "django.contrib.auth.anything", "args": []})
    assert status == 400 and body["errors"][0]["field"] == "type"


def test_text_that_is_not_json_is_a_400() -> None:
    status, body = post_job("{not json")
    assert status == 400 and body["errors"]


def test_settings_are_the_test_settings() -> None:
    """``settings_test`` does ``from shop.settings import *`` and overrides CELERY_OJS: the
    override is what ojs_celery reads."""
    from ojs_celery.runtime import get_runtime

    assert get_runtime(app).settings.sweep_interval == 0.5


def test_bad_celery_ojs_stops_manage_py_naming_the_key() -> None:
    result = manage("check", SHOP_OJS_EXTRA=json.dumps({"sweep_intervall": 1}))
    assert result.returncode != 0
    assert "CELERY_OJS" in result.stderr and "sweep_intervall" in result.stderr


@pytest.mark.worker
@pytest.mark.usefixtures("worker")
def test_posted_job_runs_and_manage_py_ojs_shows_it() -> None:
    import ojs_celery

    status, job = post_job({"type": "orders.tasks.tally", "args": [[1, 2, 3]]})
    assert status == 202, job
    wait_for(lambda: ojs_celery.get_job(job["id"], app=app).state == "completed", TIMEOUT,
             "the posted job completed")
    shown = manage("ojs", "get", job["id"])
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["result"] == 6
    assert manage("ojs", "get", "019539a4-b68c-7def-8000-1234567890ab").returncode == 1


@pytest.mark.worker
def test_database_scheduler_runs_the_sweep(beat: subprocess.Popen[bytes]) -> None:
    """django-celery-beat's DatabaseScheduler imports the ``ojs-sweep`` entry (dropping its
    ``expires``); its sweeps reach the worker through the declared sweep queue."""
    from ojs_celery.runtime import get_runtime
    from ojs_celery.sweeper import last_sweep

    started = time.time()
    wait_for(lambda: (last_sweep(get_runtime(app)) or 0) > started, TIMEOUT,
             "a sweep scheduled by the DatabaseScheduler")


def test_manage_py_ojs_inspect_reports_the_shop() -> None:
    result = manage("ojs", "inspect", "--json")
    assert result.returncode == 0, result.stderr
    tasks = {task["name"]: task for task in json.loads(result.stdout)["tasks"]}
    receipt = tasks["orders.tasks.send_receipt"]
    assert receipt["ojs"] and receipt["queue"] == "emails_high"
    # a Celery call's job keeps Celery's retries: max_retries=5 is six attempts by self.retry
    assert receipt["envelope"]["x_celery_semantics"]["max_retries"] == 5
    assert receipt["celery_retry"]["max_attempts"] == 6
    report = tasks["orders.tasks.build_sales_report"]
    assert (report["envelope"]["timeout"], report["envelope"]["grace_period"]) == (2, 2)


def test_bad_celery_ojs_is_one_line_per_problem_from_the_cli() -> None:
    """``ojs-celery -A shop``: Django's ImproperlyConfigured from the app's ``ready()`` is a
    usage error (exit status 2), one line per problem, as the README promises; no traceback."""
    cli = os.path.join(os.path.dirname(sys.executable), "ojs-celery")
    result = subprocess.run(
        [cli, "-A", "shop", "inspect"], cwd=HERE, text=True, capture_output=True, timeout=60,
        env={**os.environ, "SHOP_OJS_EXTRA": json.dumps({"sweep_intervall": 1})})
    assert result.returncode == 2, result.stderr
    assert "CELERY_OJS: ojs.sweep_intervall: unknown setting" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_celery_ojs_stops_the_worker_at_start() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "shop", "worker", "--pool", "solo"],
        cwd=HERE, text=True, capture_output=True, timeout=60,
        env={**os.environ, "SHOP_OJS_EXTRA": json.dumps({"sweep_intervall": 1})})
    assert result.returncode != 0
    assert "CELERY_OJS: ojs.sweep_intervall" in result.stderr + result.stdout
