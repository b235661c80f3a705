"""What an operations team running RabbitMQ meets, on a RabbitMQ node of this module's own
(:mod:`tests.rabbitserver`; the shared server is never touched): a memory alarm that blocks
publishers, and the broker restarted under a running worker. The job store is the shared
Redis. Skipped when ``rabbitmq-server`` is not installed; the node takes 5 to 10 s to start,
once for the module."""

from __future__ import annotations

import logging
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from ojs_celery import get_job
from ojs_celery.runtime import get_runtime
from tests import services
from tests.e2eapp import make_app
from tests.rabbitserver import PrivateRabbit
from tests.workers import SweepLoop, Worker, forget_redis_names, redis_config, wait_for


@pytest.fixture(scope="module")
def rabbit() -> Iterator[PrivateRabbit]:
    server = PrivateRabbit()
    try:
        yield server
    finally:
        server.destroy()


def rabbit_config(tmp: pathlib.Path, rabbit: PrivateRabbit, **ojs: Any) -> dict[str, Any]:
    """The private node as broker, the shared Redis as job store and result backend."""
    config = redis_config(tmp, services.redis_url())
    config["broker_url"] = rabbit.url
    config["ojs"] = {**config["ojs"], "events": False, **ojs}
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
        assert "publish_timeout" in caplog.text and "memory or disk alarm" in caplog.text
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

