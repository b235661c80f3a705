"""Celery task events for endings that OJS decides itself (a cancel, an expiry), which Celery's
trace never reports: monitors (Flower, ``celery events``) read only events, so each such job
must end with exactly one terminal task event, as after Celery's own revoke or expiry."""

from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery

import ojs_celery
from tests.conftest import Env, start_env
from tests.workers import unique, wait_for

pytestmark = pytest.mark.timeout(120)

#: The task events that end a task in Celery's event state (and Flower).
TERMINAL = {"task-succeeded", "task-failed", "task-revoked", "task-rejected"}


@contextmanager
def task_events(app: Celery) -> Iterator[list[dict[str, Any]]]:
    """Collect the task events on ``app``'s event exchange with Celery's own receiver."""
    seen: list[dict[str, Any]] = []
    ready = threading.Event()
    receivers: list[Any] = []

    def collect() -> None:
        with app.connection_for_read() as connection:
            receiver = app.events.Receiver(connection, handlers={"*": seen.append})
            consuming = receiver.on_consume_ready

            def on_consume_ready(*args: Any, **kwargs: Any) -> None:
                consuming(*args, **kwargs)
                ready.set()

            receiver.on_consume_ready = on_consume_ready
            receivers.append(receiver)
            receiver.capture(limit=None, timeout=None, wakeup=False)

    thread = threading.Thread(target=collect, daemon=True)
    thread.start()
    assert ready.wait(15), "task event receiver did not start"
    try:
        yield seen
    finally:
        for receiver in receivers:
            receiver.should_stop = True
        thread.join(5)


def terminal(seen: list[dict[str, Any]], job_id: str) -> list[dict[str, Any]]:
    return [e for e in list(seen) if e.get("uuid") == job_id and e["type"] in TERMINAL]


@pytest.fixture(scope="module")
def events_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """A prefork worker started with ``-E`` (no setting: its pool children know it from the
    worker), on Redis."""
    with start_env("redis", tmp_path_factory.mktemp("task-events"), extra=["-E"]) as env:
        yield env


def test_a_cancelled_waiting_job_ends_with_one_task_revoked(events_env: Env) -> None:
    app = events_env.app
    app.conf.worker_send_task_events = True  # the cancelling process sends task events
    try:
        with task_events(app) as seen:
            result = app.tasks["e2e.add"].apply_async((1, 2), countdown=30)
            wait_for(lambda: any(e.get("uuid") == result.id and e["type"] == "task-received"
                                 for e in list(seen)), 15, "the worker to hold the job")
            ojs_celery.cancel(result.id, app=app)
            ended = wait_for(lambda: terminal(seen, result.id), 10, "a terminal task event")
            time.sleep(1.0)  # no second one follows
            ended = terminal(seen, result.id)
    finally:
        app.conf.worker_send_task_events = False
    assert [e["type"] for e in ended] == ["task-revoked"]
    assert (ended[0]["expired"], ended[0]["terminated"], ended[0]["signum"]) == \
        (False, False, None)
    assert result.state == "REVOKED"


def test_an_expired_job_ends_with_one_task_revoked_from_its_worker(events_env: Env) -> None:
    app = events_env.app
    assert not app.conf.worker_send_task_events  # the worker's -E alone sends this one
    with task_events(app) as seen:
        result = app.tasks["e2e.add"].apply_async((1, 2), countdown=2, expires=1)
        events_env.wait_state(result.id, "discarded")
        ended = wait_for(lambda: terminal(seen, result.id), 10, "a terminal task event")
        time.sleep(1.0)  # no second one follows
        ended = terminal(seen, result.id)
    assert [e["type"] for e in ended] == ["task-revoked"]
    assert (ended[0]["expired"], ended[0]["terminated"]) == (True, False)
    assert ended[0]["hostname"].startswith("w")  # the worker's node name (tests.workers)
    assert result.state == "REVOKED"



def test_a_job_the_sweeper_discards_ends_with_one_task_revoked_from_the_sweep_worker(
        tmp_path: pathlib.Path) -> None:
    """The sweep task runs in a worker that is not the job's (none consumes its queue): its
    ``-E`` sends the enqueue_ttl expiry's event."""
    overrides = {"ojs": {"sweep_interval": 0.5}}
    with start_env("redis", tmp_path, config=overrides, beat=True, extra=["-E"]) as env, \
            task_events(env.app) as seen:
        job = ojs_celery.enqueue({"type": "e2e.add", "args": [1, 2],
                                  "queue": unique("lonely"), "enqueue_ttl": 1}, app=env.app)
        env.wait_state(job.id, "discarded", timeout=15)
        wait_for(lambda: terminal(seen, job.id), 10, "a terminal task event")
        time.sleep(1.0)  # no second one follows
        ended = terminal(seen, job.id)
    assert [e["type"] for e in ended] == ["task-revoked"]
    assert (ended[0]["expired"], ended[0]["terminated"]) == (True, False)
