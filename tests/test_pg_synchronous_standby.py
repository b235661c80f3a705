"""Commits that wait for a synchronous standby: what the store reports when the wait is ended
(the write is done locally), and an insert that lands after a worker dropped its message as an
orphan.

``enqueue`` of a job with a generated id publishes the job's message while its insert is in
flight; a worker that finds no record sends the message back until it is
``arrival.ORPHAN_AFTER`` old, then drops it. An insert can land later than that and still be
reported as stored: its commit waits for a synchronous standby (``statement_timeout`` does not
bound that wait), the server stalls, or a lost reply sends it again. Its outbox entry must then
stay, so that the sweeper publishes the job again, instead of the job waiting for
``redispatch_after`` (an hour).

A PostgreSQL server of the test's own whose ``synchronous_standby_names`` names a standby
that never comes: sessions with ``synchronous_commit`` ``on`` (``store_synchronous_commit``)
wait for it at each commit, the others (the server's ``local``: the worker's) do not. A real
``celery worker`` and ``celery beat`` on the shared Redis broker."""

from __future__ import annotations

import logging
import pathlib
import threading
from collections.abc import Callable, Iterator

import psycopg
import pytest

from ojs_celery import Job, arrival, enqueue
from ojs_celery.lifecycle import Policy
from ojs_celery.runtime import get_runtime
from ojs_celery.store import open_store
from tests.conftest import Env, start_env
from tests.e2eapp import make_app
from tests.pgserver import NO_STANDBY, PrivatePostgres, waiting_for_standby
from tests.workers import unique, wait_for

#: The server's settings: commits wait for a standby that is never there, unless a session's
#: synchronous_commit is ``local`` (the server's default here) or ``off``.


@pytest.fixture
def pg_server() -> Iterator[PrivatePostgres]:
    server = PrivatePostgres(NO_STANDBY)
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture
def env(pg_server: PrivatePostgres, tmp_path: pathlib.Path) -> Iterator[Env]:
    config = {"ojs": {"store_url": pg_server.url, "store_prefix": unique("late"),
                      "sweep_interval": 1, "dispatch_grace": 2, "events": False}}
    with start_env("redis", tmp_path, config=config, beat=True, concurrency=1) as started:
        yield started


def test_an_insert_that_lands_after_its_message_was_dropped_still_runs(
    env: Env, pg_server: PrivatePostgres
) -> None:
    """The producer's insert commits locally but waits for the standby past ORPHAN_AFTER,
    invisible to the worker, which drops the job's message as an orphan; then the wait is
    cancelled (PostgreSQL: the commit stands, a WARNING says it may not be replicated) and
    ``enqueue`` returns the job as stored. The job runs, once, within a sweep or two: before,
    its outbox entry was cleared as if its message had been taken, and it waited an hour."""
    producer = make_app({**env.config, "ojs": {**env.config["ojs"],
                                               "store_synchronous_commit": "on"}})
    runtime = get_runtime(producer)
    runtime.store.ping()  # the tables (their commit waits too: made before the lane's insert)
    stored: list[Job] = []
    failed: list[BaseException] = []

    def call() -> None:
        try:
            stored.append(enqueue({"type": "e2e.add", "args": [20, 22]}, app=producer))
        except BaseException as exc:  # pragma: no cover - reported below
            failed.append(exc)

    admin = psycopg.connect(pg_server.url, autocommit=True)
    caller = threading.Thread(target=call, daemon=True)
    try:
        caller.start()
        wait_for(lambda: waiting_for_standby(admin), 30, "the insert to wait for the standby")
        wait_for(lambda: "dropped as an orphan" in env.worker.log(), arrival.ORPHAN_AFTER + 60,
                 "the worker to drop the message of the insert in flight")
        assert caller.is_alive() and not stored, failed
        for pid in waiting_for_standby(admin):
            admin.execute("SELECT pg_cancel_backend(%s)", (pid,))
        caller.join(60)
        assert not failed and len(stored) == 1, failed
        done = env.wait_state(stored[0].id, "completed", timeout=60)
        assert done.result == 42 and done.attempt == 1
    finally:
        runtime.close()
        producer.close()
        for pid in waiting_for_standby(admin):  # nothing of the producer's left waiting
            admin.execute("SELECT pg_cancel_backend(%s)", (pid,))
        admin.close()


@pytest.mark.parametrize("end", ["pg_cancel_backend", "pg_terminate_backend"])
@pytest.mark.parametrize("write", ["insert", "batch insert", "compare-and-set"])
def test_a_commit_whose_wait_for_the_standby_is_cancelled_is_reported_done(
    pg_server: PrivatePostgres, write: str, end: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``statement_timeout`` (``store_timeout``) does not end a commit's wait for a synchronous
    standby: the write waits until the standby answers or the wait is ended. Ended by a
    cancel (PostgreSQL: a WARNING, the commit done locally) or by the session's end (the
    reply lost after that WARNING), the write is reported done, as it is on this server,
    never as failed or uncertain; the server's WARNING (it "might not have been replicated
    to the standby") is logged."""
    prefix = unique("sync")
    maker = open_store(pg_server.url, policy=Policy(), prefix=prefix)
    maker.ping()  # the tables, committed without waiting (the server's synchronous_commit)
    maker.close()
    store = open_store(pg_server.url, policy=Policy(), prefix=prefix, timeout=1.0,
                       synchronous_commit="on")
    admin = psycopg.connect(pg_server.url, autocommit=True)
    done: list[object] = []
    failed: list[BaseException] = []
    jobs = [Job.model_validate({"type": "e2e.add", "args": [n, 1]}) for n in range(2)]
    if write == "compare-and-set":
        local = open_store(pg_server.url, policy=Policy(), prefix=prefix)
        local.create(jobs[0])
        local.close()
    calls: dict[str, Callable[[], object]] = {
        "insert": lambda: store.create(jobs[0]),
        "batch insert": lambda: store.create_many(jobs),
        "compare-and-set": lambda: store.start(jobs[0].id, 1, "w1"),
    }

    def call() -> None:
        try:
            done.append(calls[write]())
        except BaseException as exc:  # pragma: no cover - reported below
            failed.append(exc)

    caller = threading.Thread(target=call, daemon=True)
    try:
        with caplog.at_level(logging.WARNING, logger="ojs_celery"):
            caller.start()
            wait_for(lambda: waiting_for_standby(admin), 30, "the commit to wait")
            caller.join(3.0)  # three store_timeouts: still waiting
            assert caller.is_alive() and not done and not failed, failed
            for pid in waiting_for_standby(admin):
                admin.execute(f"SELECT {end}(%s)", (pid,))
            caller.join(30)
        assert not failed and len(done) == 1, failed
        record = store.get_record(jobs[0].id)
        assert record is not None
        assert record.job.state == ("active" if write == "compare-and-set" else "available")
        assert "might not have been replicated to the standby" in caplog.text, caplog.text
    finally:
        for pid in waiting_for_standby(admin):
            admin.execute("SELECT pg_cancel_backend(%s)", (pid,))
        admin.close()
        store.close()
