"""A Redis broker restarted while a worker holds OJS messages it has not started (prefetched,
waiting for their ETA): the worker lives on and, once connected again, puts those messages back
in their queue, which kombu could not do while Redis was away. Their jobs then run soon, once
each, instead of after kombu's ``visibility_timeout`` or the redispatch backstop (an hour each).

A durable private ``redis-server`` (append-only file, fsync always: it comes back with its data,
kombu's ``unacked`` record included) is broker and job store; one real prefork worker runs the
jobs (``ojs_celery.worker.reconnect``).
"""

from __future__ import annotations

import datetime
import logging
import pathlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from kombu import Connection

from ojs_celery import enqueue
from ojs_celery.runtime import get_runtime
from ojs_celery.store import JobStore
from ojs_celery.worker.reconnect import ReconnectStep
from tests.e2eapp import make_app
from tests.test_store_faults import PrivateRedis
from tests.workers import Worker, lines, unique, wait_for

#: Every held job must run well before kombu or the backstop would have sent it again (an hour).
SOON = 30.0


@pytest.fixture
def durable_broker(tmp_path: pathlib.Path) -> Iterator[PrivateRedis]:
    (tmp_path / "redis").mkdir()
    broker = PrivateRedis(tmp_path / "redis", durable=True)
    try:
        yield broker
    finally:
        if broker.running():
            broker.stop()


def config_on(broker: PrivateRedis, tmp: pathlib.Path) -> dict[str, Any]:
    (tmp / "files").mkdir()
    return {
        "queue": unique("q"),
        "dir": str(tmp / "files"),
        "broker_url": broker.url,
        "broker_transport_options": {},
        "result_backend": f"db+sqlite:///{tmp / 'results.sqlite3'}",
        "ojs": {"store_url": broker.url, "store_prefix": unique("rc"), "events": False,
                "heartbeat_interval": 1.0},
    }


def held_by_worker(store: JobStore) -> set[str]:
    """The jobs the registered workers' last beats list as held (prefetched, ETA)."""
    return {job_id for info in store.workers.all() for job_id in info.reserved_job_ids}


def state_of(store: JobStore, job_id: str) -> str | None:
    job = store.get(job_id)
    return None if job is None else job.state


def test_held_messages_go_back_to_their_queue_after_a_broker_restart(
    durable_broker: PrivateRedis, tmp_path: pathlib.Path
) -> None:
    config = config_on(durable_broker, tmp_path)
    app: Celery = make_app(config)
    runtime = get_runtime(app)
    store = runtime.store
    worker = Worker(config, tmp_path / "worker.log", concurrency=1,
                    extra=["--prefetch-multiplier", "6"])  # it holds what waits behind one job
    try:
        worker.wait_ready()
        # its one process, long enough that the others are still held at the restart on a
        # loaded machine
        busy = enqueue({"type": "e2e.sleep", "args": [10]}, app=app).id
        wait_for(lambda: state_of(store, busy) == "active", 15, "the long job to start")
        prefetched = [enqueue({"type": "e2e.add", "args": [i, 1]}, app=app).id
                      for i in range(3)]
        soon = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=20)
        for_eta = [enqueue({"type": "e2e.add", "args": [i, 2], "scheduled_at": soon.isoformat()},
                           app=app).id for i in range(2)]
        held = {*prefetched, *for_eta}
        wait_for(lambda: held <= held_by_worker(store), 15, "the worker's beat to list them")

        durable_broker.stop()  # SIGTERM: the AOF is written; kombu's restore finds no Redis
        wait_for(lambda: "Connection to broker lost" in worker.log(), 15,
                 "the worker to notice the broker is gone")
        durable_broker.start()

        def ended() -> bool:
            return all(state_of(store, job_id) == "completed"
                       for job_id in [busy, *held])

        try:
            wait_for(ended, SOON, "every job to complete")
        except AssertionError:
            print(worker.log()[-6000:])
            raise
        assert worker.process.poll() is None  # it lived through the lost connection
        runs = lines(config["dir"], "runs")
        for job_id in [busy, *held]:
            assert sum(job_id in line for line in runs) == 1  # once, the copies dropped
            job = store.get(job_id)
            assert job is not None and job.attempt == 1
        assert "put back in their queue" in worker.log()
    finally:
        worker.stop()
        runtime.close()
        store.clear()


def test_a_broker_down_again_at_the_hand_back_keeps_the_messages_for_the_next_one(
    durable_broker: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """The hand-back meets the broker gone again: one WARNING, nothing lost; the messages are
    put back at the next reconnection (kombu's own channel and unacked record, no worker)."""
    queue = unique("q")
    with Connection(durable_broker.url) as producer:
        producer.SimpleQueue(queue).put({"n": 1})
    consumer = Connection(durable_broker.url)
    delivered = consumer.SimpleQueue(queue).get(timeout=5)  # now in kombu's unacked record
    parent = SimpleNamespace(connection=consumer)
    consumer.default_channel  # noqa: B018 - made while the broker answers, as after a reconnect
    step = ReconnectStep(parent)
    step.hooked = True  # as after its first start: the next starts hand back
    step.held = {delivered.delivery_tag: "job-1"}
    try:
        durable_broker.stop()
        with caplog.at_level(logging.WARNING, logger="ojs_celery"):
            step.start(parent)
        assert step.held == {delivered.delivery_tag: "job-1"}
        assert "could not put back 1 held OJS message(s)" in caplog.text
        caplog.clear()
        durable_broker.start()
        with caplog.at_level(logging.WARNING, logger="ojs_celery"):
            step.start(parent)
        assert step.held == {}
        assert "put back in their queue 1 OJS message(s)" in caplog.text
        with Connection(durable_broker.url) as other:
            again = other.SimpleQueue(queue).get(timeout=5)
            assert again.payload == {"n": 1}
            again.ack()
    finally:
        consumer.release()
