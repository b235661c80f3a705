"""A new job's record and message in one write when the job store is the broker's Redis
(``ojs_celery/joint.py``): one script call instead of an insert and kombu's ``LPUSH``, both or
neither, on a private ``redis-server`` (broker and store) so that its command counts and its
faults are this test's own."""

from __future__ import annotations

import json
import logging
import pathlib
import time
from typing import Any

import kombu
import pytest
from celery import Celery
from celery.signals import before_task_publish
from kombu import Queue
from kombu.transport import redis as kombu_redis

from ojs_celery import DuplicateJob, OJSTask, enqueue, header, install, parse_envelope
from ojs_celery.joint import JointCreate
from ojs_celery.store import StoreError
from ojs_celery.store.redis import RedisStore
from ojs_celery.sweeper import sweep
from tests.conftest import start_env
from tests.test_fencing_replies import CuttingProxy
from tests.test_store_faults import PrivateRedis
from tests.workers import unique

TYPE = "joint.add"


@pytest.fixture
def server(redis_server: PrivateRedis) -> PrivateRedis:
    """This module's name for the test's own ``redis-server`` (conftest's ``redis_server``)."""
    return redis_server


def make_app(broker: str, store: str | None = None, **conf: Any) -> Celery:
    app = Celery(unique("joint"), broker=broker, set_as_current=False)
    app.conf.update({"task_default_queue": unique("jq"), **conf})
    app.conf.ojs = {"store_url": store or broker, "events": False}
    install(app)

    @app.task(shared=False, name=TYPE, base=OJSTask)
    def add(x: int, y: int) -> int:
        return x + y

    return app


def queued(server: PrivateRedis, pattern: str = "*") -> dict[str, list[str]]:
    """Job id -> the broker lists holding its message (kombu keeps one list per priority)."""
    found: dict[str, list[str]] = {}
    for key in server.admin.keys(pattern):
        if server.admin.type(key) == "list" and not key.startswith("_kombu"):
            for message in server.admin.lrange(key, 0, -1):
                found.setdefault(json.loads(message)["headers"]["id"], []).append(key)
    return found


def reads(server: PrivateRedis) -> int:
    """The requests the server has read from its clients (scripts' own commands not counted)."""
    return int(server.admin.info("stats")["total_reads_processed"])


def stored_ids(server: PrivateRedis) -> list[str]:
    return [key.rsplit(":", 1)[1] for key in server.admin.keys("ojs:job:*")]


def test_a_new_job_is_stored_and_published_in_one_script_call(server: PrivateRedis) -> None:
    """``enqueue`` and ``.delay()``: the record (with no outbox entry: its message went with
    it) and the message, in one ``EVALSHA`` and no ``LPUSH`` of kombu's."""
    app = make_app(server.url)
    runtime = install(app)
    assert runtime.joint_store is runtime.store
    enqueue({"type": TYPE, "args": [0, 0]}, app=app)  # kombu declares the queue once
    before = reads(server)
    idle = reads(server) - before  # what reading the counter costs
    before = reads(server)
    job = enqueue({"type": TYPE, "args": [1, 2]}, app=app)
    result = app.tasks[TYPE].delay(20, 22)
    assert reads(server) - before - idle == 2  # one request each, no LPUSH of kombu's own
    assert sorted(queued(server)) == sorted(stored_ids(server))
    assert job.id in queued(server) and result.id in queued(server)
    assert runtime.store.due("dispatch", now=time.time() + 3600, limit=10) == []
    for job_id in (job.id, result.id):  # each message's snapshot is the record as written
        [key] = queued(server)[job_id]
        [message] = [json.loads(m) for m in server.admin.lrange(key, 0, -1)
                     if json.loads(m)["headers"]["id"] == job_id]
        fields, _, data = message["headers"][header.NAME][header.SNAPSHOT].partition("\n")
        stored = server.admin.hgetall(f"ojs:job:{job_id}")
        assert data == stored["data"]
        assert json.loads(fields)[:2] == [int(stored["version"]), int(stored["token"])]
    app.close()


def test_a_worker_runs_jobs_written_in_one_step(tmp_path: pathlib.Path) -> None:
    """A real worker takes the message the script pushed and runs the job once (the shared
    Redis as broker, result backend and store, as every Redis end-to-end test here)."""
    with start_env("redis", tmp_path) as env:
        assert install(env.app).joint_store is not None
        job = enqueue({"type": "e2e.add", "args": [1, 2]}, app=env.app)
        result = env.app.tasks["e2e.add"].delay(20, 22)
        assert env.wait_state(job.id, "completed").result == 3
        assert env.wait_state(result.id, "completed").result == 42
        assert result.get(timeout=10) == 42
        assert env.lines("runs").count(f"add {job.id}") == 1


