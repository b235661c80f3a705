"""kombu's Redis QoS records, acknowledges and rejects OJS messages with one client kept per
channel (``ojs_celery/kept_client.py``) instead of a new client per command, and its
bookkeeping stays kombu's: the same keys (prefix included), the same entries, the same
restore of what was never acknowledged. On a private ``redis-server`` (broker and store)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Consumer, Queue
from kombu.transport import redis as kombu_redis

from ojs_celery import enqueue, install
from ojs_celery.kept_client import install_qos
from tests.conftest import start_env
from tests.test_joint import TYPE, make_app
from tests.test_store_faults import PrivateRedis
from tests.workers import wait_for


@pytest.fixture
def server(tmp_path: pathlib.Path) -> Iterator[PrivateRedis]:
    private = PrivateRedis(tmp_path)
    try:
        yield private
    finally:
        private.stop()


@pytest.fixture
def clients_made(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every synchronous client kombu's Redis channels make from now on."""
    made: list[Any] = []
    create = kombu_redis.Channel._create_client

    def counted(self: Any, asynchronous: bool = False) -> Any:
        client = create(self, asynchronous)
        if not asynchronous:
            made.append(client)
        return client

    monkeypatch.setattr(kombu_redis.Channel, "_create_client", counted)
    return made


def unacked(server: PrivateRedis, prefix: str = "") -> tuple[set[str], set[str]]:
    """kombu's bookkeeping of delivered messages: the tags in its hash and in its index."""
    return (set(server.admin.hkeys(f"{prefix}unacked")),
            set(server.admin.zrange(f"{prefix}unacked_index", 0, -1)))


def test_ojs_messages_are_recorded_and_acknowledged_with_one_client(
    server: PrivateRedis, clients_made: list[Any]
) -> None:
    """A consumer takes OJS and plain messages from one queue: kombu records each delivery
    and removes it on ack or reject, in its own prefixed keys, but makes no client for an OJS
    message's commands (one is kept for the channel), while each plain message still gets
    kombu's two."""
    app = make_app(server.url, broker_transport_options={"global_keyprefix": "pfx:"})
    install_qos()
    queue = str(app.conf.task_default_queue)
    jobs = [enqueue({"type": TYPE, "args": [i, i]}, app=app).id for i in range(4)]
    plain = [app.send_task("plain.task", queue=queue).id for _ in range(2)]
    with app.connection_for_read() as connection:
        taken: dict[str, Any] = {}

        def received(body: Any, message: Any) -> None:
            taken[message.headers["id"]] = message
            tags = {message.delivery_tag}
            assert all(tags <= keys for keys in unacked(server, "pfx:"))  # recorded, prefixed

        # as a worker consumes: kombu's BRPOP on its channel's own client, then QoS.append
        with Consumer(connection, [Queue(queue)], callbacks=[received], accept=["json"]):
            clients_made.clear()
            while len(taken) < len(jobs) + len(plain):
                connection.drain_events(timeout=10)
        assert sorted(taken) == sorted(jobs + plain)
        delivered = len(clients_made)
        taken[jobs[0]].reject(requeue=False)
        for job_id in jobs[1:] + plain:
            taken[job_id].ack()
        assert unacked(server, "pfx:") == (set(), set())  # every entry removed
        assert delivered == 1 + len(plain)  # the channel's kept client; kombu's per plain one
        assert len(clients_made) == delivered + len(plain)  # acks: none for an OJS message
    app._ojs_runtime.store.clear()
    app.close()


def test_an_ojs_message_never_acknowledged_goes_back_to_its_queue(server: PrivateRedis) -> None:
    """What the kept client recorded is what kombu restores: a consumer whose channel closes
    with an OJS message taken and not acknowledged puts it back in the queue, once."""
    app = make_app(server.url)
    install_qos()
    queue = str(app.conf.task_default_queue)
    job = enqueue({"type": TYPE, "args": [1, 2]}, app=app)
    with app.connection_for_read() as connection:
        message = connection.default_channel.basic_get(queue)
        assert message.headers["id"] == job.id
        assert unacked(server) != (set(), set())
    assert unacked(server) == (set(), set())
    with app.connection_for_read() as connection:
        again = connection.default_channel.basic_get(queue)
        assert again is not None and again.headers["id"] == job.id
        again.ack()
        assert connection.default_channel.basic_get(queue) is None
    app._ojs_runtime.store.clear()
    app.close()


def test_a_worker_leaves_no_delivery_unacknowledged(tmp_path: pathlib.Path) -> None:
    """A real worker on a Redis broker (where its main process installs the hooks): every job
    runs once, its retry too, and kombu's record of the deliveries keeps none of them."""
    with start_env("redis", tmp_path) as env:
        assert install(env.app).joint_store is not None
        jobs = [enqueue({"type": "e2e.add", "args": [i, 1]}, app=env.app) for i in range(5)]
        flaky = enqueue({"type": "e2e.fail_until", "args": [2],
                         "retry": {"max_attempts": 2, "initial_interval": "PT0.1S"}},
                        app=env.app)
        for i, job in enumerate(jobs):
            assert env.wait_state(job.id, "completed").result == i + 1
            assert env.lines("runs").count(f"add {job.id}") == 1
        assert env.wait_state(flaky.id, "completed").attempt == 2
        broker = redis.Redis.from_url(env.config["broker_url"], decode_responses=True)
        ours = {job.id for job in jobs} | {flaky.id}

        def still_recorded() -> set[str]:
            """Our jobs among kombu's unacknowledged deliveries (the Redis is shared)."""
            entries = broker.hvals("unacked")
            return {json.loads(entry)[0]["headers"]["id"] for entry in entries} & ours

        # acknowledged by the main process once the pool child returns (acks_late)
        wait_for(lambda: not still_recorded(), 15, "every delivery acknowledged")
        broker.close()
