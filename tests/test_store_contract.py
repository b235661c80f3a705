"""The job store contract: every backend (SQLite, PostgreSQL, Redis) must pass all of it.

Times are passed as ``now=`` so nothing sleeps; each test gets its own table/key prefix and
removes it afterwards (the servers are shared).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ojs_celery import lifecycle
from ojs_celery.envelope import Job, format_timestamp, from_epoch
from ojs_celery.lifecycle import Policy, Publish, Record, Transition
from ojs_celery.store import (
    BrokerMark,
    DuplicateJob,
    JobStore,
    StoreError,
    WorkerInfo,
    open_store,
)
from tests.services import postgres_url, redis_url

T0 = 1_700_000_000.0
POLICY = Policy(
    dispatch_grace=10.0,
    schedule_horizon=60.0,
    retention_completed=100.0,
    retention_cancelled=200.0,
    retention_discarded=300.0,
    retention_dead_letter=400.0,
)
BACKENDS = ["sqlite", "postgres", "redis"]

MakeStore = Callable[..., JobStore]


def _url(backend: str, tmp_path: Path) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'store.sqlite3'}"
    if backend == "postgres":
        return postgres_url()
    return redis_url()


def _dispose(store: JobStore) -> None:
    """Remove everything the store created: rows/keys, and for SQL the tables themselves."""
    try:
        store.clear()
        drop = getattr(store, "drop_tables", None)
        if drop is not None:
            drop()
    finally:
        store.close()


@pytest.fixture(params=BACKENDS)
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeStore]:
    """A factory of stores on one backend; each call gets a fresh prefix unless one is given."""
    url = _url(request.param, tmp_path)
    made: list[JobStore] = []

    def make(policy: Policy | None = None, prefix: str | None = None) -> JobStore:
        store = open_store(
            url, policy=policy or POLICY, prefix=prefix or f"t{uuid.uuid4().hex[:10]}"
        )
        made.append(store)
        return store

    yield make
    errors: list[BaseException] = []
    for store in made:
        try:
            _dispose(store)
        except Exception as exc:  # clean up the others anyway
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture
def store(make_store: MakeStore) -> JobStore:
    return make_store()


def new_job(**fields: Any) -> Job:
    data: dict[str, Any] = {"type": "test.job", "args": [1, "two"], **fields}
    return Job.model_validate(data)


def created(store: JobStore, now: float = T0, **fields: Any) -> Job:
    job = new_job(**fields)
    store.create(job, now=now)
    return job


def started(store: JobStore, now: float = T0 + 1, worker: str = "w1", **fields: Any) -> Job:
    job = created(store, **fields)
    transition = store.start(job.id, 1, worker, now=now)
    assert transition.applied, transition.reason
    return job


def record(store: JobStore, job_id: str) -> Record:
    found = store.get_record(job_id)
    assert found is not None
    return found


def unfenced(found: Record | None) -> Record | None:
    """The record without its write nonce and origin (random: different in two stores)."""
    return None if found is None else dataclasses.replace(found, nonce="", origin="")


def event_names(transition: Transition) -> list[str]:
    return [name for name, _ in transition.events]


ERROR: dict[str, Any] = {"type": "ValueError", "message": "boom"}
NO_JITTER = {"jitter": False, "initial_interval": "PT2S", "max_attempts": 3}


# --------------------------------------------------------------------------- create and read


def test_create_get_round_trip(store: JobStore) -> None:
    job = new_job(
        x_trace={"id": "abc", "hops": [1, 2.5, None, True]},
        x_owner="team-a",
        meta={"tenant": "acme"},
        priority=7,
        timeout=30,
        total_timeout=600,
        retry={"max_attempts": 3, "jitter": False, "non_retryable_errors": ["fatal.*"]},
        args=[{"nested": ["é", 1]}, 3.25],
    )
    transition = store.create(job, now=T0)
    assert transition.applied
    assert event_names(transition) == ["job.enqueued"]
    assert transition.publish == Publish(job.id, 1, None)
    got = store.get(job.id)
    assert got is not None
    assert transition.record is not None
    assert got.to_dict() == transition.record.job.to_dict()
    assert got.extensions == {
        "x_trace": {"id": "abc", "hops": [1, 2.5, None, True]},
        "x_owner": "team-a",
    }
    assert got.state == "available"
    stored = record(store, job.id)
    assert (stored.version, stored.token, stored.worker_id) == (1, 1, None)
    assert stored.dispatch_due == T0 + POLICY.dispatch_grace
    assert stored.promote_at is None and stored.dead_letter is False

    # A full life: checkpoint, a failure (error history), a retry, progress and a result.
    assert store.start(job.id, 1, "w1", now=T0 + 1).applied
    assert store.heartbeat(job.id, 1, "w1", checkpoint={"page": 3}, now=T0 + 2).applied
    failed = store.fail(job.id, 1, "w1", ERROR, delay=5, now=T0 + 3)
    assert failed.applied and failed.publish == Publish(job.id, 2, T0 + 8)
    assert store.start(job.id, 2, "w2", now=T0 + 9).applied
    assert store.heartbeat(job.id, 2, "w2", progress=0.5, data={"step": "x"}, now=T0 + 10).applied
    result = {"ok": True, "items": [1, 2, 3], "ratio": 0.125, "text": "naïve"}
    done = store.complete(job.id, 2, "w2", result, now=T0 + 11)
    assert done.applied and done.record is not None
    final = store.get(job.id)
    assert final is not None
    assert final.to_dict() == done.record.job.to_dict()
    assert final.state == "completed" and final.attempt == 2
    assert final.result == result
    assert final.last_checkpoint == {"page": 3}
    assert final.error is None
    assert [e["type"] for e in final.errors] == ["ValueError"]
    assert final.errors[0]["attempt"] == 1
    assert final.progress is not None and final.progress["progress"] == 1.0
    assert final.extensions["x_owner"] == "team-a"
    assert record(store, job.id) == done.record


def test_unknown_job(store: JobStore) -> None:
    missing = new_job().id
    assert store.get(missing) is None
    assert store.get_record(missing) is None
    assert store.start(missing, 1, "w1", now=T0).reason == "unknown_job"
    assert store.complete(missing, 1, "w1", None, now=T0).reason == "unknown_job"
    assert store.ack_dispatch(missing, 1) is False
    assert store.due("dispatch", T0 + 1e6, 10) == []


def test_duplicate_id_refused(store: JobStore) -> None:
    job = created(store)
    with pytest.raises(DuplicateJob) as info:
        store.create(job, now=T0 + 5)
    assert info.value.job_id == job.id
    stored = record(store, job.id)
    assert stored.version == 1
    assert stored.job.created_at == from_epoch(T0)


def batch_of_jobs() -> list[Job]:
    return [
        new_job(),
        new_job(scheduled_at=format_timestamp(from_epoch(T0 + 3600))),  # beyond the horizon
        new_job(scheduled_at=format_timestamp(from_epoch(T0 + 30))),
        new_job(priority=5, x_owner="team-b"),
    ]


def everything_due(store: JobStore) -> dict[str, list[tuple[str, float]]]:
    """Every deadline index entry, by clock (ties in any order)."""
    return {clock: sorted(store.due(clock, T0 + 1e7, 100)) for clock in lifecycle.CLOCKS}


def test_create_many_stores_what_create_stores(make_store: MakeStore) -> None:
    """Records, versions, outbox entries and deadline index entries as one create each."""
    batched, one_by_one = make_store(), make_store()
    jobs = batch_of_jobs()
    transitions = batched.create_many(jobs, now=T0)
    singles = [one_by_one.create(job, now=T0) for job in jobs]
    for job, transition, single in zip(jobs, transitions, singles, strict=True):
        assert transition.applied and transition.record is not None
        assert transition.record.job.id == job.id
        assert event_names(transition) == event_names(single)
        assert event_names(single) == (["job.enqueued", "job.scheduled"]
                                       if single.record and single.record.job.state == "scheduled"
                                       else ["job.enqueued"])
        assert transition.publish == single.publish
        assert transition.record.nonce and transition.record.origin == transition.record.nonce
        assert unfenced(transition.record) == unfenced(single.record)
        assert transition.record.version == 1
        assert unfenced(record(batched, job.id)) == unfenced(record(one_by_one, job.id))
        assert record(batched, job.id).origin == transition.record.origin
    assert everything_due(batched) == everything_due(one_by_one)
    assert batched.start(jobs[0].id, 1, "w1", now=T0 + 1).applied


@pytest.mark.parametrize("position", [0, 2, 3])
def test_create_many_is_all_or_nothing(store: JobStore, position: int) -> None:
    existing = created(store)
    before = everything_due(store)
    jobs = batch_of_jobs()
    jobs[position] = existing
    with pytest.raises(DuplicateJob) as info:
        store.create_many(jobs, now=T0 + 5)
    assert info.value.job_id == existing.id
    for job in jobs:
        if job is not existing:
            assert store.get_record(job.id) is None
    assert record(store, existing.id).version == 1
    assert everything_due(store) == before  # no deadline of the refused jobs was indexed
    assert len(store.create_many(batch_of_jobs(), now=T0)) == 4  # the store is fine


def test_create_many_refuses_an_id_given_twice(store: JobStore) -> None:
    jobs = batch_of_jobs()
    twin = Job.model_validate({**jobs[0].to_dict(), "args": ["other"]})
    with pytest.raises(DuplicateJob) as info:
        store.create_many([*jobs, twin], now=T0)
    assert info.value.job_id == jobs[0].id
    assert all(store.get_record(job.id) is None for job in jobs)
    assert store.create_many([], now=T0) == []


def test_create_many_races_store_each_job_once(make_store: MakeStore) -> None:
    """Two batches sharing one job, at once: one batch is stored whole, the other not at all."""
    store = make_store()
    shared = new_job()
    batches = [[new_job(), shared, new_job()], [new_job(), new_job(), shared]]
    outcomes: list[str] = []

    def insert(batch: list[Job]) -> None:
        try:
            store.create_many(batch, now=T0)
            outcomes.append("stored")
        except DuplicateJob:
            outcomes.append("refused")

    threads = [threading.Thread(target=insert, args=(batch,)) for batch in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["refused", "stored"]
    for batch in batches:
        present = [store.get_record(job.id) is not None for job in batch]
        assert all(present) or present == [job is shared for job in batch]


# --------------------------------------------------------------------------- start


def test_start_with_token(store: JobStore) -> None:
    job = created(store)
    transition = store.start(job.id, 1, "w1", now=T0 + 1)
    assert transition.applied and transition.reason == "ok"
    assert event_names(transition) == ["job.started"]
    assert transition.events[0][1]["worker_id"] == "w1"
    stored = record(store, job.id)
    assert stored.job.state == "active" and stored.job.attempt == 1
    assert stored.job.started_at == from_epoch(T0 + 1)
    assert (stored.worker_id, stored.version, stored.dispatch_due) == ("w1", 2, None)
    assert stored.heartbeat_at == T0 + 1 and stored.extended_at == T0 + 1

    again = store.start(job.id, 1, "w2", now=T0 + 2)
    assert not again.applied and again.reason == "duplicate"
    assert record(store, job.id) == stored


def test_stale_and_unknown_tokens_rejected(store: JobStore) -> None:
    job = started(store, retry=NO_JITTER)
    assert store.fail(job.id, 1, "w1", ERROR, now=T0 + 2).applied
    before = record(store, job.id)
    assert before.token == 2 and before.job.state == "retryable"
    assert store.start(job.id, 1, "w9", now=T0 + 3).reason == "stale"
    assert store.start(job.id, 3, "w9", now=T0 + 3).reason == "unknown_token"
    assert record(store, job.id) == before
    second = store.start(job.id, 2, "w2", now=T0 + 5)
    assert second.applied and second.record is not None
    assert second.record.job.attempt == 2 and second.record.worker_id == "w2"


# --------------------------------------------------------------------------- outcomes


def test_complete_is_fenced_on_attempt_and_worker(store: JobStore) -> None:
    job = started(store, retry=NO_JITTER)
    before = record(store, job.id)
    assert store.complete(job.id, 1, "w2", "x", now=T0 + 2).reason == "not_owner"
    assert store.complete(job.id, 2, "w1", "x", now=T0 + 2).reason == "stale_attempt"
    assert store.fail(job.id, 1, "w2", ERROR, now=T0 + 2).reason == "not_owner"
    assert record(store, job.id) == before

    # The attempt is recovered and retried: the old attempt's outcome is rejected.
    assert store.fail(job.id, 1, None, ERROR, delay=0, now=T0 + 3).applied
    assert store.start(job.id, 2, "w2", now=T0 + 4).applied
    retried = record(store, job.id)
    assert store.complete(job.id, 1, "w1", "late", now=T0 + 5).reason == "stale_attempt"
    assert store.complete(job.id, 2, "w1", "late", now=T0 + 5).reason == "not_owner"
    assert record(store, job.id) == retried

    done = store.complete(job.id, 2, "w2", {"v": 1}, now=T0 + 6)
    assert done.applied and event_names(done) == ["job.completed"]
    stored = record(store, job.id)
    assert stored.job.state == "completed" and stored.job.result == {"v": 1}
    assert stored.worker_id is None
    assert store.complete(job.id, 2, "w2", {"v": 2}, now=T0 + 7).reason == "not_active"
    assert record(store, job.id) == stored


def test_fail_schedules_a_retry(store: JobStore) -> None:
    job = started(store, retry=NO_JITTER)
    transition = store.fail(job.id, 1, "w1", ERROR, now=T0 + 2)
    assert transition.applied
    assert event_names(transition) == ["job.failed", "job.retrying"]
    assert transition.publish == Publish(job.id, 2, T0 + 4)  # PT2S backoff, no jitter
    stored = record(store, job.id)
    assert stored.job.state == "retryable" and stored.token == 2
    assert stored.job.error == ERROR
    assert stored.job.next_retry_at == from_epoch(T0 + 4)
    assert stored.dispatch_due == T0 + 4 + POLICY.dispatch_grace
    assert stored.worker_id is None and stored.heartbeat_at is None
    assert store.due("dispatch", T0 + 20, 10) == [(job.id, T0 + 14)]
    assert store.due("execution", T0 + 1e6, 10) == []
    assert store.due("stall", T0 + 1e6, 10) == []


def test_long_backoff_is_held_for_promotion(store: JobStore) -> None:
    job = started(store, retry=NO_JITTER)
    transition = store.fail(job.id, 1, "w1", ERROR, delay=3600, now=T0 + 2)
    assert transition.applied and transition.publish is None
    stored = record(store, job.id)
    assert stored.promote_at == T0 + 3602 and stored.dispatch_due is None
    assert store.due("promote", T0 + 3602, 10) == [(job.id, T0 + 3602)]
    assert store.due("dispatch", T0 + 1e6, 10) == []


def test_exhausted_attempts_are_discarded(store: JobStore) -> None:
    job = created(store, retry={"max_attempts": 2, "jitter": False, "on_exhaustion": "dead_letter"})
    assert store.start(job.id, 1, "w1", now=T0 + 1).applied
    assert store.fail(job.id, 1, "w1", ERROR, now=T0 + 2).applied
    assert store.start(job.id, 2, "w1", now=T0 + 5).applied
    last = store.fail(job.id, 2, "w1", ERROR, now=T0 + 6)
    assert last.applied and last.publish is None
    assert event_names(last) == ["job.failed", "job.discarded"]
    stored = record(store, job.id)
    assert stored.job.state == "discarded" and stored.job.attempt == 2
    assert stored.dead_letter is True and stored.dispatch_due is None
    assert len(stored.job.errors) == 2
    assert store.due("dispatch", T0 + 1e6, 10) == []
    assert store.due("retention", T0 + 1e6, 10) == [(job.id, T0 + 6 + 400)]
    assert store.start(job.id, 2, "w1", now=T0 + 7).reason == "terminal"


def test_non_retryable_error_discards(store: JobStore) -> None:
    job = started(store, retry={"non_retryable_errors": ["fatal.*"]})
    transition = store.fail(job.id, 1, "w1", {"type": "fatal.db", "message": "x"}, now=T0 + 2)
    assert transition.applied
    stored = record(store, job.id)
    assert stored.job.state == "discarded" and stored.dead_letter is False


def test_heartbeat_persists_checkpoint_and_extends_clocks(store: JobStore) -> None:
    job = started(store, heartbeat_timeout=20, visibility_timeout=50)
    assert store.due("stall", T0 + 21, 10) == [(job.id, T0 + 21)]
    transition = store.heartbeat(
        job.id, 1, "w1", progress=0.25, checkpoint={"cursor": 42}, now=T0 + 10
    )
    assert transition.applied
    stored = record(store, job.id)
    assert stored.job.last_checkpoint == {"cursor": 42}
    assert stored.job.progress is not None and stored.job.progress["progress"] == 0.25
    assert stored.heartbeat_at == T0 + 10 and stored.extended_at == T0 + 10
    assert store.due("stall", T0 + 29, 10) == []
    assert store.due("stall", T0 + 30, 10) == [(job.id, T0 + 30)]
    assert store.due("visibility", T0 + 60, 10) == [(job.id, T0 + 60)]

    # Reservation only (stall=False): the visibility clock moves, the stall clock does not.
    assert store.heartbeat(job.id, 1, "w1", stall=False, now=T0 + 15).applied
    assert store.due("stall", T0 + 30, 10) == [(job.id, T0 + 30)]
    assert store.due("visibility", T0 + 65, 10) == [(job.id, T0 + 65)]

    assert store.heartbeat(job.id, 1, "w2", checkpoint={"x": 1}, now=T0 + 20).reason == (
        "not_owner"
    )
    job_now = store.get(job.id)
    assert job_now is not None and job_now.last_checkpoint == {"cursor": 42}


def test_cancel(store: JobStore) -> None:
    waiting = created(store)
    transition = store.cancel(waiting.id, now=T0 + 5)
    assert transition.applied and event_names(transition) == ["job.cancelled"]
    stored = record(store, waiting.id)
    assert stored.job.state == "cancelled" and stored.dispatch_due is None
    assert store.start(waiting.id, 1, "w1", now=T0 + 6).reason == "cancelled"
    assert store.cancel(waiting.id, now=T0 + 7).reason == "terminal:cancelled"
    assert store.due("dispatch", T0 + 1e6, 10) == []
    assert store.due("retention", T0 + 1e6, 10) == [(waiting.id, T0 + 5 + 200)]

    running = started(store)
    assert store.cancel(running.id, now=T0 + 5).applied
    assert store.complete(running.id, 1, "w1", "late", now=T0 + 6).reason == "not_active"
    assert store.due("execution", T0 + 1e6, 10) == []


# --------------------------------------------------------------------------- outbox


def test_ack_dispatch_only_for_current_token(store: JobStore) -> None:
    job = created(store, retry=NO_JITTER)
    assert store.ack_dispatch(job.id, 2) is False
    assert store.due("dispatch", T0 + 10, 10) == [(job.id, T0 + 10)]
    assert store.ack_dispatch(job.id, 1) is True
    stored = record(store, job.id)
    assert stored.dispatch_due is None
    assert stored.version == 1  # acknowledging is not a state change
    assert store.due("dispatch", T0 + 1e6, 10) == []
    assert store.ack_dispatch(job.id, 1) is False  # nothing owed any more

    # A retry owes a new message for token 2; token 1's acknowledgement no longer counts.
    assert store.start(job.id, 1, "w1", now=T0 + 1).applied
    assert store.fail(job.id, 1, "w1", ERROR, now=T0 + 2).applied
    assert store.ack_dispatch(job.id, 1) is False
    assert store.due("dispatch", T0 + 1e6, 10) == [(job.id, T0 + 14)]
    assert store.ack_dispatch(job.id, 2) is True
    assert store.due("dispatch", T0 + 1e6, 10) == []
    assert record(store, job.id).version == 3  # create, start, fail; no acks


# --------------------------------------------------------------------------- deadline indexes


def test_due_enqueue_ttl_in_order_with_limit(store: JobStore) -> None:
    a = created(store, enqueue_ttl=30)
    b = created(store, enqueue_ttl=10)
    c = created(store, enqueue_ttl=20)
    created(store)  # no TTL: never due
    assert store.due("enqueue_ttl", T0 + 5, 10) == []
    assert store.due("enqueue_ttl", T0 + 25, 10) == [(b.id, T0 + 10), (c.id, T0 + 20)]
    assert store.due("enqueue_ttl", T0 + 25, 1) == [(b.id, T0 + 10)]
    assert [i for i, _ in store.due("enqueue_ttl", T0 + 30, 10)] == [b.id, c.id, a.id]
    # Starting a job stops its TTL clock.
    assert store.start(b.id, 1, "w1", now=T0 + 6).applied
    assert store.due("enqueue_ttl", T0 + 25, 10) == [(c.id, T0 + 20)]
    expired = store.expire_ttl(c.id, now=T0 + 21)
    assert expired.applied and record(store, c.id).job.state == "discarded"
    assert store.due("enqueue_ttl", T0 + 1e6, 10) == [(a.id, T0 + 30)]


def test_due_total(store: JobStore) -> None:
    a = created(store, timeout=5, total_timeout=50)
    b = created(store, timeout=5, total_timeout=40)
    c = created(store, timeout=5, total_timeout=60)
    assert store.due("total", T0 + 55, 10) == [(b.id, T0 + 40), (a.id, T0 + 50)]
    assert store.due("total", T0 + 100, 2) == [(b.id, T0 + 40), (a.id, T0 + 50)]
    # Active jobs keep the clock; terminal ones leave the index.
    assert store.start(c.id, 1, "w1", now=T0 + 1).applied
    assert store.complete(c.id, 1, "w1", None, now=T0 + 2).applied
    assert store.expire_total(b.id, now=T0 + 41).applied
    assert store.due("total", T0 + 1e6, 10) == [(a.id, T0 + 50)]


def test_due_dispatch(store: JobStore) -> None:
    a = created(store, now=T0)
    b = created(store, now=T0 + 2)
    c = created(store, now=T0 + 1)
    assert store.due("dispatch", T0 + 11.5, 10) == [(a.id, T0 + 10), (c.id, T0 + 11)]
    assert store.due("dispatch", T0 + 12, 10) == [(a.id, T0 + 10), (c.id, T0 + 11), (b.id, T0 + 12)]
    assert store.due("dispatch", T0 + 12, 2) == [(a.id, T0 + 10), (c.id, T0 + 11)]
    assert store.due("dispatch", T0 + 9.99, 10) == []


def test_an_index_entry_moves_only_from_the_deadline_that_was_read(store: JobStore) -> None:
    """``move_due``: a compare-and-set on the index entry (a write since the read has set the
    entry its record gives, which a stale move must not undo)."""
    a = created(store, now=T0)
    b = created(store, now=T0 + 1)
    assert store.move_due("dispatch", [(a.id, T0 + 9, T0 + 50), (b.id, T0 + 11, T0 + 60)]) == 1
    assert store.due("dispatch", T0 + 100, 10) == [(a.id, T0 + 10), (b.id, T0 + 60)]
    assert store.move_due("dispatch", []) == 0


def test_due_execution_stall_visibility(store: JobStore) -> None:
    a = started(
        store, now=T0 + 3, timeout=5, grace_period=2, heartbeat_timeout=100, visibility_timeout=200
    )
    b = started(
        store, now=T0 + 1, timeout=5, grace_period=2, heartbeat_timeout=50, visibility_timeout=300
    )
    waiting = created(store, timeout=1)
    assert store.due("execution", T0 + 9, 10) == [(b.id, T0 + 8)]
    assert store.due("execution", T0 + 10, 10) == [(b.id, T0 + 8), (a.id, T0 + 10)]
    assert store.due("stall", T0 + 1e6, 10) == [(b.id, T0 + 51), (a.id, T0 + 103)]
    assert store.due("visibility", T0 + 1e6, 10) == [(a.id, T0 + 203), (b.id, T0 + 301)]
    assert all(job_id != waiting.id for job_id, _ in store.due("execution", T0 + 1e6, 10))
    # The attempt ends: every clock of the attempt stops.
    assert store.fail(b.id, 1, "w1", ERROR, now=T0 + 4).applied
    for clock in ("execution", "stall", "visibility"):
        assert [i for i, _ in store.due(clock, T0 + 1e6, 10)] == [a.id]


def test_due_promote_for_far_schedules(store: JobStore) -> None:
    far = created(store, scheduled_at=format_timestamp(from_epoch(T0 + 3600)))
    near = created(store, scheduled_at=format_timestamp(from_epoch(T0 + 30)))
    assert record(store, far.id).job.state == "scheduled"
    assert store.due("promote", T0 + 3599, 10) == []
    assert store.due("promote", T0 + 3600, 10) == [(far.id, T0 + 3600)]
    assert store.due("dispatch", T0 + 1e6, 10) == [(near.id, T0 + 40)]


def test_due_retention_and_prune(store: JobStore) -> None:
    done = started(store)
    assert store.complete(done.id, 1, "w1", "ok", now=T0 + 10).applied
    gone = created(store)
    assert store.cancel(gone.id, now=T0 + 10).applied
    running = started(store)
    waiting = created(store)
    assert store.due("retention", T0 + 1e6, 10) == [(done.id, T0 + 110), (gone.id, T0 + 210)]

    assert store.prune(now=T0 + 109) == 0
    assert store.prune(now=T0 + 150) == 1
    assert store.get(done.id) is None
    assert store.prune(now=T0 + 250) == 1
    assert store.get(gone.id) is None
    assert store.prune(now=T0 + 1e6) == 0
    assert store.get(running.id) is not None and store.get(waiting.id) is not None
    assert store.due("retention", T0 + 1e6, 10) == []
    # Nothing of the pruned jobs is left in any index.
    for clock in lifecycle.CLOCKS:
        ids = {i for i, _ in store.due(clock, T0 + 1e9, 100)}
        assert not ids & {done.id, gone.id}


def test_delete_checks_version(store: JobStore) -> None:
    job = created(store)
    assert store._delete(job.id, 7) is False
    assert store.get(job.id) is not None
    assert store._delete(job.id, 1) is True
    assert store.get(job.id) is None
    assert store.due("dispatch", T0 + 1e6, 10) == []
    assert store._delete(job.id, 1) is False


def test_delete_many_checks_each_version(store: JobStore) -> None:
    first, second, third = (created(store) for _ in range(3))
    deletes = [(first.id, 1), (second.id, 7), (third.id, 1), ("no-such-job", 1)]
    assert store._delete_many(deletes) == [True, False, True, False]
    assert store.get(first.id) is None and store.get(third.id) is None
    assert store.get(second.id) is not None
    ids = {i for clock in lifecycle.CLOCKS for i, _ in store.due(clock, T0 + 1e9, 100)}
    assert ids == {second.id}


def test_prune_takes_a_batch_at_once(store: JobStore) -> None:
    done = [started(store) for _ in range(3)]
    for job in done:
        assert store.complete(job.id, 1, "w1", "ok", now=T0 + 10).applied
    assert store.prune(now=T0 + 150, limit=2) == 2
    assert store.prune(now=T0 + 150, limit=2) == 1
    assert all(store.get(job.id) is None for job in done)


def corrupt_record(store: JobStore, job_id: str, data: str = "{broken") -> None:
    """Write ``data`` over the stored job of ``job_id`` (its index entries stay): a record this
    version cannot decode, as a corrupted one or one a newer release wrote."""
    found: Any = store
    if hasattr(found, "client"):
        found.client.hset(found._job_prefix + job_id, "data", data)
        return
    import sqlalchemy as sa

    table = found.job_table
    with found.engine.begin() as conn:
        conn.execute(sa.update(table).where(table.c.id == job_id).values(data=data))


def test_prune_passes_over_a_record_it_cannot_read(
    store: JobStore, caplog: pytest.LogCaptureFixture
) -> None:
    """One undecodable record at the head of the retention index failed the batched read of
    every prune, pass after pass, and the store grew without bound. It is left in the store
    (a newer release may have written it), said once, and its entry moved an hour on; the
    readable jobs behind it are pruned, a batch at a time."""
    from ojs_celery.store.base import UNREADABLE_RETRY

    jobs = [started(store) for _ in range(6)]
    for i, job in enumerate(jobs):  # retention passes at +110, +111, ...
        assert store.complete(job.id, 1, "w1", "ok", now=T0 + 10 + i).applied
    bad, other = jobs[0], jobs[3]
    corrupt_record(store, bad.id)  # at the head of the index
    newer = {"id": other.id, "type": "test.job", "args": [], "state": "paused"}
    corrupt_record(store, other.id, json.dumps(newer))  # a state a newer release might add
    now = T0 + 200
    with caplog.at_level(logging.WARNING, logger="ojs_celery.store.base"):
        assert store.prune(now=now, limit=2) == 2  # the place of the bad one went to another
        assert store.prune(now=now, limit=2) == 2
        assert store.prune(now=now, limit=2) == 0
    said = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [bad.id in r.getMessage() for r in said] == [True, False]
    assert other.id in said[1].getMessage()
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in said)
    assert "ValidationError" in said[0].getMessage()
    assert [store.get(job.id) is None for job in jobs[1:] if job is not other] == [True] * 4
    with pytest.raises(ValueError):  # still there, as written
        store.get(bad.id)
    later = now + UNREADABLE_RETRY
    assert sorted(store.due("retention", T0 + 1e9, 10)) == sorted(
        [(bad.id, later), (other.id, later)])

    caplog.clear()  # not read again before its new time...
    loads: list[str] = []
    get_records, get_record = store.get_records, store.get_record

    def batch(job_ids: Any) -> list[Record | None]:
        loads.extend(job_ids)
        return get_records(job_ids)

    def one(job_id: str) -> Record | None:
        loads.append(job_id)
        return get_record(job_id)

    store.get_records, store.get_record = batch, one  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.WARNING, logger="ojs_celery.store.base"):
            assert store.prune(now=later - 1, limit=2) == 0
            assert loads == [] and caplog.records == []
            assert store.prune(now=later, limit=2) == 0  # ...then again, still left alone
    finally:
        del store.get_records, store.get_record
    assert set(loads) == {bad.id, other.id}
    assert sorted(bad.id in r.getMessage() for r in caplog.records) == [False, True]
    assert sorted(store.due("retention", T0 + 1e9, 10)) == sorted(
        [(bad.id, later + UNREADABLE_RETRY), (other.id, later + UNREADABLE_RETRY)])


def test_prune_moves_entries_its_own_retention_keeps_longer(store: JobStore) -> None:
    """Entries written under a shorter retention than this store's (another version's or
    process's settings) were read at the head of the index and left there, pass after pass:
    a batch of them stopped the pruning behind it. They are moved to the deadline this
    store's settings give; the due jobs behind them are pruned by the next pass."""
    early = [started(store) for _ in range(2)]
    for job in early:  # retention passes at +110 under the settings they were written with
        assert store.complete(job.id, 1, "w1", "ok", now=T0 + 10).applied
    store.policy = dataclasses.replace(store.policy, retention_completed=1000.0)
    due = started(store)
    assert store.complete(due.id, 1, "w1", "ok", now=T0 - 850).applied  # due at +150
    assert store.prune(now=T0 + 200, limit=2) == 0  # the head: two entries not due here
    assert sorted(store.due("retention", T0 + 1e9, 10)) == sorted(
        [(due.id, T0 + 150), *[(job.id, T0 + 1010) for job in early]])
    assert store.prune(now=T0 + 200, limit=2) == 1
    assert store.get(due.id) is None
    assert all(store.get(job.id) is not None for job in early)
    assert store.prune(now=T0 + 1010, limit=2) == 2


