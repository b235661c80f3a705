"""kombu's Redis QoS records, acknowledges and rejects OJS messages with one client kept per
channel (``ojs_celery/kept_client.py``) instead of a new client per command, and its
bookkeeping stays kombu's: the same keys (prefix included), the same entries, the same
restore of what was never acknowledged. An OJS message's ack leaves kombu's record in a later
batch (``ojs_celery/unacked.py``): sent before a worker stops or restarts, and, when a killed
worker never sent it, harmless (the restored messages are dropped). On a private
``redis-server`` (broker and store)."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Queue
from kombu.transport import redis as kombu_redis

import ojs_celery.unacked
from ojs_celery import enqueue, enqueue_batch, get_job
from ojs_celery.kept_client import install_qos
from tests.e2eapp import make_app as e2e_app
from tests.test_joint import TYPE, make_app, queued
from tests.test_store_faults import PrivateRedis
from tests.workers import Worker, lines, redis_config, running_worker, unique, wait_for

ROOT = pathlib.Path(__file__).resolve().parents[1]


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


def unacked(redis_server: PrivateRedis, prefix: str = "") -> tuple[set[str], set[str]]:
    """kombu's bookkeeping of delivered messages: the tags in its hash and in its index."""
    return (set(redis_server.admin.hkeys(f"{prefix}unacked")),
            set(redis_server.admin.zrange(f"{prefix}unacked_index", 0, -1)))


def take_by_id(connection: Any, queue: str, count: int) -> dict[str, Any]:
    """``count`` messages taken from ``queue`` as a worker's consumer takes them (kombu records
    each delivery), by task id; none acknowledged."""
    taken: dict[str, Any] = {}

    def received(_body: Any, message: Any) -> None:
        taken[message.headers["id"]] = message

    with Consumer(connection, [Queue(queue)], accept=["json"], callbacks=[received]):
        while len(taken) < count:
            connection.drain_events(timeout=10)
    return taken


def test_ojs_messages_are_recorded_and_acknowledged_with_one_client(
    redis_server: PrivateRedis, clients_made: list[Any]
) -> None:
    """A consumer takes OJS and plain messages from one queue: kombu records each delivery
    and removes it on ack or reject (an OJS message's ack in a later batch), in its own
    prefixed keys, but makes no client for an OJS message's commands (one is kept for the
    channel), while each plain message still gets kombu's two."""
    app = make_app(redis_server.url, broker_transport_options={"global_keyprefix": "pfx:"})
    install_qos(app)
    queue = str(app.conf.task_default_queue)
    jobs = [enqueue({"type": TYPE, "args": [i, i]}, app=app).id for i in range(4)]
    plain = [app.send_task("plain.task", queue=queue).id for _ in range(2)]
    with app.connection_for_read() as connection:
        taken: dict[str, Any] = {}

        def received(body: Any, message: Any) -> None:
            taken[message.headers["id"]] = message
            tags = {message.delivery_tag}
            # recorded, in the prefixed keys
            assert all(tags <= keys for keys in unacked(redis_server, "pfx:"))

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
        ojs_celery.unacked.flush()  # the OJS acks' removals, sent in a batch
        assert unacked(redis_server, "pfx:") == (set(), set())  # every entry removed
        assert delivered == 1 + len(plain)  # the channel's kept client; kombu's per plain one
        assert len(clients_made) == delivered + len(plain)  # acks: none for an OJS message
    app._ojs_runtime.store.clear()
    app.close()


def test_an_ojs_message_not_acknowledged_goes_back_to_its_queue(
    redis_server: PrivateRedis, clients_made: list[Any]
) -> None:
    """What the kept client recorded is what kombu restores (a key prefix and a priority
    list included): a consumer whose channel closes with an OJS message taken and not
    acknowledged puts it back in the queue, and so does a reject with requeue; each time
    kombu's record ends empty, and the message is taken once more."""
    app = make_app(redis_server.url, broker_transport_options={"global_keyprefix": "pfx:"})
    install_qos(app)
    queue = str(app.conf.task_default_queue)
    job = enqueue({"type": TYPE, "args": [1, 2], "priority": 100}, app=app)

    def take(connection: Any) -> Any:
        taken: list[Any] = []
        with Consumer(connection, [Queue(queue)], accept=["json"],
                      callbacks=[lambda _body, message: taken.append(message)]):
            clients_made.clear()  # the queue's declaration made kombu's own
            while not taken:
                connection.drain_events(timeout=10)
            [message] = taken
            assert message.headers["id"] == job.id
            return message

    with app.connection_for_read() as connection:
        take(connection)
        assert len(clients_made) == 1  # the channel's kept client recorded the delivery
        assert unacked(redis_server, "pfx:") != (set(), set())
    assert unacked(redis_server, "pfx:") == (set(), set())  # restored when the channel closed
    with app.connection_for_read() as connection:
        take(connection).reject(requeue=True)
        assert unacked(redis_server, "pfx:") == (set(), set())
        again = take(connection)
        again.ack()
        ojs_celery.unacked.flush()
        assert unacked(redis_server, "pfx:") == (set(), set())
        assert connection.default_channel.basic_get(queue) is None
    app._ojs_runtime.store.clear()
    app.close()


