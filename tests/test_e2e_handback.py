"""Messages a worker received just before it died, which no beat of its listed: on a Redis broker
kombu keeps them in its ``unacked`` record for the broker's ``visibility_timeout`` (an hour), so
the sweeper that declares the worker dead puts back those whose job still waits for them
(:mod:`ojs_celery.handback`). The real kill is ``test_e2e_worker``'s
``test_kill_9_of_a_worker_holding_an_eta_message_runs_it_once_when_due`` (``unlisted``); here,
which messages go back and what a failing broker does.

A private ``redis-server`` is broker and store. The dead worker is a process that took messages
with kombu and was killed (``kill -9``: kombu's record keeps them); the workers' records are
written as their beats would have left them; the sweeps run in this process.
"""

from __future__ import annotations

import json
import logging
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
from celery import Celery
from kombu import Exchange, Queue

from ojs_celery import cancel, enqueue
from ojs_celery.embedded import sqlite_url
from ojs_celery.runtime import Runtime, get_runtime
from ojs_celery.store import WorkerInfo
from ojs_celery.sweeper import PUT_BACK, PUT_BACK_TRIES, SweepReport, sweep
from tests.e2eapp import make_app
from tests.test_store_faults import PrivateRedis
from tests.workers import filesystem_config, unique, wait_for

#: Takes ``count`` messages from a queue as a consumer would (kombu records each in its
#: ``unacked``), says so, and waits to be killed.
HOLDER = """
import sys, kombu
url, queue, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
options = {"global_keyprefix": sys.argv[4]} if len(sys.argv) > 4 else {}
with kombu.Connection(url, transport_options=options) as connection:
    channel = connection.channel()
    held = 0
    while held < count:
        if channel.basic_get(queue, no_ack=False) is not None:
            held += 1
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def broker(redis_server: PrivateRedis) -> PrivateRedis:
    return redis_server


@contextmanager
def app_on(broker: PrivateRedis, tmp_path: pathlib.Path, celery: dict[str, Any] | None = None,
           store_url: str | None = None,
           transport: dict[str, Any] | None = None) -> Iterator[Celery]:
    """An app on ``broker``, its job store there too unless ``store_url``."""
    config = filesystem_config(tmp_path)
    config.update(broker_url=broker.url, broker_transport_options=transport or {},
                  result_backend=f"db+sqlite:///{tmp_path / 'results.sqlite3'}",
                  celery=celery or {})
    config["ojs"] = {"store_url": store_url or broker.url, "store_prefix": unique("rd"),
                     "events": False}
    made = make_app(config)
    try:
        yield made
    finally:
        get_runtime(made).close()


@pytest.fixture
def app(broker: PrivateRedis, tmp_path: pathlib.Path) -> Iterator[Celery]:
    with app_on(broker, tmp_path) as made:
        yield made


def hold_and_die(broker: PrivateRedis, queue: str, count: int, prefix: str = "") -> float:
    """A consumer takes ``count`` messages and is killed; when it had taken them. ``prefix``:
    kombu's ``global_keyprefix``."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, broker.url, queue, str(count),
                               *([prefix] if prefix else [])],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        return time.time()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)


def beats(app: Celery, held_at: float, dead_listing: list[str], live_listing: list[str],
          dead_running: tuple[str, ...] = ()) -> None:
    """The dead worker's last beat, long before the messages came (listing ``dead_listing``
    as held, ``dead_running`` as running), and a live worker's, after them (listing
    ``live_listing``)."""
    store = get_runtime(app).store
    timeout = get_runtime(app).settings.worker_heartbeat_timeout
    wait_for(lambda: time.time() > held_at + 1.5, 5, "a beat's time after the messages")
    store.workers.save(WorkerInfo("dead", "host", 1, last_beat=time.time() - timeout - 5,
                                  reserved_job_ids=dead_listing,
                                  active_job_ids=list(dead_running)))
    store.workers.save(WorkerInfo("live", "host", 2, last_beat=time.time(),
                                  reserved_job_ids=live_listing))


def queued(broker: PrivateRedis, queue: str) -> list[str]:
    """The ids of the messages waiting in ``queue``."""
    return [json.loads(raw)["headers"]["id"] for raw in broker.admin.lrange(queue, 0, -1)]


def checked(report: SweepReport) -> SweepReport:
    assert report.error is None, report.error
    return report