def test_a_store_in_another_redis_database_is_written_apart(server: PrivateRedis) -> None:
    """Another database (or host name) of the same server is not the broker's keyspace: the
    record and the message are written apart, as before (the insert's outbox entry cleared
    once the message is out)."""
    app = make_app(server.url, server.url.replace("/0", "/1"))
    runtime = install(app)
    assert runtime.joint_store is None
    job = enqueue({"type": TYPE, "args": [1, 2]}, app=app)
    assert list(queued(server)) == [job.id]
    runtime.flush()
    assert runtime.store.due("dispatch", now=time.time() + 3600, limit=10) == []
    other = make_app(server.url.replace("127.0.0.1", "localhost"), server.url)
    assert install(other).joint_store is None
    runtime.store.clear()
    app.close()
    other.close()


def test_ojs_messages_of_a_store_elsewhere_reuse_one_kombu_client(
    server: PrivateRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the store elsewhere, kombu's ``_put`` still pushes each OJS message, but with one
    client of kombu's kept for its channel instead of a new one per message; the message lands
    in the list kombu would use (its key prefix, its priority lists), and a plain message of
    the same app still gets kombu's own client."""
    made: list[Any] = []
    create = kombu_redis.Channel._create_client

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        made.append(args)
        return create(self, *args, **kwargs)

    monkeypatch.setattr(kombu_redis.Channel, "_create_client", counted)
    app = make_app(server.url, server.url.replace("/0", "/1"),
                   broker_transport_options={"global_keyprefix": "pfx:"})
    runtime = install(app)
    assert runtime.joint_store is None
    queue = str(app.conf.task_default_queue)
    enqueue({"type": TYPE, "args": [0, 0]}, app=app)  # connections, the queue's declaration
    made.clear()
    jobs = [enqueue({"type": TYPE, "args": [i, i], "priority": priority}, app=app)
            for i, priority in enumerate((0, 100, -100, 0))]
    assert [args for args in made if not args] == []  # no synchronous client per message
    messages = queued(server)
    for job in jobs:
        [key] = messages[job.id]
        assert key.startswith(f"pfx:{queue}")
        plain = app.send_task("plain.task", queue=queue, priority=job_priority(app, key, queue))
        assert queued(server)[plain.id] == [key]  # the list kombu itself picks
    assert len([args for args in made if not args]) == len(jobs)  # kombu's, per plain message
    runtime.store.clear()
    app.close()


def test_a_worker_runs_jobs_whose_messages_the_kept_client_pushed(tmp_path: pathlib.Path) -> None:
    """A Redis broker with the job store in SQLite: a real worker runs each job once, and its
    retries (published again from the worker through the same ``_put``) too."""
    store = f"sqlite:///{tmp_path / 'elsewhere.sqlite3'}"
    with start_env("redis", tmp_path, config={"ojs": {"store_url": store}}) as env:
        assert install(env.app).joint_store is None
        jobs = [enqueue({"type": "e2e.add", "args": [i, 1]}, app=env.app) for i in range(3)]
        flaky = enqueue({"type": "e2e.fail_until", "args": [3],
                         "retry": {"max_attempts": 3, "initial_interval": "PT0.1S"}},
                        app=env.app)
        for i, job in enumerate(jobs):
            assert env.wait_state(job.id, "completed").result == i + 1
            assert env.lines("runs").count(f"add {job.id}") == 1
        done = env.wait_state(flaky.id, "completed")
        assert (done.attempt, done.result) == (3, "ok on 3")


def test_celerys_protocol_1_is_written_apart(server: PrivateRedis) -> None:
    """Celery's message protocol 1 keeps the task id in the body, where kombu's ``_put``
    cannot see it: the record and the message are written apart, and a taken id still
    publishes nothing."""
    app = make_app(server.url, task_protocol=1)
    assert install(app).joint_store is None
    chosen = "0193a2b4-0000-7000-8000-000000000003"
    job = enqueue({"id": chosen, "type": TYPE, "args": [1, 2]}, app=app)
    with pytest.raises(DuplicateJob):
        enqueue({"id": chosen, "type": TYPE, "args": [3, 4]}, app=app)
    assert stored_ids(server) == [job.id]
    assert sum(server.admin.llen(key) for key in server.admin.keys("jq*")) == 1
    app.close()


def test_an_error_reply_stores_nothing_and_publishes_nothing(server: PrivateRedis) -> None:
    """Redis out of memory (``noeviction``): ``enqueue`` raises StoreError naming the
    refusal; no record, no message, and no ``after_task_publish`` for a message not sent."""
    app = make_app(server.url)
    enqueue({"type": TYPE, "args": [0, 0]}, app=app)  # kombu declares the queue
    before = set(stored_ids(server))
    server.admin.config_set("maxmemory", 1)
    try:
        with pytest.raises(StoreError, match="maxmemory"):
            enqueue({"type": TYPE, "args": [1, 2]}, app=app)
        with pytest.raises(StoreError, match="maxmemory"):
            app.tasks[TYPE].delay(1, 2)
    finally:
        server.admin.config_set("maxmemory", 0)
    assert set(stored_ids(server)) == before
    assert sorted(queued(server)) == sorted(before)
    job = enqueue({"type": TYPE, "args": [3, 4]}, app=app)  # and it works again
    assert job.id in queued(server)
    app.close()


def test_a_queue_key_of_another_type_is_refused_before_any_write(server: PrivateRedis) -> None:
    """The queue's key holds a string (Redis would refuse kombu's ``LPUSH`` with WRONGTYPE):
    checked before the record is written, so nothing is stored."""
    app = make_app(server.url)
    queue = str(app.conf.task_default_queue)
    enqueue({"type": TYPE, "args": [0, 0]}, app=app)
    stored = set(stored_ids(server))
    for key in [queue, *(key for key in server.admin.keys(queue + "*"))]:
        server.admin.delete(key)
        server.admin.set(key, "not a list")
    with pytest.raises(StoreError, match="WRONGTYPE"):
        enqueue({"type": TYPE, "args": [1, 2]}, app=app)
    assert set(stored_ids(server)) == stored
    app.close()


def test_a_lost_reply_after_the_write_leaves_one_job_and_one_message(
    server: PrivateRedis,
) -> None:
    """The script ran but its reply was cut with the connection: sent again, it finds its own
    record and pushes nothing more; ``enqueue`` returns the job, stored once, queued once."""
    proxy = CuttingProxy(("127.0.0.1", server.port))
    url = f"redis://127.0.0.1:{proxy.port}/0"
    app = make_app(url)
    try:
        enqueue({"type": TYPE, "args": [0, 0]}, app=app)
        proxy.match = b"EVALSHA"
        proxy.armed.set()
        job = enqueue({"type": TYPE, "args": [1, 2]}, app=app)
        assert proxy.cuts == 1 and install(app).joint_store is not None
        assert queued(server)[job.id] and len(queued(server)[job.id]) == 1
        assert stored_ids(server).count(job.id) == 1
        stored = install(app).store.get(job.id)
        assert stored is not None and stored.state == "available"
    finally:
        app.close()
        proxy.close()


def test_other_messages_published_meanwhile_go_through_kombu(server: PrivateRedis) -> None:
    """A ``before_task_publish`` receiver that publishes another message while the job's is
    on its way: that one goes through kombu as always, the job's with its record."""
    app = make_app(server.url)
    aside = unique("aside")

    def publish_aside(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if sender == TYPE:
            app.send_task("plain.elsewhere", args=[headers["id"]], queue=aside)

    before_task_publish.connect(publish_aside, weak=False)
    try:
        job = enqueue({"type": TYPE, "args": [1, 2]}, app=app)
    finally:
        before_task_publish.disconnect(publish_aside)
    messages = queued(server)
    assert job.id in messages and stored_ids(server) == [job.id]
    assert [key for ids in messages.values() for key in ids if key.startswith(aside)]
    app.close()


def test_kombus_key_prefix_is_kept(server: PrivateRedis) -> None:
    """``global_keyprefix``: the message lands in the prefixed list a worker reads, the same
    one kombu puts a plain message of the same queue and priority in."""
    app = make_app(server.url, broker_transport_options={"global_keyprefix": "pfx:"})
    queue = str(app.conf.task_default_queue)
    job = enqueue({"type": TYPE, "args": [1, 2]}, app=app)
    [key] = queued(server)[job.id]
    assert key.startswith(f"pfx:{queue}")
    plain = app.send_task("plain.task", queue=queue, priority=job_priority(app, key, queue))
    assert queued(server)[plain.id] == [key]
    app.close()


def job_priority(app: Celery, key: str, queue: str) -> int:
    """The broker priority that kombu's list ``key`` of ``queue`` holds (``q\x06\x16N``)."""
    rest = key.removeprefix(f"pfx:{queue}")
    return int(rest[-1]) if rest else 0


@pytest.mark.skipif(tuple(kombu.VERSION[:2]) < (5, 7),
                    reason="kombu's Redis transport honours x-expires from 5.7 on")
def test_a_queue_that_expires_keeps_kombus_own_push(server: PrivateRedis) -> None:
    """A queue declared with ``x-expires``: kombu renews the lists' expiry with its push, so
    the message goes its own way, after its record (written first, with its outbox entry,
    cleared once the message is out). A client-chosen id that is taken pushes nothing."""
    queue = unique("ttlq")
    app = make_app(server.url, task_queues=[Queue(queue, expires=60)],
                   task_default_queue=queue)
    runtime = install(app)
    job = enqueue({"type": TYPE, "args": [1, 2]}, app=app)
    [key] = queued(server)[job.id]
    assert server.admin.pttl(key) > 0  # kombu's own push set it
    runtime.flush()
    stored = runtime.store.get_record(job.id)
    assert stored is not None and stored.dispatch_due is None
    assert runtime.store.due("dispatch", now=time.time() + 3600, limit=10) == []
    chosen = "0193a2b4-0000-7000-8000-000000000002"
    enqueue({"id": chosen, "type": TYPE, "args": [1, 2]}, app=app)
    with pytest.raises(DuplicateJob):
        enqueue({"id": chosen, "type": TYPE, "args": [3, 4]}, app=app)
    assert sorted(queued(server)) == sorted([job.id, chosen])
    assert len(server.admin.lrange(key, 0, -1)) == 2
    app.close()


def test_a_message_never_handed_over_leaves_the_job_owed(server: PrivateRedis) -> None:
    """When the publish fails before kombu's push, the record is written alone with its outbox
    entry (the sweeper publishes it); when kombu pushed it its own way, without."""
    app = make_app(server.url)
    store = install(app).store
    assert isinstance(store, RedisStore)
    owed, sent = (JointCreate(store, store.new_record(parse_envelope({"type": TYPE, "args": [n]})))
                  for n in range(2))
    owed.finish(published=False)
    sent.finish(published=True)
    due = [job_id for job_id, _ in store.due("dispatch", now=time.time() + 3600, limit=10)]
    assert due == [owed.job_id]
    assert sorted(stored_ids(server)) == sorted([owed.job_id, sent.job_id])
    app.close()


def test_a_chosen_id_is_checked_in_the_same_step(server: PrivateRedis) -> None:
    """A client-chosen id: the same envelope again returns the stored job, another envelope
    with that id raises DuplicateJob; neither pushes a second message."""
    app = make_app(server.url)
    job_id = "0193a2b4-0000-7000-8000-000000000001"
    first = enqueue({"id": job_id, "type": TYPE, "args": [1, 2]}, app=app)
    again = enqueue({"id": job_id, "type": TYPE, "args": [1, 2]}, app=app)
    assert again.id == first.id == job_id and again.created_at == first.created_at
    with pytest.raises(DuplicateJob):
        enqueue({"id": job_id, "type": TYPE, "args": [3, 4]}, app=app)
    result = app.tasks[TYPE].apply_async((1, 2), task_id=unique("celery-id-"))
    assert queued(server) == {job_id: queued(server)[job_id], result.id: queued(server)[result.id]}
    assert [len(keys) for keys in queued(server).values()] == [1, 1]
    app.close()


def test_a_publish_that_fails_before_the_push_leaves_the_job_stored_and_owed(
    server: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """kombu fails before its push (its binding key for the queue's exchange holds a string:
    declaring the queue gets WRONGTYPE): the job is stored alone, with its outbox entry, the
    caller gets it with one ERROR line, and the sweeper publishes it once the broker is fixed."""
    app = make_app(server.url)
    runtime = install(app)
    exchange = str(app.conf.task_default_queue)  # Celery's default exchange is named so
    server.admin.set(f"_kombu.binding.{exchange}", "not a set")
    with caplog.at_level(logging.ERROR, logger="ojs_celery"):
        job = enqueue({"type": TYPE, "args": [1, 2]}, app=app)
    assert any("could not be published" in r.getMessage() for r in caplog.records)
    assert stored_ids(server) == [job.id] and queued(server) == {}
    owed = runtime.store.due("dispatch", now=time.time() + 3600, limit=10)
    assert [job_id for job_id, _ in owed] == [job.id]
    server.admin.delete(f"_kombu.binding.{exchange}")
    assert sweep(runtime, now=time.time() + 3600).error is None
    assert list(queued(server)) == [job.id]
    app.close()