def test_a_worker_records_each_delivery_and_removes_it(
    redis_server: PrivateRedis, tmp_path: pathlib.Path
) -> None:
    """A real worker on a private Redis broker (its main process installs the hooks at start;
    the job store in SQLite, so that the server holds kombu's keys alone): a running job's
    delivery is in kombu's record, every job runs once, and once all are done the record is
    empty; the same after the server cuts every connection (kombu reconnects the worker and
    the producer)."""
    config = redis_config(tmp_path, redis_server.url)
    config["ojs"]["store_url"] = f"sqlite:///{tmp_path / 'store.sqlite3'}"
    config["ojs"]["events"] = False
    app = e2e_app(config)
    with running_worker(config, tmp_path / "worker.log"):
        slow = enqueue({"type": "e2e.sleep", "args": [2]}, app=app)

        def recorded(job_id: str) -> bool:
            return any(json.loads(entry)[0]["headers"]["id"] == job_id
                       for entry in redis_server.admin.hvals("unacked"))

        wait_for(lambda: recorded(slow.id), 15, "the running job's delivery recorded")
        jobs = enqueue_batch([{"type": "e2e.add", "args": [i, 1]} for i in range(40)], app=app)

        def completed(job_id: str) -> Any:
            job = get_job(job_id, app=app)
            return job if job is not None and job.state == "completed" else None

        def all_done(jobs: list[Any]) -> None:
            for i, job in enumerate(jobs):
                done = wait_for(functools.partial(completed, job.id), 30, f"{job.id} completed")
                assert done.result == i + 1
            wait_for(lambda: unacked(redis_server) == (set(), set()), 15,
                     "every delivery removed")
            runs = lines(config["dir"], "runs")
            assert all(runs.count(f"add {job.id}") == 1 for job in jobs)

        wait_for(lambda: completed(slow.id), 15, "the slow job completed")
        all_done(jobs)
        redis_server.admin.client_kill_filter(_type="normal", skipme=True)
        all_done(enqueue_batch([{"type": "e2e.add", "args": [i, 1]} for i in range(10)],
                               app=app))
    app._ojs_runtime.store.clear()
    app.close()


