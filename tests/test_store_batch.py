"""A batch of jobs is all or nothing: ``enqueue_batch`` stores every job in one atomic store
step, then publishes; a duplicate id stores and publishes nothing (real stores, a real broker
folder)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from celery import Celery

from ojs_celery import InvalidJob, enqueue, enqueue_batch
from ojs_celery.envelope import Job
from ojs_celery.lifecycle import Policy
from ojs_celery.runtime import get_runtime
from ojs_celery.store import DuplicateJob, open_store
from tests.conftest import messages


def envelope(index: int, **fields: Any) -> dict[str, Any]:
    return {"type": "e2e.add", "args": [index, 1], **fields}


def test_a_batch_with_a_taken_id_stores_and_publishes_nothing(
    app: Celery, seen: Counter[str]
) -> None:
    existing = enqueue(envelope(0), app=app)
    published = messages(app)
    events = seen.copy()
    batch: list[Any] = [envelope(1, id=str(Job.model_validate(envelope(1)).id)),
                       envelope(2), envelope(3, id=existing.id), envelope(4)]
    with pytest.raises(InvalidJob) as info:
        enqueue_batch(batch, app=app)
    assert existing.id in str(info.value)
    store = get_runtime(app).store
    assert store.get(str(batch[0]["id"])) is None
    assert messages(app) == published  # nothing published
    assert seen == events  # no event either
    # no outbox entry of the batch (the existing job's may be acknowledged by now, or not yet)
    assert {job_id for job_id, _ in store.due("dispatch", 1e12, 100)} <= {existing.id}
    stored = store.get(existing.id)
    assert stored is not None and stored.args == [0, 1]  # the existing job is untouched


def test_a_batch_is_stored_then_published(app: Celery, seen: Counter[str]) -> None:
    jobs = enqueue_batch([envelope(index) for index in range(5)], app=app)
    store = get_runtime(app).store
    assert [job.args for job in jobs] == [[index, 1] for index in range(5)]
    for job in jobs:
        stored = store.get(job.id)
        assert stored is not None and stored.state == "available"
    assert len(messages(app)) == 5
    assert seen["job.enqueued"] == 5


def test_create_many_on_an_in_memory_sqlite_store() -> None:
    """One shared connection (no transaction of its own there): still all or nothing."""
    store = open_store("sqlite:///:memory:", policy=Policy(), prefix="mem")
    try:
        taken = Job.model_validate(envelope(0))
        store.create(taken)
        fresh = [Job.model_validate(envelope(index)) for index in range(1, 4)]
        with pytest.raises(DuplicateJob):
            store.create_many([*fresh, taken])
        assert all(store.get(job.id) is None for job in fresh)
        assert len(store.create_many(fresh)) == 3
        assert all(store.get(job.id) is not None for job in fresh)
    finally:
        store.close()


def test_the_same_batch_again_returns_its_jobs_and_stores_only_what_is_new(
    app: Celery, seen: Counter[str]
) -> None:
    """As with ``enqueue``: an envelope with the id of the job it made before returns that
    job, one without an id makes a new job (sent again, a batch mixing both is not refused)."""
    chosen = str(Job.model_validate(envelope(1)).id)
    batch: list[Any] = [envelope(1, id=chosen), envelope(2)]
    first = enqueue_batch(batch, app=app)
    published = len(messages(app))
    again = enqueue_batch(batch, app=app)
    assert again[0].id == first[0].id == chosen and again[0].created_at == first[0].created_at
    assert again[1].id != first[1].id and again[1].args == [2, 1]
    assert len(messages(app)) == published + 1  # only the new job's message
    store = get_runtime(app).store
    assert store.get(again[1].id) is not None
    assert seen["job.enqueued"] == 3

    same = [envelope(3, id=str(Job.model_validate(envelope(3)).id))]
    assert enqueue_batch(same, app=app)[0].id == enqueue_batch(same, app=app)[0].id


def test_a_batch_sent_again_with_a_changed_envelope_stores_nothing(app: Celery) -> None:
    chosen = str(Job.model_validate(envelope(1)).id)
    enqueue_batch([envelope(1, id=chosen)], app=app)
    published = messages(app)
    fresh = str(Job.model_validate(envelope(5)).id)
    with pytest.raises(InvalidJob, match=chosen):
        enqueue_batch([envelope(5, id=fresh), envelope(9, id=chosen)], app=app)
    assert get_runtime(app).store.get(fresh) is None
    assert messages(app) == published
