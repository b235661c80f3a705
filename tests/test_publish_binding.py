"""The queue an OJS message is published to is bound to the broker channel once, not once per
message (``producer.bound_queue``), and Celery's declaration of that queue still happens as it
would: a queue missing on the broker is made by the first message, and made again after the
connection was lost, on a real RabbitMQ and a real Redis. On kombu 5.5 and 5.6, whose publish
retries cannot use a queue bound before a reconnect, the queue is named as Celery names it."""

from __future__ import annotations

import pathlib
import socket
import threading
from collections.abc import Iterator

import pytest
from celery import Celery
from kombu import Connection, Producer, Queue
from kombu.common import Broadcast

from ojs_celery import OJSTask, compat, enqueue, enqueue_batch, install
from ojs_celery.producer import bound_queue
from ojs_celery.runtime import get_runtime
from tests.services import amqp_url, redis_url
from tests.workers import unique, wait_for

TYPE = "binding.noop"


def make_app(broker: str, tmp_path: pathlib.Path, **conf: object) -> Celery:
    app = Celery(unique("binding"), broker=broker, set_as_current=False)
    app.conf.update({"task_default_queue": unique("bq"), **conf})
    app.conf.ojs = {"store_url": f"sqlite:///{tmp_path / 'store.sqlite3'}", "events": False}
    install(app)

    @app.task(shared=False, name=TYPE, base=OJSTask)
    def noop() -> None:
        return None

    return app


@pytest.fixture
def rabbit_app(tmp_path: pathlib.Path) -> Iterator[Celery]:
    app = make_app(amqp_url(), tmp_path)
    try:
        yield app
    finally:
        get_runtime(app).close()
        with Connection(amqp_url()) as connection:
            for name in [app.conf.task_default_queue, *app.amqp.queues]:
                try:
                    connection.default_channel.queue_delete(name)
                except Exception:  # never made on the broker
                    pass
        app.close()


def waiting_on_rabbitmq(queue: str) -> int | None:
    """How many messages ``queue`` holds on the broker; None when it does not exist."""
    with Connection(amqp_url()) as connection:
        try:
            return int(connection.default_channel.queue_declare(queue, passive=True).message_count)
        except Exception:  # NOT_FOUND: the broker has no such queue
            return None


def test_a_queue_is_bound_once_per_channel_and_follows_the_apps_definition(
    tmp_path: pathlib.Path,
) -> None:
    app = make_app(redis_url(), tmp_path)
    name = app.conf.task_default_queue
    try:
        with Connection(redis_url()) as connection:  # its own: the app's pool may be up
            producer = Producer(connection)
            assert bound_queue(app, name, producer) == name  # not connected yet: Celery's way
            connection.ensure_connection(max_retries=1)
            if not compat.keeps_bound_queues():  # kombu 5.5, 5.6: Celery's way, always
                assert bound_queue(app, name, producer) == name
                return
            first = bound_queue(app, name, producer)
            assert isinstance(first, Queue)
            assert first.is_bound and first.channel is producer.connection.default_channel
            assert first.name == name
            assert bound_queue(app, name, producer) is first  # once per channel
            app.amqp.queues[name] = Queue(name, routing_key="elsewhere")
            redefined = bound_queue(app, name, producer)
            assert isinstance(redefined, Queue) and redefined is not first
            assert redefined.routing_key == "elsewhere"
            fanout = unique("bcast")
            app.amqp.queues[fanout] = Broadcast(fanout)
            assert bound_queue(app, fanout, producer) == fanout  # Celery's own way
            app.amqp.queues.create_missing = False  # task_create_missing_queues off
            missing = unique("nowhere")
            assert bound_queue(app, missing, producer) == missing  # Celery raises as it would
    finally:
        get_runtime(app).close()
        app.close()


def test_a_missing_rabbitmq_queue_is_made_by_the_first_message_and_after_a_reconnect(
    rabbit_app: Celery,
) -> None:
    queue = unique("bq-routed")
    first = enqueue({"type": TYPE, "args": [], "queue": queue}, app=rabbit_app)
    wait_for(lambda: waiting_on_rabbitmq(queue) == 1, 15, "the first job's message")
    with Connection(amqp_url()) as connection:
        connection.default_channel.queue_delete(queue)
    assert waiting_on_rabbitmq(queue) is None
    with rabbit_app.producer_or_acquire() as producer:  # the one the enqueues used (LIFO pool)
        bound = bound_queue(rabbit_app, queue, producer)
        if compat.keeps_bound_queues():
            assert isinstance(bound, Queue) and bound.is_bound  # kept from the first enqueue
        producer.connection.connection.transport.sock.shutdown(socket.SHUT_RDWR)  # cut
    second = enqueue({"type": TYPE, "args": [], "queue": queue}, app=rabbit_app)
    assert second.id != first.id
    wait_for(lambda: waiting_on_rabbitmq(queue) == 1, 15, "the second job's message")


def test_a_batch_to_a_missing_rabbitmq_queue_makes_it_and_fills_it(rabbit_app: Celery) -> None:
    queue = unique("bq-batch")
    jobs = enqueue_batch([{"type": TYPE, "args": [], "queue": queue} for _ in range(25)],
                         app=rabbit_app)
    assert len(jobs) == 25
    wait_for(lambda: waiting_on_rabbitmq(queue) == 25, 15, "the batch's 25 messages")


def test_threads_publishing_at_once_each_use_their_own_channel(rabbit_app: Celery) -> None:
    """Producers in threads take pooled connections of their own: each binds the queue to its
    channel, and every job's message arrives, once."""
    queue = unique("bq-threads")
    task = rabbit_app.tasks[TYPE]
    ids: list[str] = []
    lock = threading.Lock()

    def produce() -> None:
        for _ in range(50):
            job_id = task.apply_async(queue=queue).id
            with lock:
                ids.append(job_id)

    threads = [threading.Thread(target=produce) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(set(ids)) == 300
    wait_for(lambda: waiting_on_rabbitmq(queue) == 300, 15, "300 messages in the queue")
    assert waiting_on_rabbitmq(queue) == 300  # and no more