def test_prune_raises_a_store_error_while_reading_past_a_record(store: JobStore) -> None:
    """An outage is no record's fault: the prune ends with it, and nothing is moved."""
    jobs = [started(store) for _ in range(2)]
    for job in jobs:
        assert store.complete(job.id, 1, "w1", "ok", now=T0 + 10).applied
    corrupt_record(store, jobs[0].id)

    def gone(job_id: str) -> Record | None:
        raise StoreError("store gone")

    store.get_record = gone  # type: ignore[method-assign]
    try:
        with pytest.raises(StoreError):
            store.prune(now=T0 + 200)
    finally:
        del store.get_record
    assert [i for i, _ in store.due("retention", T0 + 200, 10)] == [j.id for j in jobs]


def test_unknown_clock(store: JobStore) -> None:
    with pytest.raises(ValueError, match="clock"):
        store.due("nope", T0, 10)


# --------------------------------------------------------------------------- concurrency


def _race(n: int, action: Callable[[int], str]) -> list[str]:
    """Run ``action(i)`` in ``n`` threads released together; their results in thread order."""
    barrier = threading.Barrier(n)
    results: list[str] = [""] * n
    failures: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=10)
            results[i] = action(i)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if failures:
        raise failures[0]
    return results


def test_threads_racing_to_start_one_wins(store: JobStore) -> None:
    for _ in range(3):
        job = created(store)
        reasons = _race(8, lambda i, job=job: store.start(job.id, 1, f"w{i}", now=T0 + 1).reason)
        assert Counter(reasons) == {"ok": 1, "duplicate": 7}
        stored = record(store, job.id)
        assert stored.job.attempt == 1 and stored.version == 2
        assert stored.worker_id == f"w{reasons.index('ok')}"


