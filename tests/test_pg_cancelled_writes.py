"""A write that PostgreSQL cancels (a lock another session holds past the session's
``statement_timeout`` or ``lock_timeout``) was rolled back: the caller is told, for certain,
that nothing was stored (``StoreRefused``, a ``StoreError``), after one wait, not that the job
may be stored (``StoreUncertain``) after three. The lock is taken by a second session on the
shared server, on tables of the test's own prefix."""

from __future__ import annotations

import contextlib
import pathlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
import sqlalchemy as sa

from ojs_celery import StoreError, StoreUncertain, enqueue, lifecycle
from ojs_celery.envelope import Job
from ojs_celery.lifecycle import Policy
from ojs_celery.runtime import get_runtime
from ojs_celery.store import DuplicateJob, StoreRefused, open_store
from ojs_celery.store.sql import SQLStore
from ojs_celery.store.sql_lane import rolled_back
from tests.e2eapp import make_app
from tests.services import postgres_url
from tests.workers import filesystem_config

TIMEOUT = 1.0


def new_job() -> Job:
    return Job.model_validate({"type": "e2e.add", "args": [1, 2]})


@pytest.fixture
def prefix() -> Iterator[str]:
    """A prefix whose tables exist, dropped after the test."""
    name = f"c{uuid.uuid4().hex[:10]}"
    owner = open_store(postgres_url(), policy=Policy(), prefix=name)
    assert isinstance(owner, SQLStore)
    owner.ping()
    yield name
    try:
        owner.drop_tables()
    finally:
        owner.close()


@contextlib.contextmanager
def locked(prefix: str, mode: str) -> Iterator[Callable[[], None]]:
    """The jobs table locked in ``mode`` by another session until the returned release is
    called (or the block ends)."""
    locker = psycopg.connect(postgres_url(), autocommit=True)
    guard = threading.Lock()

    def release() -> None:
        with guard:
            if not locker.closed:
                locker.close()

    try:
        locker.execute("BEGIN")
        locker.execute(f'LOCK TABLE "{prefix}_jobs" IN {mode} MODE')
        yield release
    finally:
        release()


def _url(options: str | None) -> str:
    url = sa.make_url(postgres_url())
    if options:
        url = url.update_query_dict({"options": options})
    return url.render_as_string(hide_password=False)


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "ordinary"])
@pytest.mark.parametrize("mode", ["ACCESS EXCLUSIVE", "SHARE"])
def test_a_write_cancelled_under_a_lock_is_refused_for_certain(
    prefix: str, mode: str, lane: bool
) -> None:
    """Every kind of write (the insert, the insert sent ahead as ``enqueue`` sends it, a
    batch, a compare-and-set, a batch of them), through the fast lane or the ordinary path,
    waits one ``statement_timeout`` and fails with StoreRefused naming the cause; nothing of it
    is stored. Before, an insert under an ACCESS EXCLUSIVE lock (which blocks the reads that
    settle it too) was StoreUncertain after three waits, and every other write took two."""
    store = open_store(postgres_url(), policy=Policy(), prefix=prefix, timeout=TIMEOUT)
    assert isinstance(store, SQLStore) and store._lane is not None
    try:
        started = new_job()
        store.create(started)
        record = store.get_record(started.id)
        others = [new_job() for _ in range(2)]
        for job in others:
            store.create(job)
        tried: list[Job] = []

        def fresh() -> Job:
            tried.append(new_job())
            return tried[-1]

        calls: dict[str, Callable[[], object]] = {
            "insert": lambda: store.create(fresh()),
            "insert sent ahead": lambda: store.begin_create(fresh())[1](),
            "batch insert": lambda: store.create_many([fresh() for _ in range(3)]),
            "compare-and-set": lambda: store.start(started.id, 1, "w1", hint=record),
        }
        if mode == "SHARE":  # reads pass a SHARE lock: the batch reads its records first
            calls["batch of compare-and-sets"] = lambda: store.apply_many(
                [job.id for job in others], lambda r: lifecycle.cancel(r, time.time()))
        taken = store._lane._lock if not lane else None
        if taken is not None:
            taken.acquire()  # the lane is busy: every write takes the ordinary path
        try:
            with locked(prefix, mode):
                for name, call in calls.items():
                    began = time.monotonic()
                    with pytest.raises(StoreError) as info:
                        call()
                    took = time.monotonic() - began
                    said = str(info.value)
                    assert isinstance(info.value, StoreRefused), (name, type(info.value), said)
                    assert not isinstance(info.value, StoreUncertain), (name, said)
                    assert took < 1.5 * TIMEOUT + 0.5, (name, took)
                    assert f"statement_timeout ({TIMEOUT:g}s)" in said, (name, said)
                    assert "a lock another session holds" in said, (name, said)
                    assert "nothing of it is stored" in said and "\n" not in said, (name, said)
        finally:
            if taken is not None:
                taken.release()
        assert store.get_records([job.id for job in tried]) == [None] * len(tried)
        states = [r.job.state if r else None for r in store.get_records([j.id for j in others])]
        assert states == ["available"] * len(others)
        assert store.start(started.id, 1, "w1").applied
    finally:
        store.clear()
        store.close()


