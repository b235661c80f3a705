"""``ojs-celery -A APP inspect``: the migration report, run as users run it (the CLI)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

from tests.workers import ROOT


def inspect(app: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [str(pathlib.Path(sys.executable).with_name("ojs-celery")), "-A",
         f"tests.inspect_app:{app}", "inspect", *args],
        cwd=ROOT, env=env, text=True, capture_output=True, timeout=60)


def report(app: str) -> dict[str, Any]:
    result = inspect(app, "--json")
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def by_name(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {task["name"]: task for task in data["tasks"]}


def test_every_registered_task_with_its_type_queue_and_envelope() -> None:
    tasks = by_name(report("redis_app"))
    assert set(tasks) == {"billing.charge", "email.send", "maintenance.cleanup", "plain.report",
                          "pdf.render"}
    charge = tasks["billing.charge"]
    assert (charge["ojs"], charge["ojs_type"], charge["queue"]) == (True, "billing.charge",
                                                                    "billing")
    assert charge["envelope"]["timeout"] == 900 and charge["envelope"]["grace_period"] == 60
    # the record keeps Celery's retry semantics, not a translation into its retry policy
    assert charge["envelope"]["x_celery_semantics"] == {"max_retries": 5,
                                                        "default_retry_delay": 180.0}
    assert charge["envelope"]["retry"]["max_attempts"] == 3  # the OJS policy: recoveries
    assert charge["celery_retry"]["max_attempts"] == 6
    assert charge["celery_retry"]["initial_interval"] == "PT2S"
    assert charge["celery_retry"]["max_interval"] == "PT60S"
    assert charge["celery_retry"]["x_celery_autoretry_for"] == ["GatewayError"]
    assert "expires_at" in charge["envelope"]
    # a type_map entry naming a plain task: its type, but no OJS task until base=OJSTask
    assert not tasks["maintenance.cleanup"]["ojs"] and \
        tasks["maintenance.cleanup"]["ojs_type"] == "legacy.cleanup"
    assert not tasks["plain.report"]["ojs"] and tasks["plain.report"]["ojs_type"] is None
    assert tasks["email.send"]["queue"] == "celery"
    assert tasks["email.send"]["ojs_queue"] == "default"


def test_the_time_fields_are_those_a_celery_call_gets() -> None:
    """The README's mapping: the soft limit (rounded up) is the timeout; with no hard limit the
    grace period is the OJS default, 30 s, as the job of a ``.delay()`` has it."""
    from ojs_celery.producer import celery_time_fields
    from ojs_celery.runtime import get_runtime
    from tests.inspect_app import redis_app

    tasks = by_name(report("redis_app"))
    settings = get_runtime(redis_app).settings
    for name, timeout, grace in [("pdf.render", 11, 30), ("billing.charge", 900, 60),
                                 ("email.send", 900, 30)]:
        fields = tasks[name]["envelope"]
        assert (fields["timeout"], fields["grace_period"]) == (timeout, grace)
        called = {"grace_period": 30, **celery_time_fields(redis_app, redis_app.tasks[name], {},
                                                           settings)}
        assert called == {"timeout": timeout, "grace_period": grace}
    text = inspect("redis_app").stdout
    assert "a Celery call's job: timeout=11,grace_period=30" in text.replace(", ", ",")


def test_warnings_name_what_works_against_ojs() -> None:
    data = report("redis_app")
    tasks = by_name(data)
    charge = " ".join(tasks["billing.charge"]["warnings"])
    assert "rate_limit" in charge
    assert "visibility_timeout 600s" in charge  # 600 < 900 + 60
    assert any("no time limit" in w and "900s" in w for w in tasks["email.send"]["warnings"])
    assert tasks["email.send"]["envelope"]["timeout"] == 900  # ojs.default_timeout
    [unlimited] = [w for w in data["warnings"] if "have no time limit" in w]
    assert unlimited.endswith(": email.send") and "default timeout of 900s" in unlimited
    assert any("'threads'" in w for w in data["warnings"])
    assert any("task_serializer is pickle" in w for w in data["warnings"])
    assert any("accept_content" in w for w in data["warnings"])
    assert any(w.startswith("ojs.type_map: 'legacy.cleanup' maps to 'maintenance.cleanup', "
                            "which is not an OJS task") for w in data["warnings"])


def test_rabbitmq_consumer_timeout_from_the_queue_or_the_default() -> None:
    data = report("amqp_app")
    tasks = by_name(data)
    assert tasks["video.encode"]["queue"] == "video"
    assert any("consumer_timeout 600s" in w for w in tasks["video.encode"]["warnings"])
    assert any("consumer_timeout 1800s" in w for w in tasks["video.thumbnail"]["warnings"])
    assert not any("sweep queue" in w for w in data["warnings"])  # install declared it
    assert any("serializer='pickle'" in w for w in tasks["video.legacy"]["warnings"])
    assert not tasks["video.legacy"]["ojs"]
    assert any("not a valid OJS type" in w for w in tasks["video upload"]["warnings"])
    assert not any("OJS type" in w for w in tasks["video.encode"]["warnings"])


def test_text_output_lists_each_task_and_its_warnings() -> None:
    result = inspect("redis_app")
    assert result.returncode == 0, result.stderr
    assert "billing.charge  [OJS type billing.charge]  queue billing" in result.stdout
    assert "plain.report  [not an OJS task yet]" in result.stdout
    # a task not migrated keeps Celery's behaviour: its lines are about base=OJSTask
    plain = result.stdout.split("plain.report", 1)[1].split("\n")[1:]
    indented = [line for line in plain[:3] if line.startswith("    ")]
    assert indented and all(line.startswith(("    once migrated, ", "    warning: once migrated, "))
                            for line in indented)
    assert "warning:" in result.stdout
    assert "warning: 1 OJS task(s) have no time limit" in result.stdout


def test_a_task_not_migrated_yet_without_a_time_limit_is_named_before_the_switch() -> None:
    """The report runs before the tasks move (README, migration guide step 2): a plain task
    without a time limit is named in its warnings, as what it will get once migrated; the
    app's one line and ``--strict`` stay about OJS tasks."""
    data = report("redis_app")
    plain = by_name(data)["plain.report"]
    assert any("no time limit" in w and "900s" in w for w in plain["warnings"])
    [unlimited] = [w for w in data["warnings"] if "have no time limit" in w]
    assert unlimited.endswith(": email.send")
    text = inspect("redis_app").stdout
    assert "    warning: once migrated, no time limit under plain Celery" in text