def held_by_a_dead_worker(app: Celery, broker: PrivateRedis, args: list[int]) -> tuple[str, str]:
    """A job whose message a worker took after its last beat, then died: the queue and the
    job's id."""
    queue = unique("held")
    job_id = enqueue({"type": "e2e.add", "args": args, "queue": queue}, app=app).id
    beats(app, hold_and_die(broker, queue, 1), dead_listing=[], live_listing=[])
    return queue, job_id


@contextmanager
def put_back_failing(broker: PrivateRedis) -> Iterator[None]:
    """kombu's delivery index is not a sorted set (an error reply, ``WRONGTYPE``, to every
    put-back's read of it) until the block ends."""
    index = broker.admin.zrange("unacked_index", 0, -1, withscores=True)
    broker.admin.delete("unacked_index")
    broker.admin.set("unacked_index", "not a sorted set")
    try:
        yield
    finally:
        broker.admin.delete("unacked_index")
        broker.admin.zadd("unacked_index", dict(index))


def test_only_the_unlisted_messages_of_waiting_jobs_go_back(
    app: Celery, broker: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    queue = unique("held")
    job = {"type": "e2e.add", "args": [1, 2], "queue": queue}
    unlisted, live_held, dead_held, cancelled, retried = (enqueue(job, app=app).id
                                                          for _ in range(5))
    plain = app.send_task("e2e.plain", (1,), queue=queue).id
    held_at = hold_and_die(broker, queue, 6)
    # a hostile entry in kombu's record: not kombu's JSON
    broker.admin.hset("unacked", "garbage", "{not json")
    broker.admin.zadd("unacked_index", {"garbage": held_at})
    cancel(cancelled, app=app)
    # ``retried``: the beat listed its attempt running; the message of its retry (the record
    # waits for its token, as for these) came after
    beats(app, held_at, dead_listing=[dead_held], live_listing=[live_held],
          dead_running=(retried,))
    with caplog.at_level(logging.WARNING, logger="ojs_celery"):
        report = checked(sweep(get_runtime(app)))
    assert report.applied["worker"] == 1 and report.applied[PUT_BACK] == 2
    # back in the queue: the unlisted ones as they were, the dead worker's listed one as a copy
    # the store's redispatch published (same token)
    assert sorted(queued(broker, queue)) == sorted([unlisted, retried, dead_held])
    for job_id in (unlisted, retried, dead_held):
        record = get_runtime(app).store.get_record(job_id)
        assert record is not None and record.token == 1 and record.job.attempt == 0
    left = {json.loads(raw)[0]["headers"]["id"]
            for tag, raw in broker.admin.hgetall("unacked").items() if tag != "garbage"}
    assert left == {live_held, cancelled, plain, dead_held}
    said = [r.message for r in caplog.records if "put back in their queue" in r.message]
    assert said == [f"ojs_celery: put back in their queue 2 OJS message(s) that workers "
                    f"declared dead received after their last beat: jobs {unlisted}, {retried}"]
    assert checked(sweep(get_runtime(app))).applied[PUT_BACK] == 0  # nobody else died


def test_a_broker_that_answers_with_an_error_is_tried_again_next_pass(
    app: Celery, broker: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """kombu's index is not a sorted set (an error reply to the sweeper's read): one line, the
    worker still declared dead, the pass's other work done, the message left where it was and
    the worker's tombstone kept; the next pass, the broker mended, puts it back, even the
    pass of another sweeper, which never saw the failure; then the tombstone goes."""
    queue, waiting = held_by_a_dead_worker(app, broker, [1, 2])
    with put_back_failing(broker), caplog.at_level(logging.WARNING, logger="ojs_celery"):
        report = checked(sweep(get_runtime(app)))
    assert report.applied["worker"] == 1 and report.applied[PUT_BACK] == 0
    tombstone = get_runtime(app).store.workers.get("dead")
    assert tombstone is not None and tombstone.buried
    said = [r for r in caplog.records if "could not put back" in r.message]
    assert len(said) == 1 and said[0].exc_info is None and "WRONGTYPE" in said[0].message
    assert queued(broker, queue) == []
    assert [json.loads(raw)[0]["headers"]["id"]
            for raw in broker.admin.hvals("unacked")] == [waiting]
    another = Runtime(app)  # another sweeper: it knows the burial from its tombstone only
    try:
        again = checked(sweep(another))
    finally:
        another.close()
    assert again.applied[PUT_BACK] == 1 and queued(broker, queue) == [waiting]
    assert "worker" not in again.applied  # declared dead once
    assert get_runtime(app).store.workers.get("dead") is None
    assert checked(sweep(get_runtime(app))).applied[PUT_BACK] == 0  # done with


def test_a_put_back_failing_pass_after_pass_is_said_once(
    app: Celery, broker: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """Three passes of one sweeper while the broker fails the put-back: one WARNING, and
    the burial it resumes at every pass logged at DEBUG only; once the broker is mended the
    put-back is done, and a line says it works again."""
    queue, waiting = held_by_a_dead_worker(app, broker, [1, 2])
    runtime = get_runtime(app)
    with put_back_failing(broker), caplog.at_level(logging.INFO, logger="ojs_celery"):
        for _ in range(3):
            assert checked(sweep(runtime)).applied[PUT_BACK] == 0
    said = [r.message for r in caplog.records
            if "could not put back" in r.message or "resuming the burial" in r.message]
    assert len(said) == 1 and "could not put back" in said[0], said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ojs_celery"):
        assert checked(sweep(runtime)).applied[PUT_BACK] == 1
    assert "put-back of dead workers' messages works again" in caplog.text
    assert queued(broker, queue) == [waiting]
    assert runtime.store.workers.get("dead") is None


def test_a_put_back_failing_past_its_tries_is_left_to_kombu(
    app: Celery, broker: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker still fails the put-back :data:`PUT_BACK_TRIES` after the worker's last
    beat: the burial ends (its tombstone goes), the message left in kombu's record for its
    ``visibility_timeout`` to restore."""
    queue, waiting = held_by_a_dead_worker(app, broker, [1, 2])
    runtime = get_runtime(app)
    dead = runtime.store.workers.get("dead")
    assert dead is not None
    runtime.store.workers.save(replace(dead, last_beat=dead.last_beat - PUT_BACK_TRIES))
    with put_back_failing(broker), caplog.at_level(logging.WARNING, logger="ojs_celery"):
        report = checked(sweep(runtime))
    assert report.applied["worker"] == 1 and report.applied[PUT_BACK] == 0
    assert "could not put back" in caplog.text
    assert runtime.store.workers.get("dead") is None
    assert queued(broker, queue) == []
    assert [json.loads(raw)[0]["headers"]["id"]
            for raw in broker.admin.hvals("unacked")] == [waiting]


def test_a_broker_down_as_a_worker_is_buried_still_recovers_every_job_it_listed(
    broker: PrivateRedis, tmp_path: pathlib.Path
) -> None:
    """The broker goes away as the sweeper buries a worker that listed several held jobs: the
    first republish fails, and the others are still written, their messages left in the
    outbox; once the broker is back the dispatch clock publishes each (the worker's record
    is gone: nothing else would recover them but the hour-long backstop)."""
    with app_on(broker, tmp_path, store_url=sqlite_url(tmp_path / "store.sqlite3")) as app:
        runtime = get_runtime(app)
        queue = unique("held")
        jobs = [enqueue({"type": "e2e.add", "args": [i, 1], "queue": queue}, app=app).id
                for i in range(3)]
        broker.admin.delete(queue)  # the dead worker had taken them
        dead = WorkerInfo("dead", "host", 1, reserved_job_ids=jobs,
                          last_beat=time.time() - runtime.settings.worker_heartbeat_timeout - 5)
        runtime.store.workers.save(dead)
        broker.admin.shutdown(nosave=True)
        broker.process.wait(10)
        report = sweep(runtime)
        assert report.error is not None and report.applied["worker"] == 1
        tombstone = runtime.store.workers.get("dead")  # its put-back is owed
        assert tombstone is not None and tombstone.buried
        broker.start()
        later = time.time() + runtime.settings.dispatch_grace + 1
        published = checked(sweep(runtime, now=later)).published
        assert published == 3 and sorted(queued(broker, queue)) == sorted(jobs)
        assert runtime.store.workers.get("dead") is None


def test_a_message_routed_by_a_topic_exchange_goes_back_to_its_queue(
    broker: PrivateRedis, tmp_path: pathlib.Path
) -> None:
    """Celery's topic routing: the sweeper's channel never declared the exchange, and kombu
    would take it for a direct one and route the message nowhere (it left kombu's record and
    reached no queue); the app's exchanges are made known to it first."""
    queue = unique("topic")
    routing = {"task_queues": [Queue(queue, Exchange(unique("tx"), type="topic"),
                                     routing_key="jobs.#")],
               "task_routes": {"e2e.add": {"queue": queue, "routing_key": "jobs.add"}}}
    with app_on(broker, tmp_path, routing) as app:
        job_id = app.tasks["e2e.add"].delay(1, 2).id
        held_at = hold_and_die(broker, queue, 1)
        beats(app, held_at, dead_listing=[], live_listing=[])
        report = checked(sweep(get_runtime(app)))
        assert report.applied[PUT_BACK] == 1
        assert queued(broker, queue) == [job_id]


def test_a_worker_that_comes_back_while_its_put_back_is_owed_keeps_its_record(
    app: Celery, broker: PrivateRedis
) -> None:
    """The put-back failed, so the dead worker's tombstone stays; the worker comes back (it was
    frozen: it still holds the message) and its beat replaces the tombstone. The next pass,
    the broker mended, leaves it alone: no put-back of what it holds, its record kept."""
    queue, waiting = held_by_a_dead_worker(app, broker, [1, 2])
    runtime = get_runtime(app)
    with put_back_failing(broker):
        report = checked(sweep(runtime))
    assert report.applied["worker"] == 1 and report.applied[PUT_BACK] == 0
    tombstone = runtime.store.workers.get("dead")
    assert tombstone is not None and tombstone.buried
    runtime.store.workers.save(WorkerInfo("dead", "host", 1, last_beat=time.time(),
                                          reserved_job_ids=[waiting]))
    again = checked(sweep(runtime))
    assert again.applied[PUT_BACK] == 0 and "worker" not in again.applied
    back = runtime.store.workers.get("dead")
    assert back is not None and not back.buried
    assert queued(broker, queue) == []


def test_sweepers_that_resume_an_owed_put_back_together_put_it_back_once(
    app: Celery, broker: PrivateRedis
) -> None:
    """Three sweepers resume the same kept tombstone at once, the broker mended: the message
    goes back once, the tombstone goes."""
    queue, waiting = held_by_a_dead_worker(app, broker, [1, 2])
    with put_back_failing(broker):
        checked(sweep(get_runtime(app)))
    sweepers = [Runtime(app) for _ in range(3)]
    reports: list[SweepReport] = []
    try:
        threads = [threading.Thread(target=lambda r=r: reports.append(sweep(r)))
                   for r in sweepers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        for runtime in sweepers:
            runtime.close()
    assert len(reports) == 3 and all(report.error is None for report in reports)
    assert sum(report.applied[PUT_BACK] for report in reports) == 1
    assert queued(broker, queue) == [waiting]
    assert get_runtime(app).store.workers.get("dead") is None


def test_tombstones_kept_for_their_put_back_do_not_hold_back_new_deaths(
    app: Celery, broker: PrivateRedis
) -> None:
    """A broker that keeps failing the put-back keeps the tombstones of the workers declared
    dead for ten minutes, and a pass resumes them first (``limit`` of them, here 1): a worker
    that dies meanwhile is still declared dead at the next pass, its jobs recovered then,
    not once the outage has outlasted the tombstones' ten minutes."""
    held_by_a_dead_worker(app, broker, [1, 2])
    with put_back_failing(broker):
        runtime = get_runtime(app)
        assert checked(sweep(runtime, batch=1)).applied["worker"] == 1
        running = enqueue({"type": "e2e.add", "args": [3, 4]}, app=app).id
        timeout = runtime.settings.worker_heartbeat_timeout
        assert runtime.store.start(running, 1, "dead2", now=time.time() - timeout - 10).applied
        runtime.store.workers.save(WorkerInfo("dead2", "host", 3,
                                              last_beat=time.time() - timeout - 5,
                                              active_job_ids=[running]))
        report = checked(sweep(runtime, batch=1))
        assert report.applied["worker"] == 1  # dead2, while dead's put-back is still owed
        kept = runtime.store.workers.get("dead")
        assert kept is not None and kept.buried
        record = runtime.store.get_record(running)
        assert record is not None and record.job.state != "active", record.job.state


def test_put_backs_racing_for_one_message_count_it_once(
    app: Celery, broker: PrivateRedis
) -> None:
    """Several sweepers' channels put back the same held messages at once, round after round:
    each message goes back once, and is counted by the one put-back that moved it (kombu's
    ``restore_by_tag`` says nothing, so each sweeper that saw it in the record counted it)."""
    import kombu

    from ojs_celery import handback

    queue = unique("race")
    connections = [kombu.Connection(broker.url) for _ in range(4)]
    try:
        channels = [connection.default_channel for connection in connections]
        for _ in range(10):
            jobs = [enqueue({"type": "e2e.add", "args": [i, 1], "queue": queue}, app=app).id
                    for i in range(5)]
            hold_and_die(broker, queue, len(jobs))
            tags = [str(tag) for tag in broker.admin.hkeys("unacked")]
            counts: list[int] = []
            gate = threading.Barrier(len(channels))

            def put(channel: Any, tags: list[str], gate: threading.Barrier,
                    counts: list[int]) -> None:
                gate.wait(10)
                counts.append(len(handback.put_back(channel, tags)))

            threads = [threading.Thread(target=put, args=(channel, tags, gate, counts))
                       for channel in channels]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            assert sum(counts) == len(jobs) and sorted(queued(broker, queue)) == sorted(jobs)
            broker.admin.delete(queue)
    finally:
        for connection in connections:
            connection.release()


def test_a_put_back_failing_again_after_the_burials_ended_is_said_again(
    app: Celery, broker: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """A sweeper saw a put-back fail (one WARNING); another sweeper then did it and the
    burial ended, so this one had no put-back to try any more. A worker that dies later,
    whose put-back fails too, is another failure: said again at WARNING, not at DEBUG."""
    held_by_a_dead_worker(app, broker, [1, 2])
    runtime = get_runtime(app)
    with put_back_failing(broker), caplog.at_level(logging.WARNING, logger="ojs_celery"):
        assert checked(sweep(runtime)).applied[PUT_BACK] == 0
    assert "could not put back" in caplog.text
    another = Runtime(app)  # another sweeper does the put-back: the burial ends
    try:
        assert checked(sweep(another)).applied[PUT_BACK] == 1
    finally:
        another.close()
    assert runtime.store.workers.get("dead") is None
    assert "worker" not in checked(sweep(runtime)).applied  # nothing owed any more
    caplog.clear()
    # a queue of its own: the first job's message is back in the first one
    queue, waiting = held_by_a_dead_worker(app, broker, [3, 4])
    with put_back_failing(broker), caplog.at_level(logging.WARNING, logger="ojs_celery"):
        assert checked(sweep(runtime)).applied["worker"] == 1
    said = [r for r in caplog.records if "could not put back" in r.message]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, caplog.text
    assert checked(sweep(runtime)).applied[PUT_BACK] == 1
    assert queued(broker, queue) == [waiting]


def test_a_message_goes_back_under_the_brokers_global_keyprefix(
    broker: PrivateRedis, tmp_path: pathlib.Path
) -> None:
    """kombu's ``global_keyprefix``: the sweeper reads kombu's record and puts the messages
    back under the prefixed keys a worker reads (the queue, a priority's own list, the record);
    nothing lands under the bare names."""
    prefix = unique("pfx") + ":"
    with app_on(broker, tmp_path, transport={"global_keyprefix": prefix}) as app:
        queue = unique("held")
        waiting = enqueue({"type": "e2e.add", "args": [1, 2], "queue": queue}, app=app).id
        behind = enqueue({"type": "e2e.add", "args": [3, 4], "queue": queue, "priority": -50},
                         app=app).id
        lists = sorted(_text(key) for key in broker.admin.keys(f"{prefix}{queue}*"))
        assert len(lists) == 2 and lists[0] == prefix + queue  # its priority's list after it
        assert [queued(broker, key) for key in lists] == [[waiting], [behind]]
        held_at = hold_and_die(broker, queue, 2, prefix)
        assert [queued(broker, key) for key in lists] == [[], []]
        assert broker.admin.hlen(prefix + "unacked") == 2
        beats(app, held_at, dead_listing=[], live_listing=[])
        report = checked(sweep(get_runtime(app)))
        assert report.applied["worker"] == 1 and report.applied[PUT_BACK] == 2
        assert [queued(broker, key) for key in lists] == [[waiting], [behind]]
        assert broker.admin.hlen(prefix + "unacked") == 0
        assert broker.admin.zcard(prefix + "unacked_index") == 0
        assert not broker.admin.exists(queue, "unacked", "unacked_index")
        assert get_runtime(app).store.workers.get("dead") is None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
