"""The SQLite store's fast lane (``ojs_celery.store.sql_lane``) takes nothing away: its
writes are the store's own (fenced, all-or-nothing batches), a database locked past the busy
timeout is a StoreError that writes nothing and heals, and threads and forked children each
write on their own connection."""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from ojs_celery import lifecycle
from ojs_celery.envelope import Job
from ojs_celery.lifecycle import Policy
from ojs_celery.store import DuplicateJob, StoreError, StoreUncertain, open_store
from ojs_celery.store import sql as sql_store
from ojs_celery.store.sql import SQLStore
from ojs_celery.store.sql_lane import SqliteLane
from ojs_celery.store.sql_lane import fits as sql_lane_fits


def new_job() -> Job:
    return Job.model_validate({"type": "lane.job", "args": [1]})


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SQLStore]:
    # A locked database fails after 0.3 s instead of the store's 30 s (read at connect time).
    monkeypatch.setattr(sql_store, "SQLITE_BUSY_TIMEOUT_MS", 300)
    opened = open_store(f"sqlite:///{tmp_path / 'store.sqlite3'}", policy=Policy())
    assert isinstance(opened, SQLStore)
    yield opened
    opened.close()


def lane_of(store: SQLStore) -> SqliteLane:
    assert isinstance(store._lane, SqliteLane)
    return store._lane


def test_hot_writes_take_the_lane(store: SQLStore) -> None:
    """An enqueue's insert, a start and a complete go through the lane's own connection, and
    the records read back through SQLAlchemy are what they wrote."""
    lane = lane_of(store)
    taken: list[str] = []
    send = lane.send

    def counted(name: str, values: Any) -> Any:
        answer = send(name, values)
        if answer is not None:
            taken.append(name)
        return answer

    lane.send = counted  # type: ignore[method-assign]
    job = new_job()
    store.create(job)
    started = store.start(job.id, 1, "w1")
    assert started.applied and started.record is not None
    done = store.complete(job.id, 1, "w1", {"ok": True}, hint=started.record)
    assert done.applied
    assert taken == [store._lane_insert, store._lane_cas, store._lane_cas]
    stored = store.get(job.id)
    assert stored is not None and stored.state == "completed" and stored.result == {"ok": True}
    record = store.get_record(job.id)
    assert record is not None and record.version == 3 and record.worker_id is None
    # fencing is the statement's: a stale compare-and-set writes nothing
    again = store.complete(job.id, 1, "w1", {"ok": False}, hint=started.record)
    assert not again.applied
    assert store.get(job.id).result == {"ok": True}  # type: ignore[union-attr]


def test_a_taken_id_is_not_inserted_twice(store: SQLStore) -> None:
    job = new_job()
    store.create(job)
    with pytest.raises(DuplicateJob):
        store.create(job)
    record = store.get_record(job.id)
    assert record is not None and record.version == 1