def test_a_write_past_lock_timeout_says_so(prefix: str) -> None:
    """A ``lock_timeout`` shorter than ``statement_timeout`` (the role's, the database's, the
    URL's) ends the wait first (55P03): the refusal names it."""
    store = open_store(_url("-c lock_timeout=300"), policy=Policy(), prefix=prefix,
                       timeout=TIMEOUT)
    try:
        store.ping()
        with locked(prefix, "SHARE"), pytest.raises(StoreRefused) as info:
            store.create(new_job())
        said = str(info.value)
        assert "lock_timeout" in said and "nothing of it is stored" in said, said
    finally:
        store.close()


def test_an_enqueue_cancelled_under_a_lock_says_nothing_was_stored(
    prefix: str, tmp_path: pathlib.Path
) -> None:
    """``enqueue`` of a job with a generated id (its insert sent while the message is
    published) under a table lock held past ``store_timeout``: the caller gets a StoreError
    that is not StoreUncertain, saying the server cancelled the write and nothing is stored;
    once the lock is gone the same call stores the job."""
    config = filesystem_config(tmp_path)
    config["ojs"] = {**config["ojs"], "store_url": postgres_url(), "store_prefix": prefix,
                     "store_timeout": TIMEOUT, "events": False}
    app = make_app(config)
    runtime = get_runtime(app)
    try:
        runtime.store.ping()
        with locked(prefix, "ACCESS EXCLUSIVE"), pytest.raises(StoreError) as info:
            enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
        said = str(info.value)
        assert not isinstance(info.value, StoreUncertain), said
        assert "statement_timeout" in said and "nothing of it is stored" in said, said
        job = enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
        assert runtime.store.get(job.id) is not None
    finally:
        runtime.store.clear()
        runtime.close()
        app.close()


def test_a_batch_with_a_taken_id_is_still_a_duplicate(prefix: str) -> None:
    """The rolled-back batch whose error reply is a unique violation is the batch's own
    answer, not a refusal: DuplicateJob naming the taken id, nothing of it stored."""
    store = open_store(postgres_url(), policy=Policy(), prefix=prefix, timeout=TIMEOUT)
    try:
        taken, fresh = new_job(), new_job()
        store.create(taken)
        with pytest.raises(DuplicateJob) as info:
            store.create_many([fresh, taken])
        assert info.value.job_id == taken.id
        assert store.get(fresh.id) is None
    finally:
        store.clear()
        store.close()


class _Diag:
    def __init__(self, severity: str) -> None:
        self.severity_nonlocalized = severity


class _ServerError(Exception):
    """The parts of a driver's error that :func:`rolled_back` reads."""

    def __init__(self, sqlstate: str, severity: str = "ERROR") -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate
        self.diag = _Diag(severity)


def test_only_an_error_the_session_survived_is_a_rollback() -> None:
    """An ERROR of the server's own (a cancel, a lock timeout) rolled the write back. A
    connection error sent as an ERROR (a pooler's: PgBouncer before 1.21 says ``server conn
    crashed?`` with 08P01 after passing a COMMIT on), a FATAL, and any error after which
    SQLAlchemy found the session gone may follow a commit: those are settled by reading."""
    assert rolled_back(_ServerError("57014")) == "57014"
    assert rolled_back(_ServerError("55P03")) == "55P03"
    assert rolled_back(_ServerError("08P01")) is None
    assert rolled_back(_ServerError("57P01", severity="FATAL")) is None
    wrapped = sa.exc.OperationalError("COMMIT", {}, _ServerError("57014"))
    assert rolled_back(wrapped) == "57014"
    gone = sa.exc.OperationalError("COMMIT", {}, _ServerError("57014"),
                                   connection_invalidated=True)
    assert rolled_back(gone) is None
