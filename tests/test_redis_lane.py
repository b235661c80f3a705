"""The Redis store's fast lane (``ojs_celery.store.redis_lane``) takes nothing away: a
forgotten script, a killed connection, a busy lane and threads all still give the answers the
ordinary path gives."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from ojs_celery.envelope import Job
from ojs_celery.store import DuplicateJob
from ojs_celery.store.redis import RedisStore
from tests.services import redis_url


@pytest.fixture
def store() -> Iterator[RedisStore]:
    made = RedisStore(redis_url(), prefix=f"ojs-lane-{uuid.uuid4().hex[:8]}")
    try:
        yield made
    finally:
        made.clear()
        made.close()


def new_job() -> Job:
    return Job.model_validate({"type": "test.job", "args": [1]})


def run_once(store: RedisStore, job: Job, worker: str = "w1") -> None:
    store.create(job)
    assert store.start(job.id, 1, worker).applied
    done = store.complete(job.id, 1, worker, {"ok": True})
    assert done.record is not None and done.record.job.state == "completed"


def test_scripts_flushed_from_redis_are_loaded_again(store: RedisStore) -> None:
    run_once(store, new_job())
    store.client.script_flush()
    run_once(store, new_job())  # insert and compare-and-set found NOSCRIPT, then loaded


def test_a_killed_lane_connection_is_reopened(store: RedisStore) -> None:
    run_once(store, new_job())
    lane_id = store._lane.call("CLIENT", "ID")
    assert isinstance(lane_id, int)
    store.client.client_kill_filter(_id=lane_id)
    run_once(store, new_job())
    assert store._lane.call("CLIENT", "ID") != lane_id


def test_a_write_while_an_insert_awaits_its_answer(store: RedisStore) -> None:
    """enqueue holds the lane from the insert to its confirmation (the publish in between may
    itself write to the store): such a write borrows a pooled connection."""
    first, second = new_job(), new_job()
    _, confirm = store.begin_create(first)
    run_once(store, second)
    confirm()
    with pytest.raises(DuplicateJob):
        store.create(first)
    assert store.get(first.id) is not None


def test_threads_share_the_lane_without_mixing_replies(store: RedisStore) -> None:
    jobs = [new_job() for _ in range(40)]
    failures: list[BaseException] = []

    def work(part: list[Job], worker: str) -> None:
        try:
            for job in part:
                run_once(store, job, worker)
        except BaseException as exc:  # reported below, with the others
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(jobs[i::4], f"w{i}")) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert {store.get(job.id).state for job in jobs} == {"completed"}  # type: ignore[union-attr]


def test_a_call_interrupted_before_its_reply_leaves_nothing_behind(store: RedisStore) -> None:
    """A soft time limit can interrupt a store call in a pool child: the abandoned reply must
    never be read as the answer to the next command."""

    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    queue = f"{store.prefix}:nothing"
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Interrupted):
            store._lane.call("BLPOP", queue, "2")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    store.client.rpush(queue, "for the abandoned BLPOP")
    assert store._lane.call("ECHO", "fresh") == "fresh"
    run_once(store, new_job())


def test_a_child_forked_while_a_thread_holds_the_pools_locks_can_use_the_store(
        store: RedisStore) -> None:
    """Celery's prefork pool forks a replacement child while the worker's beat thread uses the
    store: a lock of redis-py's pool held at that moment stays held for ever in the child,
    whose pool resets itself under it at its first use there (redis-py 8 waits for ``_lock``
    without a bound: the child's first job never ran). The child gets fresh locks instead."""
    run_once(store, new_job())  # connections are open in the parent
    pool = store.client.connection_pool
    locks = [lock for lock in (getattr(pool, "_fork_lock", None), getattr(pool, "_lock", None),
                               getattr(getattr(pool, "_event_dispatcher", None), "_lock", None))
             if lock is not None]
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        for lock in locks:
            lock.acquire()
        held.set()
        release.wait(30)
        for lock in reversed(locks):
            lock.release()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(5)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                run_once(store, new_job())
                code = 0
            finally:
                os._exit(code)
        deadline = time.monotonic() + 15
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child waited for a lock its parent's thread held")
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        release.set()
        holder.join(5)
    run_once(store, new_job())  # the parent's pool is untouched