def _start_in_child(store: JobStore, job_id: str, worker: str, barrier: Any, results: Any) -> None:
    try:
        barrier.wait(timeout=20)
        results.put((worker, store.start(job_id, 1, worker, now=T0 + 1).reason))
    except BaseException as exc:
        results.put((worker, f"error: {exc!r}"))


def test_processes_racing_to_start_one_wins(store: JobStore) -> None:
    ctx = multiprocessing.get_context("fork")
    job = created(store)  # the store is used before the fork, as in Celery's prefork pool
    n = 6
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    processes = [
        ctx.Process(target=_start_in_child, args=(store, job.id, f"p{i}", barrier, results))
        for i in range(n)
    ]
    for process in processes:
        process.start()
    outcomes = dict(results.get(timeout=60) for _ in range(n))
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    assert Counter(outcomes.values()) == {"ok": 1, "duplicate": n - 1}, outcomes
    winner = next(worker for worker, reason in outcomes.items() if reason == "ok")
    stored = record(store, job.id)
    assert stored.worker_id == winner and stored.version == 2
    assert store.complete(job.id, 1, winner, "done", now=T0 + 2).applied  # parent still fine


def test_complete_and_fail_race_exactly_one_applies(store: JobStore) -> None:
    for _ in range(4):
        job = started(store, retry=NO_JITTER)

        def act(i: int, job: Job = job) -> str:
            if i == 0:
                done = store.complete(job.id, 1, "w1", "r", now=T0 + 2)
                return "complete" if done.applied else ""
            failed = store.fail(job.id, 1, "w1", ERROR, now=T0 + 2)
            return "fail" if failed.applied else ""

        outcomes = [o for o in _race(2, act) if o]
        assert len(outcomes) == 1
        stored = record(store, job.id)
        expected = {"complete": "completed", "fail": "retryable"}[outcomes[0]]
        assert stored.job.state == expected and stored.version == 3


