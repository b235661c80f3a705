"""What an operations team running RabbitMQ meets, on a RabbitMQ node of this module's own
(:mod:`tests.rabbitserver`; the shared server is never touched): a memory alarm that blocks
publishers, the broker restarted under a running worker, RabbitMQ's ``consumer_timeout``
(8 s here) shorter than a job, and a full queue that refuses publishes. The job store is the
shared Redis. Skipped when ``rabbitmq-server`` is not installed; the node takes 5 to 10 s to start,
once for the module."""

from __future__ import annotations

import logging
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Exchange, Queue

from ojs_celery import enqueue, get_job
from ojs_celery.runtime import get_runtime
from ojs_celery.sweeper import sweep
from tests import services
from tests.e2eapp import make_app
from tests.rabbitserver import PrivateRabbit
from tests.workers import SweepLoop, Worker, forget_redis_names, redis_config, wait_for


@pytest.fixture(scope="module")
def rabbit() -> Iterator[PrivateRabbit]:
    # RabbitMQ's delivery-acknowledgement timeout, checked every second instead of every
    # minute: a job of a few seconds outlives it (the other tests' jobs take less)
    server = PrivateRabbit({"consumer_timeout": "8000"},
                           "[{rabbit, [{channel_tick_interval, 1000}]}].")
    try:
        yield server
    finally:
        server.destroy()


def rabbit_config(tmp: pathlib.Path, rabbit: PrivateRabbit, **ojs: Any) -> dict[str, Any]:
    """The private node as broker, the shared Redis as job store and result backend."""
    config = redis_config(tmp, services.redis_url())
    config["broker_url"] = rabbit.url
    config["ojs"] = {**config["ojs"], "events": False, **ojs}
    # as the README asks on RabbitMQ: a consumer_timeout reconnects instead of stopping
    config["celery"] = {**config["celery"], "broker_channel_error_retry": True}
    return config


def forget(app: Celery, config: dict[str, Any]) -> None:
    get_runtime(app).store.clear()
    forget_redis_names(services.redis_url(), [config["ojs"]["store_prefix"]])


