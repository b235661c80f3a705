"""Faults of a whole PostgreSQL server behind a PostgreSQL job store, made on a server of the
test's own (:class:`tests.pgserver.PrivatePostgres`): stopped, restarted. Real ``celery
worker`` subprocesses on the shared Redis broker."""

from __future__ import annotations

import pathlib
import time

import pytest

from ojs_celery import StoreError, enqueue
from ojs_celery.envelope import Job
from ojs_celery.lifecycle import Policy
from ojs_celery.runtime import get_runtime
from ojs_celery.store import WorkerInfo, open_store
from tests import services
from tests.e2eapp import make_app
from tests.pgserver import PrivatePostgres
from tests.workers import (
    Worker,
    filesystem_config,
    forget_redis_names,
    redis_config,
    unique,
    wait_for,
)


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_after_a_server_restart_no_call_fails_on_a_session_of_before(
    pg_server: PrivatePostgres, mode: str
) -> None:
    """The server restarted (a minor upgrade, a crash) and is up again: every session the
    store's pool kept from before was ended by it. The first call of each kind (a read, a
    cancel, the worker registry) works on a new session, as the lane's writes always did,
    instead of failing once in each process with the session's end ("terminating connection
    due to administrator command")."""
    store = open_store(pg_server.url, policy=Policy(), prefix=unique("t"))
    try:
        jobs = [Job.model_validate({"type": "e2e.add", "args": [n, 1]}) for n in range(3)]
        for job in jobs:
            store.create(job)
        store.workers.save(WorkerInfo(worker_id="w1", hostname="h", pid=1, last_beat=1.0))
        assert store.get(jobs[0].id) is not None  # the pool's sessions, before the restart
        pg_server.stop(mode)
        pg_server.start()
        assert store.get(jobs[0].id) is not None
        assert store.cancel(jobs[1].id).applied
        assert [worker.worker_id for worker in store.workers.all()] == ["w1"]
        assert store.get_records([job.id for job in jobs])[2] is not None
    finally:
        store.close()


def test_a_worker_that_starts_while_the_store_is_down_registers_at_its_first_beat(
    pg_server: PrivatePostgres, tmp_path: pathlib.Path
) -> None:
    """The store is down when a worker starts (a database restart during a deploy, every
    connection slot taken): its registration fails and the first beat that reaches the store
    registers it. That beat finds no record, as a beat of a worker declared dead does, but
    this worker was never registered: it says it registered now, not that a sweeper declared
    it dead because the hosts' clocks disagree (an ERROR that sent operators to NTP)."""
    config = redis_config(tmp_path, services.redis_url())
    config["ojs"] = {"store_url": pg_server.url, "store_prefix": unique("t"),
                     "heartbeat_interval": 0.5}
    app = make_app(config)
    runtime = get_runtime(app)
    runtime.store.ping()  # the tables, made while the server is up
    pg_server.stop()
    runtime.store.close()  # this process's sessions: new ones once the server is back
    worker = Worker(config, tmp_path / "worker.log", concurrency=1)
    try:
        worker.wait_ready()
        assert "could not register worker" in worker.log()
        pg_server.start()
        wait_for(lambda: runtime.store.workers.all(), 20, "the worker to register")
        job = enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
        wait_for(lambda: runtime.store.get(job.id).state == "completed", 20, "the job")
        log = worker.log()
        assert "declared dead" not in log, log[-3000:]
        assert "clock is ahead" not in log, log[-3000:]
        assert "registered at its first beat" in log, log[-3000:]
    finally:
        worker.stop()
        runtime.store.clear()
        runtime.close()
        app.close()
        forget_redis_names(config["broker_url"], [config["queue"], config["event_exchange"]])


def test_an_enqueue_with_every_connection_slot_taken_says_the_store_refused_it(
    tmp_path: pathlib.Path,
) -> None:
    """Every connection slot of the server is taken (``max_connections``; other clients'
    idle sessions): PostgreSQL refuses each new session, so nothing of an enqueue was sent.
    Its error says the store refused the connection, as for a server that is down, not that
    the store "failed during the write", and names the server's reason; once the slots are
    free the same app enqueues."""
    import psycopg

    server = PrivatePostgres({"max_connections": "6"})  # 3 slots left by the superusers'
    hogs: list[psycopg.Connection[object]] = []
    try:
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute("CREATE ROLE app LOGIN")
            admin.execute("GRANT ALL ON SCHEMA public TO app")
            row = admin.execute("SELECT current_setting('max_connections')::int"
                                " - current_setting('superuser_reserved_connections')::int"
                                ).fetchone()
            assert row is not None
            slots: int = row[0]
        url = server.url.replace("postgres@", "app@", 1)
        config = filesystem_config(tmp_path)
        config["ojs"] = {**config["ojs"], "store_url": url, "events": False}
        app = make_app(config)
        runtime = get_runtime(app)
        try:
            runtime.store.ping()  # its tables
            runtime.store.close()
            # A closed session's slot is free only once its backend has exited: take every
            # slot, waiting for those still held by the sessions just closed.
            deadline = time.monotonic() + 30
            while len(hogs) < slots:
                try:
                    hogs.append(psycopg.connect(url))
                except psycopg.OperationalError:
                    assert time.monotonic() < deadline, f"only {len(hogs)} of {slots} slots"
                    time.sleep(0.05)
            with pytest.raises(StoreError) as refused:
                enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
            said = str(refused.value)
            assert "the job store refused the connection" in said, said
            assert "connection slots are reserved" in said and "\n" not in said, said
            while hogs:
                hogs.pop().close()
            job = enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
            assert runtime.store.get(job.id) is not None
        finally:
            runtime.close()
            app.close()
    finally:
        for hog in hogs:
            hog.close()
        server.destroy()
