"""Faults: a broker that is down during a sweep or refuses a publish, a store that is down when a
message arrives."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from celery import Celery
from kombu import Producer

from ojs_celery import Job, OJSTask, enqueue, enqueue_batch, get_job, install, parse_envelope
from ojs_celery.envelope import format_timestamp, from_epoch
from ojs_celery.runtime import Runtime, get_runtime
from ojs_celery.sweeper import sweep
from tests import services
from tests.conftest import start_env
from tests.e2eapp import make_app
from tests.test_store_faults import PrivateRedis
from tests.workers import (
    SweepLoop,
    Worker,
    forget_redis_names,
    lines,
    redis_config,
    running_worker,
    unique,
    wait_for,
)


def test_a_sweep_with_the_broker_down_keeps_what_is_owed(tmp_path: pathlib.Path) -> None:
    app = Celery("down", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.ojs = {"store_url": f"sqlite:///{tmp_path / 'store.sqlite3'}", "events": False}
    runtime = install(app)

    @app.task(shared=False, name="down.job", base=OJSTask)
    def job_task() -> None:
        return None

    created = runtime.store.create(parse_envelope({"type": "down.job", "args": []}))
    assert created.record is not None
    report = sweep(runtime, now=time.time() + 60)
    assert report.error is not None and "could not be published (broker: " in report.error
    owed = runtime.store.due("dispatch", now=time.time() + 3600, limit=10)
    assert [job_id for job_id, _ in owed] == [created.record.job.id]  # retried next pass


def test_store_down_when_a_message_arrives_sends_it_back_to_the_broker(
    tmp_path: pathlib.Path,
) -> None:
    """A store that stays unreachable: the start waits for it (up to 30 s, a quarter of the
    job's time limits: 2 s for this job's 8 s timeout), then the message goes back to the
    broker, again and again, and the job is untouched until a worker that reaches the store
    runs it."""
    with start_env("redis", tmp_path, concurrency=1) as env:
        queue = unique("own")
        job = enqueue({"type": "e2e.add", "args": [20, 22], "queue": queue, "timeout": 8},
                      app=env.app)
        cut_off = {**env.config, "worker_queues": [queue],
                   "ojs": {**env.config["ojs"], "store_url": "redis://127.0.0.1:1/0"}}
        blind = Worker(cut_off, tmp_path / "blind.log")
        try:
            blind.wait_ready()
            wait_for(lambda: env.lines("postrun").count(f"{job.id} REJECTED") >= 2, 20,
                     "the message to go back to the broker (REJECTED), come back and fail again")
        finally:
            blind.stop()
        assert env.job(job.id).state == "available"  # nothing happened to it
        healthy = Worker({**env.config, "worker_queues": [queue]}, tmp_path / "healthy.log")
        try:
            healthy.wait_ready()
            assert env.wait_state(job.id, "completed").result == 42
        finally:
            healthy.stop()


def test_a_short_store_outage_holds_the_message_instead_of_sending_it_back(
    tmp_path: pathlib.Path,
) -> None:
    """A start that cannot reach the store waits for it (up to 30 s): a store back within that
    starts the job from the message the worker holds, which never goes back to the broker (a
    RabbitMQ quorum queue counts each return against its delivery limit, and drops the message
    at the limit). The job runs once."""
    store = PrivateRedis(tmp_path, durable=True)
    config = redis_config(tmp_path, services.redis_url())
    config["ojs"]["store_url"] = store.url
    app = make_app(config)
    worker = None
    try:
        job = enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)  # nobody consumes yet
        store.stop()
        worker = Worker(config, tmp_path / "worker.log", concurrency=1)
        worker.wait_ready()
        wait_for(lambda: f"job {job.id} waits for it" in worker.log(), 20,
                 "the start to wait for the store")
        store.start()
        done = wait_for(lambda: (found := get_job(job.id, app=app)) is not None
                        and found.state == "completed" and found, 30, "the job to complete")
        assert done.result == 3
        # Celery's task_postrun comes after the store took the completion: await it.
        wait_for(lambda: lines(config["dir"], "postrun"), 10, "the task's postrun signal")
        assert lines(config["dir"], "postrun") == [f"{job.id} SUCCESS"]  # never rejected
        assert len([line for line in lines(config["dir"], "runs") if job.id in line]) == 1
    finally:
        if worker is not None:
            worker.stop()
        if not store.running():
            store.start()
        get_runtime(app).store.clear()
        get_runtime(app).close()
        forget_redis_names(config["broker_url"], [config["queue"], config["event_exchange"]])
        store.stop()


def test_workers_warn_when_no_sweep_runs(tmp_path: pathlib.Path) -> None:
    with start_env("filesystem", tmp_path, config={"ojs": {"sweep_interval": 0.2}}) as env:
        wait_for(lambda: "no OJS sweep has completed" in env.worker.log(), 10, "the warning")


def test_a_batch_with_the_broker_down_is_stored_and_owed(tmp_path: pathlib.Path) -> None:
    """``enqueue_batch`` publishes through one held producer: with the broker down it still
    returns every stored job, each with its outbox entry for the sweeper."""
    app = Celery("downbatch", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.ojs = {"store_url": f"sqlite:///{tmp_path / 'store.sqlite3'}", "events": False}
    runtime = install(app)

    @app.task(shared=False, name="down.batch", base=OJSTask)
    def job_task(n: int) -> None:
        return None

    jobs = enqueue_batch([{"type": "down.batch", "args": [n]} for n in range(3)], app=app)
    assert [job.state for job in jobs] == ["available"] * 3
    owed = runtime.store.due("dispatch", now=time.time() + 3600, limit=10)
    assert sorted(job_id for job_id, _ in owed) == sorted(job.id for job in jobs)


@dataclass
class Faulty:
    """A private Redis as broker and job store, under a real worker (one pool process) with
    short beats and sweeps, and a sweeper loop in this process that the test starts."""

    server: PrivateRedis
    config: dict[str, Any]
    app: Celery
    runtime: Runtime
    worker: Worker
    sweeper: SweepLoop

    def wait_active(self, job_id: str) -> None:
        wait_for(lambda: (found := get_job(job_id, app=self.app)) is not None
                 and found.state == "active", 20, "the job to start")

    def wait_ended(self, job_id: str) -> Job:
        ended: Job = wait_for(lambda: (found := get_job(job_id, app=self.app)) is not None
                              and found.state not in ("active", "available") and found, 30,
                              "the job to end")
        return ended

    def runs(self, job_id: str) -> int:
        return len([line for line in lines(self.config["dir"], "runs") if job_id in line])


@pytest.fixture
def faulty(redis_server: PrivateRedis, tmp_path: pathlib.Path) -> Iterator[Faulty]:
    with faulty_setup(redis_server, tmp_path) as made:
        yield made


@pytest.fixture
def faulty_cancelling(redis_server: PrivateRedis, tmp_path: pathlib.Path) -> Iterator[Faulty]:
    """:func:`faulty` with Celery's ``worker_cancel_long_running_tasks_on_connection_loss``."""
    celery = {"worker_cancel_long_running_tasks_on_connection_loss": True}
    with faulty_setup(redis_server, tmp_path, celery) as made:
        yield made