def test_apply_retries_on_version_conflict(store: JobStore) -> None:
    job = started(store)
    seen: list[int] = []

    def rule(current: Record) -> Transition:
        seen.append(current.version)
        if len(seen) == 1:  # somebody else writes between our read and our write
            assert store.heartbeat(job.id, 1, "w1", checkpoint="sneaky", now=T0 + 2).applied
        return lifecycle.complete(current, 1, "w1", "done", T0 + 3)

    transition = store.apply(job.id, rule)
    assert transition.applied and seen == [2, 3]
    stored = record(store, job.id)
    assert stored.version == 4 and stored.job.state == "completed"
    assert stored.job.last_checkpoint == "sneaky"  # the other write was not lost


# --------------------------------------------------------------------------- batch primitives


def test_get_records_in_order_with_missing_ones(store: JobStore) -> None:
    first, second = created(store), started(store)
    missing = "01890a5d-ac96-774b-bcce-b302099a8057"
    records = store.get_records([second.id, missing, first.id])
    assert [r.job.id if r else None for r in records] == [second.id, None, first.id]
    assert records[0] == record(store, second.id) and records[2] == record(store, first.id)
    assert store.get_records([]) == []


def test_apply_many_writes_each_job_once_and_reports_lost_races(store: JobStore) -> None:
    jobs = [created(store, enqueue_ttl=5) for _ in range(3)]
    ids = [job.id for job in jobs]
    done = store.apply_many([*ids, "01890a5d-ac96-774b-bcce-b302099a8057"],
                            lambda r: lifecycle.expire_ttl(r, T0 + 6, POLICY))
    assert [d.applied if d else None for d in done] == [True, True, True, False]
    assert done[3] is not None and done[3].reason == "unknown_job"
    for transition, job_id in zip(done, ids, strict=False):
        assert transition is not None and transition.record is not None
        assert transition.previous is not None and transition.previous.version == 1
        assert transition.record.version == 2 == record(store, job_id).version
        assert record(store, job_id).job.state == "discarded"
    again = store.apply_many(ids, lambda r: lifecycle.expire_ttl(r, T0 + 6, POLICY))
    assert [d.reason if d else None for d in again] == ["not_applicable"] * 3

    # A job written between the batched read and the batched write: its entry is None and
    # nothing of the batch's rule reached it; the others are applied.
    racing = [created(store) for _ in range(2)]

    def rule(current: Record) -> Transition:
        if current.job.id == racing[0].id:
            assert store.cancel(racing[0].id, now=T0 + 1).applied
        return lifecycle.start(current, 1, "w1", T0 + 2, POLICY)

    done = store.apply_many([job.id for job in racing], rule)
    assert done[0] is None and done[1] is not None and done[1].applied
    assert record(store, racing[0].id).job.state == "cancelled"
    assert record(store, racing[1].id).job.state == "active"


