"""OJS tasks always ack late (README, "Celery callers"), even when a task's options or
``task_annotations`` say ``acks_late=False``: an early ack would lose the message of a job
the drain sends back to the broker unstarted (it would wait for the sweeper's redispatch
backstop, an hour). The migration report says the option is ignored."""

from __future__ import annotations

import pathlib
import signal
import time

from celery import Celery

import ojs_celery
from ojs_celery import enqueue
from ojs_celery.migration import build_report
from tests.conftest import start_env
from tests.workers import Worker, wait_for


def test_acks_late_false_from_options_or_annotations_is_overridden_and_reported() -> None:
    app = Celery("acks", set_as_current=False)
    app.conf.update(broker_url="memory://", task_acks_late=False,
                    task_annotations={"acks.annotated": {"acks_late": False}},
                    ojs={"store_url": "sqlite:///:memory:"})
    ojs_celery.install(app)

    @app.task(name="acks.option", base=ojs_celery.OJSTask, acks_late=False, time_limit=5,
              shared=False)
    def option() -> None:
        return None

    @app.task(name="acks.annotated", base=ojs_celery.OJSTask, time_limit=5, shared=False)
    def annotated() -> None:
        return None

    @app.task(name="acks.plain", acks_late=False, shared=False)
    def plain() -> None:
        return None

    app.finalize()
    assert app.tasks["acks.option"].acks_late is True
    assert app.tasks["acks.annotated"].acks_late is True
    assert app.tasks["acks.plain"].acks_late is False  # plain tasks keep Celery's options
    report = {task.name: task for task in build_report(app).tasks}
    for name in ("acks.option", "acks.annotated"):
        assert any(w.startswith("acks_late=False") for w in report[name].warnings), \
            report[name].warnings
    assert not any("acks_late" in w for w in report["acks.plain"].warnings)


def test_a_job_the_drain_sends_back_runs_elsewhere_under_acks_late_false(
    tmp_path: pathlib.Path,
) -> None:
    """A worker with a prefetch drains while jobs wait in its pool: those that reach a pool
    process after the cancellation point go back to the broker, and another worker runs
    every one of them at once."""
    changes = {"ojs": {"shutdown_grace_period": 4, "shutdown_cancel_window": 2},
               "celery": {"task_annotations": {"e2e.sleep": {"acks_late": False}}}}
    with start_env("redis", tmp_path, config=changes, concurrency=1,
                   extra=["--prefetch-multiplier", "4"]) as env:
        jobs = [enqueue({"type": "e2e.sleep", "args": [1.5]}, app=env.app) for _ in range(6)]
        wait_for(lambda: env.lines("runs"), 15, "the first job started")
        env.worker.process.send_signal(signal.SIGTERM)
        assert env.worker.process.wait(30) == 0
        time.sleep(1)
        second = Worker(env.config, tmp_path / "second.log", concurrency=2)
        try:
            second.wait_ready()
            for job in jobs:
                env.wait_state(job.id, "completed", timeout=20, worker=second)
        finally:
            second.stop()