@contextlib.contextmanager
def faulty_setup(redis_server: PrivateRedis, tmp_path: pathlib.Path,
                 celery: dict[str, Any] | None = None) -> Iterator[Faulty]:
    config = redis_config(tmp_path, redis_server.url)
    config["celery"].update(celery or {})
    config["ojs"].update({"heartbeat_interval": 0.3, "worker_heartbeat_timeout": 2.0,
                          "sweep_interval": 0.3})
    app = make_app(config)
    runtime = get_runtime(app)
    sweeper = SweepLoop(runtime)
    try:
        with running_worker(config, tmp_path / "worker.log", concurrency=1) as worker:
            yield Faulty(redis_server, config, app, runtime, worker, sweeper)
    finally:
        sweeper.stop()
        runtime.close()
        app.close()


def test_a_store_pause_longer_than_every_timeout_runs_no_job_twice(faulty: Faulty) -> None:
    """Redis, broker and job store, frozen (SIGSTOP) for longer than the worker heartbeat
    timeout and the running job's heartbeat and visibility timeouts: beats and sweeps stop
    alike. When Redis comes back, the first sweep to reach it (a race it often wins against the
    worker's beat; here the worker's main process is held until the sweep is done) declares
    nothing stalled, hidden or orphaned; the worker stays registered, the job's one attempt
    completes, and nothing ran it again."""
    runtime = faulty.runtime
    redis_pid, worker_pid = faulty.server.process.pid, faulty.worker.process.pid
    job = enqueue({"type": "e2e.whoami", "args": [6.0], "heartbeat_timeout": 1,
                   "visibility_timeout": 1}, app=faulty.app)
    faulty.wait_active(job.id)
    (worker_id,) = [w.worker_id for w in runtime.store.workers.all()]
    assert sweep(runtime).total == 0  # a sweeper in contact before the pause
    os.kill(worker_pid, signal.SIGSTOP)  # its pool process runs on
    os.kill(redis_pid, signal.SIGSTOP)
    try:
        time.sleep(4.0)  # the fault itself: twice the longest timeout
    finally:
        os.kill(redis_pid, signal.SIGCONT)
        try:
            first = sweep(runtime)
        finally:
            os.kill(worker_pid, signal.SIGCONT)
    assert first.error is None and first.total == 0, first.as_dict()
    faulty.sweeper.start()
    done = faulty.wait_ended(job.id)
    assert done.state == "completed" and done.attempt == 1 and done.errors == []
    assert done.result == worker_id
    assert [w.worker_id for w in runtime.store.workers.all()] == [worker_id]
    assert faulty.runs(job.id) == 1