def test_ack_dispatch_many(store: JobStore) -> None:
    owed = [created(store) for _ in range(3)]
    acks = [(owed[2].id, 1), (owed[0].id, 2), (owed[1].id, 1), (owed[0].id, 1),
            ("01890a5d-ac96-774b-bcce-b302099a8057", 1)]
    assert store.ack_dispatch_many(acks) == [True, False, True, True, False]
    assert store.due("dispatch", T0 + 1e6, 10) == []
    assert all(record(store, job.id).version == 1 for job in owed)
    assert store.ack_dispatch_many([]) == []


def test_start_with_a_hint(store: JobStore) -> None:
    job = created(store)
    hint = record(store, job.id)
    assert store.ack_dispatch(job.id, 1)  # no version bump: the hint is still current
    done = store.start(job.id, 1, "w1", now=T0 + 1, hint=hint)
    assert done.applied and done.previous is hint
    stored = record(store, job.id)
    assert (stored.job.state, stored.version, stored.dispatch_due) == ("active", 2, None)
    # A stale hint costs a read, never a wrong write.
    assert not store.start(job.id, 1, "w2", now=T0 + 2, hint=hint).applied
    assert record(store, job.id).worker_id == "w1"
    assert store.fail(job.id, 1, "w1", ERROR, now=T0 + 3).applied  # retry: token 2
    done = store.start(job.id, 2, "w3", now=T0 + 20, hint=hint)  # hint: version 1, token 1
    assert done.applied and done.previous is not hint
    assert record(store, job.id).job.attempt == 2


