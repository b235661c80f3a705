"""An enqueue interrupted while its message is being published (Ctrl-C, gevent's ``Timeout``,
a worker told to exit: a ``BaseException``, not an error) leaves the process's store connection
free and loses no job: the interrupt reaches the caller, the job the store took has its message
owed, and the sweeper publishes it.

On a store that is not the broker's Redis, ``enqueue`` publishes while the store's insert is in
flight on the store's fast lane, which is held until the insert's reply is read."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.signals import before_task_publish

from ojs_celery import enqueue
from ojs_celery.runtime import get_runtime
from ojs_celery.sweeper import sweep
from tests import services
from tests.conftest import messages
from tests.e2eapp import make_app
from tests.test_store_faults import PrivateRedis
from tests.workers import filesystem_config, unique


class Interrupt(BaseException):
    """What gevent's ``Timeout`` and ``KeyboardInterrupt`` are: not an ``Exception``."""


def interrupted_enqueue(app: Celery) -> str:
    """Enqueue a job whose publish is interrupted (a ``before_task_publish`` receiver raises
    :class:`Interrupt`); check that the interrupt reached the caller; the job's id."""
    interrupted: list[str] = []

    def interrupt(sender: Any = None, headers: Any = None, **_: Any) -> None:
        interrupted.append(headers["id"])
        raise Interrupt()

    before_task_publish.connect(interrupt, weak=False)
    try:
        with pytest.raises(Interrupt):
            enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
    finally:
        before_task_publish.disconnect(interrupt)
    [job_id] = interrupted
    return job_id


@pytest.fixture(params=["redis", "postgresql"])
def app(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[Celery]:
    """The embedded broker with a Redis or PostgreSQL job store (whose inserts take the lane)."""
    config = filesystem_config(tmp_path)
    url = services.redis_url() if request.param == "redis" else services.postgres_url()
    config["ojs"] = {"store_url": url, "store_prefix": unique("intr"), "events": False}
    celery_app = make_app(config)
    yield celery_app
    runtime = get_runtime(celery_app)
    runtime.close()  # the store and its lanes; clear and drop reconnect through the pool
    runtime.store.clear()
    drop = getattr(runtime.store, "drop_tables", None)
    if drop is not None:
        drop()


def test_an_interrupted_publish_loses_no_job_and_frees_the_store(app: Celery) -> None:
    enqueue({"type": "e2e.add", "args": [0, 0]}, app=app)  # the lane's connection is made
    job_id = interrupted_enqueue(app)
    runtime = get_runtime(app)
    record = runtime.store.get_record(job_id)
    assert record is not None and record.job.state == "available"
    assert record.dispatch_due is not None  # its message is owed
    published = len(messages(app))  # the first enqueue's message only
    assert published == 1

    lane = runtime.store._lane  # type: ignore[attr-defined]
    assert not lane._lock.locked(), "the store's lane stayed held by the interrupted insert"
    after = enqueue({"type": "e2e.add", "args": [3, 4]}, app=app)
    assert runtime.store.get(after.id) is not None

    assert sweep(runtime, now=time.time() + 60).error is None  # past dispatch_grace
    assert len(messages(app)) == published + 2  # the next enqueue's, and the one owed
    owed = runtime.store.get_record(job_id)
    assert owed is not None and owed.dispatch_due is None


def test_an_interrupted_publish_whose_store_write_is_refused_stores_nothing(
    redis_server: PrivateRedis, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis refuses the insert (an error reply: ``NOREPLICAS``) while the publish is
    interrupted: the caller sees the interrupt, one warning names the job and the refusal,
    nothing is stored or published, and the store's lane is free for the next enqueue."""
    config = filesystem_config(tmp_path)
    config["ojs"] = {"store_url": redis_server.url, "store_prefix": unique("intr"),
                     "events": False}
    app = make_app(config)
    runtime = get_runtime(app)
    try:
        enqueue({"type": "e2e.add", "args": [0, 0]}, app=app)  # the lane's connection is made
        redis_server.admin.config_set("min-replicas-to-write", 1)  # every write is refused
        job_id = interrupted_enqueue(app)
        [warning] = [r for r in caplog.records if r.levelname == "WARNING"
                     and job_id in r.getMessage()]
        assert "interrupted" in warning.getMessage() and "NOREPLICAS" in warning.getMessage()
        redis_server.admin.config_set("min-replicas-to-write", 0)
        assert runtime.store.get(job_id) is None
        assert len(messages(app)) == 1  # the first enqueue's only
        assert not runtime.store._lane._lock.locked()  # type: ignore[attr-defined]
        after = enqueue({"type": "e2e.add", "args": [3, 4]}, app=app)
        assert runtime.store.get(after.id) is not None
    finally:
        runtime.close()