def test_an_outcome_the_store_refuses_for_longer_than_30s_is_written_once_it_takes_it(
    faulty: Faulty,
) -> None:
    """Redis refuses every write (an error reply: out of memory, as during a read-only
    failover) from before a running job finishes until 33 s after: its outcome waits in the
    pool process and is written once Redis takes writes again; the job completes with its one
    attempt and ran once (the pool process gave up after 30 s, the job stalled and ran again)."""
    job = enqueue({"type": "e2e.whoami", "args": [2.0], "heartbeat_timeout": 2,
                   "visibility_timeout": 2}, app=faulty.app)
    faulty.sweeper.start()
    faulty.wait_active(job.id)
    faulty.server.admin.config_set("maxmemory", 1)  # every write refused from now on
    try:
        wait_for(lambda: any(job.id in line for line in lines(faulty.config["dir"], "finished")),
                 20, "the handler to finish")
        time.sleep(33.0)  # the fault itself: longer than the old 30 s of retries
    finally:
        faulty.server.admin.config_set("maxmemory", 0)
    done = faulty.wait_ended(job.id)
    assert done.state == "completed" and done.attempt == 1 and done.errors == []
    assert faulty.runs(job.id) == 1


APART = "apart.job"


@pytest.fixture
def broker_apart(
    redis_server: PrivateRedis, tmp_path: pathlib.Path
) -> Iterator[tuple[PrivateRedis, Celery, Runtime]]:
    """A private Redis as broker, with the job store apart from it (SQLite): its faults are
    the test's own."""
    server = redis_server
    app = Celery(unique("apart"), broker=server.url, set_as_current=False)
    app.conf.ojs = {"store_url": f"sqlite:///{tmp_path / 'store.sqlite3'}", "events": False}
    runtime = install(app)

    @app.task(shared=False, name=APART, base=OJSTask)
    def job_task(n: int) -> None:
        return None

    try:
        yield server, app, runtime
    finally:
        runtime.close()
        app.close()


