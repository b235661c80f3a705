"""The Redis store's deadline indexes: a job's id is in a clock's sorted set exactly when its
record has a deadline on that clock, through every kind of write. Each record keeps which sets
hold its id (``indexed``, tagged with the record's version), so that a write takes the id out of
only those; a record last written by an older version (no tag, or a stale one) is taken out of
every set, as before."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from ojs_celery import install, lifecycle
from ojs_celery.envelope import Job
from ojs_celery.lifecycle import CLOCKS, Policy
from ojs_celery.store import StoreError, open_store
from ojs_celery.store.redis import CLOCKS_ID, RedisStore
from ojs_celery.sweeper import sweep
from tests.services import redis_url
from tests.workers import unique

T0 = 1_700_000_000.0
POLICY = Policy(dispatch_grace=30.0)
RETRY = {"jitter": False, "initial_interval": "PT2S", "max_attempts": 3}


@pytest.fixture
def store() -> Iterator[RedisStore]:
    opened = open_store(redis_url(), policy=POLICY, prefix=f"ix{uuid.uuid4().hex[:10]}")
    assert isinstance(opened, RedisStore)
    try:
        yield opened
    finally:
        opened.clear()
        opened.close()


def indexed_in(store: RedisStore, job_id: str) -> set[str]:
    """The clocks whose sorted set holds ``job_id``."""
    client = store.client
    return {clock for clock in CLOCKS
            if client.zscore(f"{store.prefix}:due:{clock}", job_id) is not None}


def with_deadlines(store: RedisStore, job_id: str) -> set[str]:
    record = store.get_record(job_id)
    assert record is not None
    return {clock for clock, at in lifecycle.deadlines(record, POLICY).items() if at is not None}


def check(store: RedisStore, job_id: str) -> None:
    assert indexed_in(store, job_id) == with_deadlines(store, job_id)


def test_the_sets_follow_the_record_through_its_life(store: RedisStore) -> None:
    job = Job.model_validate({"type": "t.x", "args": [], "retry": RETRY, "timeout": 60,
                            "total_timeout": 600})
    store.create(job, now=T0)
    check(store, job.id)
    assert "dispatch" in indexed_in(store, job.id)
    store.ack_dispatch(job.id, 1)
    check(store, job.id)
    for step in (
        lambda: store.start(job.id, 1, "w1", now=T0 + 1),
        lambda: store.heartbeat(job.id, 1, "w1", now=T0 + 2),
        lambda: store.fail(job.id, 1, "w1", {"type": "E", "message": "m"}, now=T0 + 3),
        lambda: store.start(job.id, 2, "w2", now=T0 + 6),
        lambda: store.complete(job.id, 2, "w2", "done", now=T0 + 7),
    ):
        assert step().applied
        check(store, job.id)
    many = [Job.model_validate({"type": "t.x", "args": [n]}) for n in range(3)]
    store.create_many(many, now=T0)
    for created in many:
        check(store, created.id)
        assert store.start(created.id, 1, "w1", now=T0 + 1).applied
        check(store, created.id)


@pytest.mark.parametrize("older", ["no field", "stale tag", "other clocks"])
def test_a_record_from_an_older_version_leaves_every_set_it_left(
    store: RedisStore, older: str
) -> None:
    """A record written by an ojs_celery that kept no ``indexed`` field (or changed by one after
    this version wrote it, so that the field's version tag is stale; or written by a release
    with another list of clocks) and whose id is in sets the field does not name: the next
    write takes the id out of every set it no longer belongs in."""
    job = Job.model_validate({"type": "t.x", "args": []})
    store.create(job, now=T0)
    key = f"{store.prefix}:job:{job.id}"
    client: redis.Redis = store.client
    for clock in CLOCKS:  # as an older write could have left it: in every set
        client.zadd(f"{store.prefix}:due:{clock}", {job.id: T0})
    if older == "no field":
        client.hdel(key, "indexed")
    elif older == "stale tag":  # written at version 0, then changed by an older ojs_celery
        client.hset(key, "indexed", f"0:{CLOCKS_ID}:" + "0" * len(CLOCKS))
    else:  # at this version, by a release with another list of clocks
        client.hset(key, "indexed", "1:0badc0de:" + "0" * len(CLOCKS))
    assert store.start(job.id, 1, "w1", now=T0 + 1).applied
    check(store, job.id)


def test_a_write_cut_half_way_leaves_the_record_as_it_was(store: RedisStore) -> None:
    """An index key of the wrong type (a corrupted keyspace; an ACL refusing it does the same)
    makes a write fail after it began: the job's hash, written last, is not, so the insert is
    not taken for done (its origin is not there) and a compare-and-set leaves the record as it
    was; once the key is mended, both go through."""
    client: redis.Redis = store.client
    broken = f"{store.prefix}:due:retention"
    job = Job.model_validate({"type": "t.x", "args": []})
    store.create(job, now=T0)
    assert store.start(job.id, 1, "w1", now=T0 + 1).applied
    client.set(broken, "not a sorted set")
    before = store.get_record(job.id)
    with pytest.raises(StoreError, match="WRONGTYPE"):
        store.complete(job.id, 1, "w1", "done", now=T0 + 2)  # indexes retention on the way
    assert store.get_record(job.id) == before
    other = Job.model_validate({"type": "t.x", "args": [], "retry": RETRY})
    client.set(f"{store.prefix}:due:redispatch", "not a sorted set")
    with pytest.raises(StoreError, match="WRONGTYPE"):
        store.create(other, now=T0)
    assert store.get_record(other.id) is None
    client.delete(broken, f"{store.prefix}:due:redispatch")
    assert store.complete(job.id, 1, "w1", "done", now=T0 + 2).applied
    store.create(other, now=T0)
    check(store, job.id)
    check(store, other.id)


def test_the_sweeper_takes_out_index_entries_a_failed_write_left(store: RedisStore) -> None:
    """A create cut half way leaves the index entries it wrote before the error (the hash is
    written last): the next sweep pass finds no record for them and takes them out, so that
    they never fill a pass's batch."""
    client: redis.Redis = store.client
    broken = f"{store.prefix}:due:redispatch"
    client.set(broken, "not a sorted set")
    job = Job.model_validate({"type": "t.x", "args": []})
    with pytest.raises(StoreError, match="WRONGTYPE"):
        store.create(job)
    client.delete(broken)
    assert store.get_record(job.id) is None
    assert indexed_in(store, job.id)  # what the script wrote before the refused ZADD
    app = Celery(unique("sweep"), broker="memory://", set_as_current=False)
    app.conf.ojs = {"store_url": redis_url(), "store_prefix": store.prefix, "events": False}
    runtime = install(app)
    try:
        report = sweep(runtime, now=time.time() + 7 * 86400)
        assert report.error is None
    finally:
        runtime.close()
        app.close()
    assert indexed_in(store, job.id) == set()
