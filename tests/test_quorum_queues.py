"""RabbitMQ quorum queues, on which Celery 5.5+ delays messages with RabbitMQ's native delayed
delivery (the ``celery_delayed_*`` exchanges and queues, which Celery names for the whole
virtual host: each test module gets a virtual host of its own, made with ``rabbitmqctl``)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from urllib.parse import quote, urlsplit, urlunsplit

import pytest

from ojs_celery import enqueue
from ojs_celery.envelope import format_timestamp, from_epoch

from . import services
from .conftest import Env, start_env
from .workers import unique

pytestmark = pytest.mark.skipif(
    tuple(int(part) for part in __import__("celery").__version__.split(".")[:2]) < (5, 5),
    reason="Celery 5.4 has no native delayed delivery for quorum queues")


def rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def quorum_vhost() -> Iterator[str]:
    """The AMQP URL of a new virtual host on the test RabbitMQ, removed afterwards."""
    url = services.amqp_url()
    if shutil.which("rabbitmqctl") is None or urlsplit(url).hostname not in ("127.0.0.1",
                                                                            "localhost"):
        message = "needs rabbitmqctl for the test RabbitMQ (a local server) to make a vhost"
        if services.services_required():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    name = unique("ojsquorum")
    rabbitmqctl("add_vhost", name)
    try:
        rabbitmqctl("set_permissions", "-p", name, urlsplit(url).username or "guest",
                    ".*", ".*", ".*")
        yield urlunsplit(urlsplit(url)._replace(path="/" + quote(name, safe="")))
    finally:
        rabbitmqctl("delete_vhost", name)


@pytest.fixture(scope="module")
def quorum_env(quorum_vhost: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """A worker whose queue is a quorum queue on a topic exchange: Celery delays its messages
    through RabbitMQ (a direct exchange has Celery's worker hold them instead)."""
    tmp = tmp_path_factory.mktemp("quorum")
    config = {"broker_url": quorum_vhost,
              "celery": {"task_default_queue_type": "quorum",
                         "task_default_exchange_type": "topic"}}
    with start_env("amqp", pathlib.Path(tmp), config=config, concurrency=2) as started:
        yield started


def test_a_job_due_within_a_second_is_published_at_once(quorum_env: Env) -> None:
    """Celery routes a delayed message by the whole seconds it must wait and refuses fewer
    than one; a job due that soon (a one-second countdown, a retry's short backoff, an
    envelope's near ``scheduled_at``) is published for a second later, not left in the outbox
    (no sweeper runs here: a job left there would never run). None runs before its time."""
    env = quorum_env
    started = time.time()
    delayed = env.app.tasks["e2e.add"].apply_async((1, 2), countdown=1)
    due = started + 0.4
    scheduled = enqueue({"type": "e2e.add", "args": [2, 3],
                         "scheduled_at": format_timestamp(from_epoch(due))}, app=env.app)
    for job_id, not_before, result in ((delayed.id, started + 1, 3), (scheduled.id, due, 5)):
        job = env.wait_state(job_id, "completed", timeout=30)
        assert job.result == result
        assert job.started_at is not None and job.started_at.timestamp() >= not_before