def queued_ids(server: PrivateRedis) -> list[str]:
    """The job ids of the messages in the default queue's lists (kombu keeps a list per
    priority step: celery\x06\x163)."""
    lists = [key for key in server.admin.keys("celery*") if server.admin.type(key) == "list"]
    return sorted(json.loads(message)["headers"]["id"]
                  for key in lists for message in server.admin.lrange(key, 0, -1))


@pytest.mark.skipif(not hasattr(Producer, "batch"), reason="kombu < 5.7 sends each at once")
def test_a_batch_redis_refuses_as_a_whole_stays_owed_and_is_sent_once_later(
    broker_apart: tuple[PrivateRedis, Celery, Runtime], caplog: pytest.LogCaptureFixture
) -> None:
    """On a Redis broker a batch's messages go in one pipeline (kombu's publish batch). When
    Redis refuses it (an error reply: out of memory), every job stays stored and owed (none
    is acknowledged), one line says so, and the sweeper sends each once the broker is back."""
    server, app, runtime = broker_apart
    first = enqueue({"type": APART, "args": [0]}, app=app)  # declares the queue
    runtime.flush()
    server.admin.config_set("maxmemory", 1)  # every write is refused from now on
    with caplog.at_level(logging.ERROR, logger="ojs_celery.api"):
        jobs = enqueue_batch([{"type": APART, "args": [n]} for n in (1, 2, 3)], app=app)
    assert [job.state for job in jobs] == ["available"] * 3
    said = [r.getMessage() for r in caplog.records if r.name == "ojs_celery.api"]
    assert len(said) == 1 and "3 stored job(s) of a batch may not have been" in said[0]
    runtime.flush()
    owed = runtime.store.due("dispatch", now=time.time() + 3600, limit=10)
    assert sorted(job_id for job_id, _ in owed) == sorted(job.id for job in jobs)
    assert queued_ids(server) == [first.id]
    server.admin.config_set("maxmemory", 0)
    assert sweep(runtime, now=time.time() + 60).error is None
    assert queued_ids(server) == sorted([first.id, *(job.id for job in jobs)])