def test_locked_database_is_a_store_error_and_heals(store: SQLStore, tmp_path: Path) -> None:
    """Another process holds SQLite's write lock past the busy timeout: the insert and the
    compare-and-set fail with StoreError naming the lock, nothing is written, and once the
    lock is released the same store writes again (the lane made a new connection). SQLite
    has no reply to lose (it runs in this process): a failed insert or batch is definite,
    never StoreUncertain."""
    job = new_job()
    store.create(job)
    other = sqlite3.connect(tmp_path / "store.sqlite3", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        blocked = new_job()
        for insert in (store.create, lambda j: store.create_many([j, new_job()])):
            with pytest.raises(StoreError, match="locked") as info:
                insert(blocked)
            assert not isinstance(info.value, StoreUncertain), info.value
        with pytest.raises(StoreError, match="locked"):
            store.start(job.id, 1, "w1")
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert store.get(blocked.id) is None
    record = store.get_record(job.id)
    assert record is not None and record.job.state == "available" and record.version == 1
    assert store.start(job.id, 1, "w1").applied
    store.create(blocked)
    assert store.get(blocked.id) is not None


def test_batch_write_is_all_or_nothing(store: SQLStore) -> None:
    """A sweep's batch of compare-and-sets is one transaction on the lane: one refused
    statement (here a locked database before the first) writes none of them; the next batch
    writes all of them."""
    jobs = [new_job() for _ in range(3)]
    for job in jobs:
        store.create(job)
    ids = [job.id for job in jobs]

    def next_token(record: lifecycle.Record) -> lifecycle.Transition:
        new = record.copy()
        new.token = record.token + 1
        return lifecycle.Transition(new)

    other = sqlite3.connect(store.url.database or "", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreError, match="locked"):
            store.apply_many(ids, next_token)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert [r.token for r in store.get_records(ids) if r is not None] == [1, 1, 1]
    done = store.apply_many(ids, next_token)
    assert all(t is not None and t.applied for t in done)
    assert [r.token for r in store.get_records(ids) if r is not None] == [2, 2, 2]


def test_threads_write_beside_the_lane(store: SQLStore) -> None:
    """Eight threads enqueue and start jobs at once: a thread that finds the lane taken takes
    the ordinary path; every job is stored and started once."""
    jobs = [new_job() for _ in range(80)]
    errors: list[BaseException] = []

    def work(mine: list[Job]) -> None:
        try:
            for job in mine:
                store.create(job)
                assert store.start(job.id, 1, "w1").applied
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(jobs[i::8],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    records = store.get_records([job.id for job in jobs])
    assert all(r is not None and r.job.state == "active" and r.version == 2 for r in records)


def _start_in_child(store: SQLStore, job_id: str, result: Any) -> None:
    result.put(store.start(job_id, 1, "child").applied)


def test_a_forked_child_writes_on_its_own_connection(store: SQLStore) -> None:
    """Celery's prefork pool forks after the store was used: the child makes its own lane
    connection (the parent's is neither used nor closed by it), and the parent's still
    works after the child exits."""
    first, second = new_job(), new_job()
    store.create(first)
    store.create(second)
    parent_connection = lane_of(store)._raw
    assert parent_connection is not None
    context = multiprocessing.get_context("fork")
    result = context.Queue()
    child = context.Process(target=_start_in_child, args=(store, first.id, result))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0 and result.get(timeout=5) is True
    assert lane_of(store)._raw is parent_connection
    assert store.start(second.id, 1, "parent").applied
    record = store.get_record(first.id)
    assert record is not None and record.worker_id == "child"


def test_no_lane_for_an_in_memory_database() -> None:
    """An in-memory database is one connection shared by all: nothing to keep aside."""
    store = open_store("sqlite:///:memory:", policy=Policy(), prefix="mem")
    assert isinstance(store, SQLStore)
    try:
        assert store._lane is None
        job = new_job()
        store.create(job)
        assert store.start(job.id, 1, "w1").applied
    finally:
        store.close()


class _Interrupted(BaseException):
    """What a time limit or ^C raises between two statements of a batch."""


def test_a_batch_cut_half_way_leaves_no_transaction_open(store: SQLStore) -> None:
    """An exception between two statements of a batch (a time limit, ^C) after its first
    statement ran: nothing of the batch is committed, and the next write is committed on its
    own (it does not run inside the batch's open transaction, holding SQLite's write lock)."""
    first, second = new_job(), new_job()
    store.create(first)
    store.create(second)
    lane = lane_of(store)
    record = store.get_record(first.id)
    assert record is not None
    moved = record.copy()
    moved.token = 2
    moved.nonce = "cut-batch"
    row = store._lane_cas_row(store._cas_values(moved, record, {}))

    def rows() -> Iterator[list[Any]]:
        yield row
        raise _Interrupted

    class Rows(list):  # type: ignore[type-arg]
        def __iter__(self) -> Iterator[Any]:
            return rows()

    with pytest.raises(_Interrupted):
        lane.send_many(store._lane_cas, Rows([row, row]))
    assert store.start(second.id, 1, "w1").applied  # on the lane again
    other = sqlite3.connect(store.url.database or "", isolation_level=None)
    try:
        states = dict(other.execute("SELECT id, state FROM ojs_jobs").fetchall())
        tokens = dict(other.execute("SELECT id, token FROM ojs_jobs").fetchall())
    finally:
        other.close()
    assert states[second.id] == "active"  # committed, seen by another connection
    assert tokens[first.id] == 1  # the cut batch wrote nothing


@pytest.mark.parametrize(("url", "lane"), [
    ("sqlite:////tmp/jobs.sqlite3", True),
    ("sqlite+pysqlite:///jobs.sqlite3", True),
    ("sqlite://", False),
    ("sqlite:///:memory:", False),
    ("sqlite:///file::memory:?uri=true", False),
    ("sqlite:///file:jobs?mode=memory&cache=shared&uri=true", False),
    ("sqlite:///jobs.sqlite3?check_same_thread=true", False),
    ("sqlite+pysqlcipher://:key@/jobs.sqlite3", False),
])
def test_lane_only_for_a_shared_file_on_sqlite3(url: str, lane: bool) -> None:
    """Where each connection would see its own database, the pool's only connection would be
    taken, connections are bound to a thread, or another driver raises other errors, the
    store keeps SQLAlchemy's path."""
    assert sql_lane_fits(make_url(url)) is lane


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # SQLAlchemy 2.1 on its pool class
def test_a_shared_in_memory_database_keeps_the_ordinary_path() -> None:
    store = open_store("sqlite:///file:lanetest?mode=memory&cache=shared&uri=true",
                       policy=Policy(), prefix="shared")
    assert isinstance(store, SQLStore)
    try:
        assert store._lane is None
        job = new_job()
        store.create(job)
        started = threading.Thread(target=lambda: store.start(job.id, 1, "w1"))
        started.start()
        started.join(timeout=30)
        assert store.get(job.id).state == "active"  # type: ignore[union-attr]
    finally:
        store.close()


def test_dropped_tables_come_back_for_the_lane(store: SQLStore) -> None:
    """``drop_tables`` (tests, uninstall) then a write: the lane's next connection comes
    through the engine, which makes the tables again."""
    store.create(new_job())
    store.drop_tables()
    jobs = [new_job(), new_job()]
    for job in jobs:
        store.create(job)

    def next_token(record: lifecycle.Record) -> lifecycle.Transition:
        new = record.copy()
        new.token = record.token + 1
        return lifecycle.Transition(new)

    store.drop_tables()
    assert store.apply_many([], next_token) == []
    for job in jobs:
        store.create(job)
    done = store.apply_many([job.id for job in jobs], next_token)
    assert all(t is not None and t.applied for t in done)