def test_a_refused_removal_leaves_the_delivery_recorded_and_says_so(
    redis_server: PrivateRedis, clients_made: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Redis refuses the removal of acknowledged deliveries (an error reply: kombu's index
    key holds another type). A plain message's ack raises it, as kombu does. An OJS message's
    ack returns (its removal is sent later, with no client built for it); the refusal is
    logged once, saying what it means, and what the refused command would have removed stays
    for kombu's restore (a worker drops what it puts back as already run). Once the key is
    mended, the next OJS ack's removal goes through."""
    app = make_app(redis_server.url)
    install_qos(app)
    queue = str(app.conf.task_default_queue)
    jobs = [enqueue({"type": TYPE, "args": [i, 2]}, app=app).id for i in range(2)]
    plain = app.send_task("plain.task", queue=queue).id
    with app.connection_for_read() as connection:
        taken = take_by_id(connection, queue, 3)
        index = dict(redis_server.admin.zrange("unacked_index", 0, -1, withscores=True))
        redis_server.admin.delete("unacked_index")
        redis_server.admin.set("unacked_index", "not a sorted set")
        clients_made.clear()
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            taken[plain].ack()
        assert len(clients_made) == 1  # kombu's, for the plain message's ack
        refused = taken[jobs[0]]
        refused.ack()  # returns: the removal is queued
        ojs_celery.unacked.flush()
        assert len(clients_made) == 1
        [warning] = [r for r in caplog.records if r.name == "ojs_celery.unacked"]
        assert warning.levelname == "WARNING"
        assert "1 acknowledged OJS deliveries stay in kombu's unacked record" in warning.message
        assert "WRONGTYPE" in warning.message
        # MULTI/EXEC does not roll back: the HDEL went through, the ZREM did not
        redis_server.admin.delete("unacked_index")
        redis_server.admin.zadd("unacked_index", index)
        assert refused.delivery_tag in unacked(redis_server)[1]
        taken[jobs[1]].ack()
        ojs_celery.unacked.flush()
        assert taken[jobs[1]].delivery_tag not in set().union(*unacked(redis_server))
    app._ojs_runtime.store.clear()
    app.close()


def test_an_ojs_message_that_a_plain_task_runs_is_acknowledged_at_once(
    redis_server: PrivateRedis, monkeypatch: pytest.MonkeyPatch, clients_made: list[Any]
) -> None:
    """A message with an ``ojs`` header whose task the consuming app runs as a plain task (a
    ``type_map`` entry naming one, or a worker deployed before the task became an OJS task)
    has no fenced start to drop it if kombu restored it after a lost removal: its ack removes
    kombu's record at once, as kombu does, while an OJS task's ack still waits for the batch."""
    app = make_app(redis_server.url)
    plain_name = unique("plain")

    @app.task(shared=False, name=plain_name)
    def plain() -> None: ...

    install_qos(app)
    monkeypatch.setattr(ojs_celery.unacked.removals, "linger", 600.0)  # hold the batch
    queue = str(app.conf.task_default_queue)
    job = enqueue({"type": TYPE, "args": [1, 2]}, app=app).id
    headed = app.send_task(plain_name, queue=queue, headers={"ojs": {"token": 1}}).id
    with app.connection_for_read() as connection:
        taken = take_by_id(connection, queue, 2)
        assert "ojs" in taken[headed].headers
        clients_made.clear()
        taken[headed].ack()
        assert clients_made == []  # kombu's ack, sent with the channel's kept client
        held = unacked(redis_server)
        assert held[0] == {taken[job].delivery_tag} == held[1]  # the plain task's: removed
        taken[job].ack()
        assert unacked(redis_server) == held  # the OJS task's removal waits for its batch
        ojs_celery.unacked.flush()
        assert unacked(redis_server) == (set(), set())
    app._ojs_runtime.store.clear()
    app.close()


def test_a_worker_killed_before_sending_its_removals_leaves_finished_jobs_to_be_dropped(
    redis_server: PrivateRedis, tmp_path: pathlib.Path
) -> None:
    """A worker runs ten jobs and is killed (SIGKILL, its whole process group) while the
    removals of their acknowledged deliveries still wait to be sent (the test app holds them):
    kombu's record keeps all ten. kombu's visibility-timeout restore (as a worker's poller runs
    it) puts them back in the queue; a second worker receives each once more and drops it
    without running it: every job ran once and stays completed, and the record and the queue
    end empty."""
    config = redis_config(tmp_path, redis_server.url)
    config["ojs"]["store_url"] = f"sqlite:///{tmp_path / 'store.sqlite3'}"
    config["ojs"]["events"] = False
    app = e2e_app(config)
    held = {**config, "unacked_linger": 600}
    victim = Worker(held, tmp_path / "victim.log")
    try:
        victim.wait_ready()
        jobs = enqueue_batch([{"type": "e2e.add", "args": [i, 1]} for i in range(10)], app=app)

        def completed() -> bool:
            return all(getattr(get_job(job.id, app=app), "state", None) == "completed"
                       for job in jobs)

        wait_for(completed, 30, "the ten jobs completed")
        wait_for(lambda: len(lines(config["dir"], "postrun")) == 10, 15,
                 "Celery's postrun of the ten")  # it follows the outcome's write
        recorded = {json.loads(entry)[0]["headers"]["id"]
                    for entry in redis_server.admin.hvals("unacked")}
        assert recorded == {job.id for job in jobs}  # acknowledged, not yet removed
    finally:
        os.killpg(victim.process.pid, signal.SIGKILL)
        victim.stop()
    with Connection(redis_server.url, transport_options={"visibility_timeout": 0}) as connection:
        connection.default_channel.qos.restore_visible(num=10)  # as a worker's poller does
    assert set(queued(redis_server)) == {job.id for job in jobs}
    with running_worker(config, tmp_path / "second.log"):
        def received_twice() -> bool:
            received = lines(config["dir"], "received")
            return all(sum(job.id in line for line in received) == 2 for job in jobs)

        wait_for(received_twice, 30, "kombu to put the ten messages back")
        wait_for(lambda: unacked(redis_server) == (set(), set()), 15, "the record emptied")
        assert queued(redis_server) == {}
        postrun = lines(config["dir"], "postrun")
        for job in jobs:
            assert [line.split()[1] for line in postrun if job.id in line] == [
                "SUCCESS", "IGNORED"]
    runs = lines(config["dir"], "runs")
    for i, job in enumerate(jobs):
        assert runs.count(f"add {job.id}") == 1
        done = get_job(job.id, app=app)
        assert done is not None and done.state == "completed" and done.attempt == 1
        assert done.result == i + 1
    app._ojs_runtime.store.clear()
    app.close()


def test_a_worker_stopped_warm_sends_its_removals_before_it_exits(
    redis_server: PrivateRedis, tmp_path: pathlib.Path
) -> None:
    """A worker whose removals of acknowledged deliveries wait (the test app holds them)
    stops warm (SIGTERM, as a deploy sends): it sends them on its way out, so kombu's record
    ends empty and nothing comes back."""
    config = redis_config(tmp_path, redis_server.url)
    config["ojs"]["store_url"] = f"sqlite:///{tmp_path / 'store.sqlite3'}"
    config["ojs"]["events"] = False
    app = e2e_app(config)
    with running_worker({**config, "unacked_linger": 600}, tmp_path / "worker.log") as worker:
        jobs = enqueue_batch([{"type": "e2e.add", "args": [i, 1]} for i in range(5)], app=app)
        wait_for(lambda: all(getattr(get_job(job.id, app=app), "state", None) == "completed"
                             for job in jobs), 30, "the five jobs completed")
        assert len(redis_server.admin.hkeys("unacked")) == 5  # acknowledged, not yet removed
        assert worker.stop() == 0
    assert unacked(redis_server) == (set(), set())
    assert queued(redis_server) == {}
    app._ojs_runtime.store.clear()
    app.close()


def test_a_worker_restarted_by_sighup_sends_its_removals_first(
    redis_server: PrivateRedis, tmp_path: pathlib.Path
) -> None:
    """A worker whose removals of acknowledged deliveries wait (the test app holds them) is
    restarted with SIGHUP, Celery's restart, which execs the new worker from an atexit
    handler: the removals are sent at the worker's shutdown, before that, so kombu's record
    ends empty; the restarted worker runs new jobs."""
    config = redis_config(tmp_path, redis_server.url)
    config["ojs"]["store_url"] = f"sqlite:///{tmp_path / 'store.sqlite3'}"
    config["ojs"]["events"] = False
    app = e2e_app(config)

    def all_completed(jobs: list[Any]) -> bool:
        return all(getattr(get_job(job.id, app=app), "state", None) == "completed"
                   for job in jobs)

    celery = str(pathlib.Path(sys.executable).with_name("celery"))  # restartable (see Worker)
    worker = Worker({**config, "unacked_linger": 600}, tmp_path / "worker.log", program=[celery])
    try:
        worker.wait_ready()
        jobs = enqueue_batch([{"type": "e2e.add", "args": [i, 1]} for i in range(5)], app=app)
        wait_for(lambda: all_completed(jobs), 30, "the five jobs completed")
        assert len(redis_server.admin.hkeys("unacked")) == 5  # acknowledged, not yet removed
        worker.process.send_signal(signal.SIGHUP)
        wait_for(lambda: worker.log().count(" ready.") == 2, 30, "the worker restarted")
        assert unacked(redis_server) == (set(), set())
        more = enqueue_batch([{"type": "e2e.add", "args": [i, 2]} for i in range(3)], app=app)
        wait_for(lambda: all_completed(more), 30, "the restarted worker ran new jobs")
    finally:
        worker.stop()
    runs = lines(config["dir"], "runs")
    assert all(runs.count(f"add {job.id}") == 1 for job in jobs + more)
    app._ojs_runtime.store.clear()
    app.close()


#: A consumer that takes one message and is killed (``os._exit``) without acknowledging it.
KILLED_CONSUMER = """
import os, sys
from celery import Celery
from kombu import Connection, Consumer, Queue
from ojs_celery.kept_client import install_qos

install_qos(Celery("killed", set_as_current=False))
with Connection(sys.argv[1]) as connection:
    taken = []
    with Consumer(connection, [Queue(sys.argv[2])], accept=["json"],
                  callbacks=[lambda body, message: taken.append(message)]):
        while not taken:
            connection.drain_events(timeout=10)
    assert "ojs" in taken[0].headers
    os._exit(0)
"""


def test_a_consumer_killed_holding_an_ojs_message_leaves_it_to_be_restored(
    redis_server: PrivateRedis,
) -> None:
    """A consumer takes an OJS message (recorded by the kept client) and is killed before its
    ack: the record keeps the delivery, and kombu's visibility-timeout restore puts the
    message back in its queue, once."""
    app = make_app(redis_server.url)
    queue = str(app.conf.task_default_queue)
    job = enqueue({"type": TYPE, "args": [1, 2]}, app=app)
    subprocess.run([sys.executable, "-c", KILLED_CONSUMER, redis_server.url, queue],
                   check=True, cwd=ROOT, timeout=60)
    assert queued(redis_server) == {}
    assert unacked(redis_server) != (set(), set())
    with Connection(redis_server.url, transport_options={"visibility_timeout": 0}) as connection:
        connection.default_channel.qos.restore_visible(num=10)  # as a worker's poller does
    assert unacked(redis_server) == (set(), set())
    [key] = queued(redis_server)[job.id]  # in one of kombu's priority lists of the queue
    assert key.startswith(queue) and len(queued(redis_server)) == 1
    app._ojs_runtime.store.clear()
    app.close()