def test_concurrent_heartbeats_are_all_applied(store: JobStore) -> None:
    job = started(store)
    per_thread = 5

    def beat(i: int) -> str:
        for k in range(per_thread):
            transition = store.heartbeat(job.id, 1, "w1", now=T0 + 2 + k, data={"t": i})
            assert transition.applied
        return "ok"

    assert _race(6, beat) == ["ok"] * 6
    assert record(store, job.id).version == 2 + 6 * per_thread


def test_store_used_before_fork_works_in_child(store: JobStore) -> None:
    job = created(store)
    assert store.get(job.id) is not None  # connections are open in the parent now
    pid = os.fork()
    if pid == 0:  # child: report through the exit code only
        code = 1
        try:
            ok = store.start(job.id, 1, "child", now=T0 + 1).applied
            seen = store.get(job.id)
            code = 0 if ok and seen is not None and seen.state == "active" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    stored = record(store, job.id)  # the parent's connections survived the child
    assert stored.worker_id == "child" and stored.job.state == "active"
    assert store.complete(job.id, 1, "child", "ok", now=T0 + 2).applied


# --------------------------------------------------------------------------- workers and meta


def test_workers(store: JobStore) -> None:
    one = WorkerInfo(
        worker_id="w-1",
        hostname="host-a",
        pid=101,
        nodename="celery@a",
        queues=["default"],
        concurrency=4,
        labels=["gpu"],
        started_at=T0,
        last_beat=T0,
    )
    two = WorkerInfo(worker_id="w-2", hostname="host-b", pid=202, started_at=T0, last_beat=T0)
    assert store.workers.get("w-1") is None
    store.workers.save(one)
    store.workers.save(two)
    assert store.workers.get("w-1") == one
    one.state = "quiet"
    one.directive = "terminate"
    one.last_beat = T0 + 5
    one.active_job_ids = ["a", "b"]
    one.reserved_job_ids = ["c"]
    store.workers.save(one)
    assert store.workers.get("w-1") == one
    assert store.workers.all() == [one, two]
    assert store.workers.remove("w-1") is True
    assert store.workers.remove("w-1") is False
    assert store.workers.get("w-1") is None
    assert store.workers.all() == [two]