def test_strict_fails_a_ci_step_on_warnings_of_the_app_or_an_ojs_task() -> None:
    """``--strict``: exit status 1 when there is something to fix (the report still printed);
    an app without warnings passes."""
    warned = inspect("redis_app", "--json", "--strict")
    assert warned.returncode == 1 and json.loads(warned.stdout)["warnings"]
    assert inspect("clean_app", "--strict").returncode == 0


def test_settings_against_the_worker_protocols_advice_are_warnings_of_the_report() -> None:
    """A legal setting the worker protocol advises against (a worker heartbeat timeout under
    three beats) is in the report's warnings, so ``--strict`` fails on it too."""
    result = inspect("tight_app", "--json", "--strict")
    assert result.returncode == 1
    assert any("worker_heartbeat_timeout" in w for w in json.loads(result.stdout)["warnings"])


def test_a_project_task_class_that_base_ojstask_would_take_the_place_of_is_named() -> None:
    """An app whose ``task_cls`` is the project's own class: ``base=OJSTask`` takes its place,
    so an OJS task loses what it adds (its ``on_failure`` here) unless its base has both.
    Celery's Django task class is not named: ``OJSTask`` has its ``delay_on_commit`` and
    ``apply_async_on_commit``."""
    tasks = by_name(report("custom_app"))
    [lost] = [w for w in tasks["custom.lost"]["warnings"] if "task_cls" in w]
    assert "tests.inspect_app.ProjectTask" in lost
    assert "class OJSProjectTask(OJSTask, ProjectTask)" in lost
    assert not any("task_cls" in w for w in tasks["custom.kept"]["warnings"])
    # a task not migrated yet has it: it would lose it with base=OJSTask
    assert any("task_cls" in w for w in tasks["custom.plain"]["warnings"])
    text = inspect("custom_app").stdout
    assert "warning: once migrated, base=OJSTask takes the place of the app's task class" in text
    assert not any("task_cls" in w for w in by_name(report("django_app"))["django.job"]["warnings"])


def test_the_reported_job_is_the_record_a_celery_call_makes(tmp_path: pathlib.Path) -> None:
    """What ``a Celery call's job`` reports is what the job's record holds after a ``.delay()``:
    the report once gave ``retry`` a translation of Celery's ``max_retries`` and backoff
    (``max_attempts`` 6 for ``max_retries=5``) that no record has (the record keeps the OJS
    policy, for recoveries, and ``x_celery_semantics``), nor a job with OJS semantics."""
    from celery import Celery

    from ojs_celery import OJSTask, get_job, install
    from ojs_celery.migration import build_report

    class Flaky(Exception):
        pass

    app = Celery("report_vs_record", set_as_current=False)
    app.conf.update(broker_url="memory://", result_backend="cache+memory://",
                    ojs={"store_url": f"sqlite:///{tmp_path / 'store.sqlite3'}"})
    install(app)

    @app.task(name="r.flaky", base=OJSTask, bind=True, autoretry_for=(Flaky,), max_retries=5,
              retry_backoff=1, retry_backoff_max=4, time_limit=60, soft_time_limit=50,
              shared=False)
    def flaky(self: OJSTask) -> None:
        return None

    @app.task(name="r.ojs", base=OJSTask, ojs_semantics=True, max_retries=7, shared=False)
    def ojs_task() -> None:
        return None

    tasks = {task.name: task for task in build_report(app).tasks}
    for name in ("r.flaky", "r.ojs"):
        record = get_job(app.tasks[name].delay().id, app=app)
        assert record is not None
        stored = record.model_dump(mode="json")
        reported = tasks[name].envelope
        stored["retry"] = {key: stored["retry"][key] for key in reported["retry"]}
        assert {key: stored.get(key) for key in reported} == reported, name
    assert tasks["r.flaky"].celery_retry is not None
    assert tasks["r.flaky"].celery_retry["max_attempts"] == 6
    assert tasks["r.ojs"].celery_retry is None