def test_a_memory_alarm_bounds_a_confirmed_publish_and_loses_no_job(
        rabbit: PrivateRabbit, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    """With publisher confirms on (kombu's ``confirm_publish``), RabbitMQ's memory alarm
    blocks the connection and never confirms: Celery sends no limit, so ``.delay()`` waited
    for ever (in the confirmation, then in the close of the failed connection). Now each try
    waits ``publish_timeout``; the call returns the stored job with an error logged, its
    message stays owed, and once the alarm clears the sweeper's publish runs it, once."""
    config = rabbit_config(tmp_path, rabbit, publish_timeout=0.5, dispatch_grace=0.5)
    config["broker_transport_options"] = {"confirm_publish": True}
    app = make_app(config)
    add = app.tasks["e2e.add"]
    add.delay(1, 1)  # connected and declared before the alarm
    returned: list[Any] = []
    rabbit.ctl("set_vm_memory_high_watermark", "0")
    try:
        with caplog.at_level(logging.ERROR, logger="ojs_celery"):
            call = threading.Thread(target=lambda: returned.append(add.delay(2, 3)),
                                    daemon=True)
            call.start()
            call.join(30)
            assert not call.is_alive(), ".delay() still waits for the blocked broker"
        assert "ojs.publish_timeout" in caplog.text and "memory or disk alarm" in caplog.text
        job = get_job(returned[0].id, app=app)
        assert job is not None and job.state == "available"
    finally:
        rabbit.ctl("set_vm_memory_high_watermark", "0.4")
    sweeper = SweepLoop(get_runtime(app))
    worker = Worker(config, tmp_path / "worker.log")
    try:
        worker.wait_ready()
        sweeper.start()

        def completed() -> bool:
            done = get_job(returned[0].id, app=app)
            return done is not None and done.state == "completed"

        wait_for(completed, 60, "the job published after the alarm to complete")
        assert get_job(returned[0].id, app=app).result == 5  # type: ignore[union-attr]
        runs = [line for line in (pathlib.Path(config["dir"]) / "runs").read_text().splitlines()
                if line == f"add {returned[0].id}"]
        assert len(runs) == 1
    finally:
        sweeper.stop()
        worker.stop()
        forget(app, config)



def runs_of(config: dict[str, Any], job_id: str) -> list[str]:
    path = pathlib.Path(config["dir"]) / "runs"
    return [line for line in path.read_text().splitlines() if job_id in line.split()[1:2]]


def active(app: Celery, job_id: str) -> bool:
    job = get_job(job_id, app=app)
    return job is not None and job.state == "active"


def test_a_broker_restart_under_running_jobs_loses_none_and_runs_each_once(
        rabbit: PrivateRabbit, tmp_path: pathlib.Path) -> None:
    """The broker stops (``stop_app``: every connection closed) while two jobs run and while
    callers publish, and starts again: the running jobs finish once, their redelivered
    messages are dropped, the jobs published meanwhile run from the outbox. The ends of the
    attempts whose channel closed are not acknowledged: Celery's ack on it logged a CRITICAL
    ``Couldn't ack`` with a traceback for each."""
    config = rabbit_config(tmp_path, rabbit, dispatch_grace=0.5)
    app = make_app(config)
    sweeper = SweepLoop(get_runtime(app))
    worker = Worker(config, tmp_path / "worker.log")
    try:
        worker.wait_ready()
        sweeper.start()
        running = [enqueue({"type": "e2e.sleep", "args": [10]}, app=app).id for _ in range(2)]
        for job_id in running:
            wait_for(lambda j=job_id: active(app, j), 30, f"job {job_id} to start")
        rabbit.stop_app()
        # the attempts the stop cut across (on a loaded machine stop_app may take seconds)
        cut_across = [job_id for job_id in running if active(app, job_id)]
        assert cut_across, "the broker took longer to stop than the jobs ran"
        try:
            meanwhile = [app.tasks["e2e.add"].delay(n, 1).id for n in range(2)]
        finally:
            rabbit.start_app()
        after = app.tasks["e2e.add"].delay(5, 5).id
        for job_id in [*running, *meanwhile, after]:
            def completed(j: str = job_id) -> bool:
                job = get_job(j, app=app)
                return job is not None and job.state == "completed"

            wait_for(completed, 90, f"job {job_id} to complete")
            assert len(runs_of(config, job_id)) == 1, (job_id, worker.log()[-4000:])
        log = worker.log()
        assert "Couldn't ack" not in log, log[-6000:]
        for job_id in cut_across:
            assert f"job {job_id}: cannot acknowledge its message" in log, log[-6000:]
    finally:
        sweeper.stop()
        worker.stop()
        forget(app, config)


def test_a_job_longer_than_consumer_timeout_runs_once_and_its_worker_goes_on(
        rabbit: PrivateRabbit, tmp_path: pathlib.Path) -> None:
    """RabbitMQ closes the channel of a delivery not acknowledged within ``consumer_timeout``
    (PRECONDITION_FAILED) and puts the message back. With Celery's
    ``broker_channel_error_retry`` (README) the worker reconnects instead of stopping; the
    running job finishes once and completes, its redelivered copy is dropped, its end is not
    acknowledged on the closed channel (no CRITICAL ``Couldn't ack``), and later jobs run."""
    config = rabbit_config(tmp_path, rabbit)
    app = make_app(config)
    worker = Worker(config, tmp_path / "worker.log")
    try:
        worker.wait_ready()
        long = enqueue({"type": "e2e.sleep", "args": [14], "timeout": 60}, app=app).id
        wait_for(lambda: "PRECONDITION_FAILED" in worker.log(), 60,
                 "RabbitMQ to close the channel of the unacknowledged delivery")

        def completed(j: str) -> bool:
            job = get_job(j, app=app)
            return job is not None and job.state == "completed"

        wait_for(lambda: completed(long), 60, "the long job to complete")
        later = app.tasks["e2e.add"].delay(2, 2).id
        wait_for(lambda: completed(later), 60, "a later job to complete")
        assert len(runs_of(config, long)) == 1
        log = worker.log()
        assert "Couldn't ack" not in log, log[-6000:]
        assert f"job {long}: cannot acknowledge its message" in log, log[-6000:]
    finally:
        worker.stop()
        forget(app, config)


def test_a_full_queue_that_refuses_publishes_is_named_and_its_job_kept(
        rabbit: PrivateRabbit, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    """A queue declared with ``x-max-length`` and ``x-overflow: reject-publish`` is full: with
    publisher confirms RabbitMQ nacks the message. The caller got the stored job and a log line
    that said only ``(broker: )`` (kombu's error for a nack has no text); now it names the
    refusal. The message stays owed: once the queue has room a sweep publishes it."""
    config = rabbit_config(tmp_path, rabbit, dispatch_grace=0.2)
    config["broker_transport_options"] = {"confirm_publish": True}
    name = config["queue"]
    config["celery"] = {**config["celery"], "task_queues": [Queue(
        name, Exchange(name), routing_key=name,
        queue_arguments={"x-max-length": 1, "x-overflow": "reject-publish"})]}
    app = make_app(config)
    add = app.tasks["e2e.add"]
    try:
        add.delay(1, 1)  # fills the queue
        with caplog.at_level(logging.ERROR, logger="ojs_celery"):
            refused = add.delay(2, 2).id
        assert "RabbitMQ refused the message (a nack: its queue is full" in caplog.text
        job = get_job(refused, app=app)
        assert job is not None and job.state == "available"
        with Connection(rabbit.url) as connection:
            channel = connection.channel()
            assert channel.queue_purge(name) == 1

            def published_again() -> bool:
                sweep(get_runtime(app))
                return bool(channel.queue_declare(name, passive=True).message_count == 1)

            wait_for(published_again, 30, "a sweep to publish the refused job's message")
            channel.queue_delete(name)
    finally:
        forget(app, config)