def test_meta(store: JobStore) -> None:
    meta = store.meta
    assert meta.last_sweep() is None
    meta.record_sweep(T0 + 0.125)
    assert meta.last_sweep() == T0 + 0.125
    meta.record_sweep(T0 + 2)
    assert meta.last_sweep() == T0 + 2
    assert not meta.is_draining("w-1", "j-1")
    meta.mark_draining("w-1", "j-1")
    assert meta.is_draining("w-1", "j-1") and not meta.is_draining("w-2", "j-1")
    assert not meta.is_draining("w-1", "j-2")
    meta.clear_draining("w-1", "j-1")
    meta.clear_draining("w-1", "j-1")  # clearing what is not there is no error
    assert not meta.is_draining("w-1", "j-1")
    assert meta.last_sweep() == T0 + 2


def test_broker_mark_swaps_one_writer_wins(store: JobStore) -> None:
    """Of the sweepers that swap the broker mark from the same value (none included), exactly
    one is told it won. (PostgreSQL told every first writer it lost: the driver's row count of
    an ``INSERT ... ON CONFLICT DO NOTHING`` is -1.)"""
    meta = store.meta
    assert meta.broker_mark() is None
    first = meta.swap_broker_mark(None, BrokerMark("m1"))
    assert first is not None and first.mark == "m1"
    assert meta.swap_broker_mark(None, BrokerMark("m2")) is None
    lost = meta.swap_broker_mark(first, BrokerMark("m3", lost_before=T0))
    assert lost is not None and lost.republishing
    assert meta.swap_broker_mark(first, BrokerMark("m4")) is None
    stored = meta.broker_mark()
    assert stored is not None and (stored.mark, stored.lost_before) == ("m3", T0)