def test_a_job_message_redis_refuses_or_loses_stays_owed_then_goes_once(
    broker_apart: tuple[PrivateRedis, Celery, Runtime], caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis broker with the job store elsewhere: each OJS message is pushed with the kombu
    client kept for the channel. Refused (an error reply: out of memory), the job is stored
    and owed, one line says so, and the sweeper sends it once the broker takes writes again;
    after the broker cut every connection, the next job's message still arrives, once."""
    server, app, runtime = broker_apart
    first = enqueue({"type": APART, "args": [0]}, app=app)  # declares, keeps a client
    assert runtime.joint_store is None
    server.admin.config_set("maxmemory", 1)  # every write is refused from now on
    with caplog.at_level(logging.ERROR, logger="ojs_celery"):
        refused = enqueue({"type": APART, "args": [1]}, app=app)
    assert refused.state == "available"
    said = [r.getMessage() for r in caplog.records if refused.id in r.getMessage()]
    assert len(said) == 1 and "could not be published" in said[0]
    runtime.flush()
    owed = runtime.store.due("dispatch", now=time.time() + 3600, limit=10)
    assert [job_id for job_id, _ in owed] == [refused.id]
    assert queued_ids(server) == [first.id]
    server.admin.config_set("maxmemory", 0)
    assert sweep(runtime, now=time.time() + 60).error is None
    assert queued_ids(server) == sorted([first.id, refused.id])
    server.admin.client_kill_filter(_type="normal", skipme=True)  # the broker cuts us off
    after_cut = enqueue({"type": APART, "args": [2]}, app=app)
    assert queued_ids(server) == sorted([first.id, refused.id, after_cut.id])


def test_a_broker_connection_loss_leaves_a_running_attempt_to_finish_once(
    faulty_cancelling: Faulty,
) -> None:
    """``worker_cancel_long_running_tasks_on_connection_loss`` (Celery 6's default) cancels a
    running ``acks_late`` task when the broker connection drops, so that its redelivered
    message runs it again, and stops listing it as running. An OJS attempt runs on, still
    listed in the worker's beats (no ``stalled`` meanwhile): it completes once, as attempt 1,
    and the redelivered message does not run it again."""
    f = faulty_cancelling
    f.sweeper.start()
    job = enqueue({"type": "e2e.sleep", "args": [4.0], "heartbeat_timeout": 1}, app=f.app)
    f.wait_active(job.id)
    for kind in ("normal", "pubsub"):  # the consumer sees its broadcast channel go
        f.server.admin.client_kill_filter(_type=kind, skipme=True)
    done = f.wait_ended(job.id)
    assert done.state == "completed" and done.attempt == 1 and done.errors == []
    assert "runs on although Celery cancels it" in f.worker.log()
    assert f.runs(job.id) == 1


def test_a_sweep_asked_during_a_store_pause_keeps_the_pause_one_blind_spell(
    tmp_path: pathlib.Path,
) -> None:
    """A sweep pass whose first request waits out a pause of the store (Redis stopped, a
    failover) reaches the store when the pause ends: its contact is then, and the pause stays
    one blind spell. Stamped when it asked, it split the pause in two spells, of which only
    the last is kept, and the first part's silence counted against live workers: a worker
    frozen with the store for 20 s was declared dead and its jobs ran twice."""
    server = PrivateRedis(tmp_path)
    app = Celery("paused", broker=services.redis_url(), set_as_current=False)
    app.conf.ojs = {"store_url": server.url, "store_prefix": unique("pz"), "events": False}
    meta = install(app).store.meta
    try:
        meta.record_contact(None, blind_after=1.0)  # the last sweep before the pause
        os.kill(server.process.pid, signal.SIGSTOP)
        paused_at = time.time()
        asked = threading.Thread(target=meta.record_contact, args=(None, 1.0))
        asked.start()  # a sweep during the pause: its request waits
        time.sleep(3.0)  # the pause itself
        os.kill(server.process.pid, signal.SIGCONT)
        resumed_at = time.time()
        asked.join(10)
        spell = meta.record_contact(None, blind_after=1.0)  # the next sweep
        assert spell is not None
        assert spell.start <= paused_at and spell.end >= resumed_at
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        get_runtime(app).close()
        server.stop()


def test_a_start_that_timed_out_is_tried_once_more_before_its_message_goes_back(
    tmp_path: pathlib.Path,
) -> None:
    """A start whose compare-and-set got no answer in time (the store paused) may have been
    run by the store afterwards: it is tried once more, however short the job's wait for the
    store (here 1 s, a quarter of its 4 s timeout), and that try knows the start as its own.
    Sent back at once instead, its message would find the job started by nobody, and the job
    would wait for its stall clock."""
    server = PrivateRedis(tmp_path)
    config = redis_config(tmp_path, services.redis_url())
    config["ojs"].update({"store_url": server.url, "store_timeout": 1.0})
    app = make_app(config)
    worker = Worker(config, tmp_path / "worker.log", concurrency=1)
    try:
        worker.wait_ready()
        due = time.time() + 4.0
        job = enqueue({"type": "e2e.add", "args": [2, 3], "timeout": 4,
                       "scheduled_at": format_timestamp(from_epoch(due))}, app=app)
        time.sleep(max(due - 0.5 - time.time(), 0))  # the pause begins just before it is due
        server.admin.execute_command("CLIENT", "PAUSE", "3000", "WRITE")
        done = wait_for(lambda: (found := get_job(job.id, app=app)) is not None
                        and found.state == "completed" and found, 20, "the job to complete")
        assert done.result == 5 and done.attempt == 1
        wait_for(lambda: lines(config["dir"], "postrun"), 10, "the task's postrun signal")
        assert lines(config["dir"], "postrun") == [f"{job.id} SUCCESS"]  # never sent back
    finally:
        worker.stop()
        get_runtime(app).store.clear()
        get_runtime(app).close()
        forget_redis_names(config["broker_url"], [config["queue"], config["event_exchange"]])
        server.stop()