def test_clear_and_prefix_isolation(make_store: MakeStore) -> None:
    mine = make_store()
    theirs = make_store()
    job = created(mine)
    other = created(theirs)
    mine.workers.save(WorkerInfo(worker_id="w", hostname="h", pid=1))
    mine.meta.send_directive("w", "quiet")
    assert theirs.get(job.id) is None
    mine.clear()
    assert mine.get(job.id) is None
    assert mine.workers.all() == [] and mine.meta.pending_directive("w") is None
    assert mine.due("dispatch", T0 + 1e6, 10) == []
    assert theirs.get(other.id) is not None
    created(mine)  # still usable after clear


def test_ping(store: JobStore) -> None:
    store.ping()


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:1/0",
        "postgresql://postgres@127.0.0.1:1/test",
        "sqlite:////nonexistent-ojs-dir/sub/store.sqlite3",
    ],
)
def test_unreachable_store_raises_store_error(url: str) -> None:
    store = open_store(url, prefix="unreachable")
    with pytest.raises(StoreError) as info:
        store.ping()
    assert info.value.__cause__ is not None
    with pytest.raises(StoreError):
        store.get(new_job().id)
    store.close()


def test_stale_workers_are_found_by_last_beat(store: JobStore) -> None:
    for name, beat in (("w-old", 10.0), ("w-mid", 20.0), ("w-new", 30.0)):
        store.workers.save(WorkerInfo(worker_id=name, hostname="h", pid=1, last_beat=beat))
    assert store.workers.stale(20.0, 10) == ["w-old", "w-mid"]
    assert store.workers.stale(20.0, 1) == ["w-old"]
    assert store.workers.stale(5.0, 10) == []


def test_directive_is_one_shot(store: JobStore) -> None:
    assert store.meta.take_directive("w-1") is None
    store.meta.send_directive("w-1", "resume")
    store.meta.send_directive("w-1", "quiet")  # replaces one not yet taken
    assert store.meta.pending_directive("w-1") == "quiet"
    assert store.meta.take_directive("w-2") is None
    assert store.meta.take_directive("w-1") == "quiet"
    assert store.meta.take_directive("w-1") is None
    assert store.meta.pending_directive("w-1") is None


def test_a_removed_worker_takes_its_directive_and_drain_marks_along(store: JobStore) -> None:
    store.workers.save(WorkerInfo(worker_id="w-3", hostname="h", pid=1, last_beat=10.0))
    store.meta.send_directive("w-3", "terminate")
    store.meta.mark_draining("w-3", "job-a")
    assert store.remove_worker("w-3", ["job-a"])
    assert store.workers.get("w-3") is None
    assert store.meta.pending_directive("w-3") is None
    assert not store.meta.is_draining("w-3", "job-a")
    assert not store.remove_worker("w-3")  # another sweeper removed it first


def test_a_burial_is_claimed_once_and_its_tombstone_stays_first_until_removed(
    store: JobStore,
) -> None:
    """``bury_worker`` turns the record into a tombstone once (the claim among sweepers);
    ``stale`` returns it first, to any cutoff, until the burial's end removes it; that end
    removes only a tombstone, not the record of a worker that came back (its save replaces
    the tombstone) and beat."""
    store.workers.save(WorkerInfo(worker_id="w-live", hostname="h", pid=1, last_beat=5.0))
    info = WorkerInfo(worker_id="w-dead", hostname="h", pid=2, last_beat=10.0,
                      active_job_ids=["job-a"], reserved_job_ids=["job-b"])
    store.workers.save(info)
    tombstone = store.bury_worker(info, 50.0)
    assert tombstone is not None and tombstone.buried and tombstone.buried_at == 50.0
    assert store.bury_worker(info, 51.0) is None  # another sweeper's claim
    found = store.workers.get("w-dead")
    assert found == tombstone and found.last_beat == 10.0
    assert found.active_job_ids == ["job-a"] and found.reserved_job_ids == ["job-b"]
    assert store.workers.stale(6.0, 10) == ["w-dead", "w-live"]
    assert store.workers.stale(0.0, 1) == ["w-dead"]
    assert store.remove_worker("w-dead", buried=True)
    assert store.workers.get("w-dead") is None and store.workers.stale(6.0, 10) == ["w-live"]

    assert store.bury_worker(info, 60.0) is None  # gone: nothing to claim
    store.workers.save(info)
    assert store.bury_worker(info, 70.0) is not None
    back = dataclasses.replace(info, last_beat=80.0)
    store.workers.save(back)  # the worker came back: its record, no tombstone
    assert store.workers.get("w-dead") == back and store.workers.stale(70.0, 10) == ["w-live"]
    assert not store.remove_worker("w-dead", buried=True)
    assert store.workers.get("w-dead") == back


def test_directive_races_give_the_value_at_least_once_and_take_it(store: JobStore) -> None:
    """A directive is taken at least once (``MetaArea.take_directive``: read, then deleted if
    unchanged, so that a delete whose reply was lost still delivers it): takers that race (a
    worker has one, its beat thread) may each get it, as seen in CI on SQLite; it is gone
    after, and each got the one sent."""
    store.meta.send_directive("w-2", "terminate")
    taken: list[str | None] = []
    threads = [threading.Thread(target=lambda: taken.append(store.meta.take_directive("w-2")))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    got = [t for t in taken if t is not None]
    assert got and set(got) == {"terminate"}
    assert store.meta.pending_directive("w-2") is None and store.meta.take_directive("w-2") is None


def test_a_message_snapshot_starts_the_job_without_a_read(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record a message carries (taken before the store confirmed the insert) is the
    stored one: the worker's start is a single compare-and-set."""
    from ojs_celery.envelope import parse_envelope
    from ojs_celery.header import build as ojs_header
    from ojs_celery.header import snapshot as record_from_header

    transition, confirm = store.begin_create(parse_envelope({"type": "a.b", "args": [1]}))
    record = transition.record
    assert record is not None
    header = ojs_header(record.job, record.token, record)  # built before confirm, as enqueue does
    confirm()
    hint = record_from_header(header, record.job.id)
    assert hint is not None

    def no_read(job_id: str) -> Record | None:
        raise AssertionError("the snapshot was stale: start had to read the record")

    monkeypatch.setattr(store, "_load", no_read)
    started = store.start(record.job.id, record.token, "w1", hint=hint)
    assert started.record is not None and started.record.job.state == "active"
