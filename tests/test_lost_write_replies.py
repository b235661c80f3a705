"""The job store's writes other than the insert and the worker's start and completion
(``test_fencing_replies``), when the server did the write and its reply was lost, and, for
contrast, when the request never reached the server.

A proxy between the store's client and the server (a private ``redis-server``, or the shared
PostgreSQL) forwards a chosen request and drops its reply, closing both sides (redis-py then
sends the command again on a new connection, with its own retries; psycopg raises), or drops the
request itself. What each caller does then is checked through the store: the sweeper's batch of
compare-and-sets (the transitions it wrote are carried out: their outcome reaches Celery's result
backend), a worker's directive (taken once at least, never lost) and a dead worker's removal
(its jobs are recovered as ``worker_death``).
"""

from __future__ import annotations

import contextlib
import pathlib
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
from celery import Celery
from celery.result import AsyncResult

from ojs_celery import enqueue, lifecycle
from ojs_celery.envelope import parse_envelope
from ojs_celery.runtime import Runtime, get_runtime
from ojs_celery.store import BrokerMark, JobStore, StoreError, StoreUncertain, open_store
from ojs_celery.store.redis import RedisStore
from ojs_celery.store.workers import WorkerInfo
from ojs_celery.sweeper import sweep
from ojs_celery.worker.registry import Registry
from tests.conftest import messages
from tests.e2eapp import make_app
from tests.test_fencing_replies import (  # noqa: F401 - private_redis: a fixture
    _close,
    forget,
    private_redis,
    through_proxy,
)
from tests.workers import filesystem_config, unique

Match = Callable[[bytes], bool]


class LosingProxy:
    """Forwards TCP both ways. Armed with ``match`` (a test of a request's bytes), the next
    matching request either reaches the server and its reply is dropped (``lose="reply"``:
    the write is done, the client's connection is closed), or is dropped itself
    (``lose="request"``: nothing is done); both sides are closed. ``times``: how many matching
    requests in a row (redis-py sends a command again twice after a lost connection)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self._lock = threading.Lock()
        self._match: Match | None = None
        self._times = 0
        self._lose = "reply"
        self._then: Callable[[], object] | None = None
        #: The requests cut so far.
        self.cut: list[bytes] = []
        #: Set: new connections are closed at once (the store is gone; see :meth:`refuse`).
        self.refusing = threading.Event()
        self._open: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, match: Match, lose: str = "reply", times: int = 1,
            then: Callable[[], object] | None = None) -> None:
        """Cut the next ``times`` requests that ``match``; ``then`` is called once a cut
        reply is dropped (or a request, with ``lose="request"``), before the client sees it."""
        with self._lock:
            self._match, self._lose, self._times, self._then = match, lose, times, then

    def refuse(self) -> None:
        """The store is gone: the connections open now are closed (an idle pooled one would
        still answer a read), and new ones once they are made."""
        self.refusing.set()
        with self._lock:
            for sock in self._open:
                _close(sock)
            self._open.clear()

    def disarm(self) -> None:
        with self._lock:
            self._match, self._times = None, 0

    def _take(self, data: bytes) -> str | None:
        """How to cut ``data`` (``"reply"``, ``"request"``), or None: forward it."""
        with self._lock:
            if self._match is None or self._times <= 0 or not self._match(data):
                return None
            self._times -= 1
            self.cut.append(data)
            return self._lose

    def _after_cut(self) -> None:
        with self._lock:
            then, self._then = self._then, None
        if then is not None:
            then()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.refusing.is_set():
                _close(client)
                continue
            server = socket.create_connection(self.upstream)
            with self._lock:
                self._open += [client, server]
            cutting = threading.Event()
            threading.Thread(target=self._up, args=(client, server, cutting), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, cutting),
                             daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, cutting: threading.Event) -> None:
        try:
            while data := client.recv(65536):
                how = self._take(data)
                if how == "request":
                    self._after_cut()
                    break
                if how == "reply":
                    cutting.set()
                server.sendall(data)
                if how == "reply":
                    return  # the reply's arrival closes both sides
        except OSError:
            pass
        _close(client)
        _close(server)

    def _down(self, server: socket.socket, client: socket.socket,
              cutting: threading.Event) -> None:
        try:
            while data := server.recv(65536):
                if cutting.is_set():
                    self._after_cut()
                    break  # the write is done; its reply goes nowhere
                client.sendall(data)
        except OSError:
            pass
        _close(client)
        _close(server)

    def close(self) -> None:
        self._closed = True
        self.listener.close()


@pytest.fixture(params=["redis", "postgres"])
def proxied_url(request: pytest.FixtureRequest) -> Iterator[tuple[str, LosingProxy]]:
    """A store URL (a private Redis, or the shared PostgreSQL) reached through the proxy."""
    url, proxy = through_proxy(request, LosingProxy)
    try:
        yield url, proxy
    finally:
        proxy.disarm()
        proxy.refusing.clear()
        proxy.close()


def warm(store: JobStore) -> None:
    """Load every script the tests cut (Redis) and prepare the lane's statements
    (PostgreSQL), so that a cut request is the write itself, not one Redis answers with
    ``NOSCRIPT`` before it is loaded and sent again."""
    job = parse_envelope({"type": "t.job", "args": ["warm"]})
    store.create(job)
    store.apply_many([job.id], lambda r: lifecycle.cancel(r, time.time()))
    store.meta.send_directive("warm", "quiet")
    store.meta.take_directive("warm")
    store.workers.save(WorkerInfo(worker_id="warm", hostname="h", pid=1, last_beat=1.0))
    store.remove_worker("warm")
    store.ack_dispatch_many([("warm", 1)])
    store._delete_many([("warm", 1)])  # type: ignore[attr-defined]


@pytest.fixture
def proxied(proxied_url: tuple[str, LosingProxy]) -> Iterator[tuple[JobStore, LosingProxy]]:
    url, proxy = proxied_url
    store = open_store(url, prefix=f"l{uuid.uuid4().hex[:10]}")
    try:
        store.ping()  # connect (and create the tables) before any cut
        warm(store)
        yield store, proxy
    finally:
        proxy.disarm()
        forget(store)


@contextlib.contextmanager
def proxied_app(url: str, tmp_path: pathlib.Path) -> Iterator[Celery]:
    """An app (filesystem broker and result backend) whose job store is behind the proxy."""
    config = filesystem_config(tmp_path)
    config["ojs"] = {"store_url": url, "store_prefix": unique("l"), "events": False}
    app = make_app(config)
    store = get_runtime(app).store
    try:
        warm(store)
        yield app
    finally:
        get_runtime(app).flush()
        forget(store)
        app.close()


def batch_cas(store: JobStore) -> Match:
    """The request of a batch of compare-and-sets: the script's call on Redis (not another
    script's), the lane's prepared statement on PostgreSQL."""
    if isinstance(store, RedisStore):
        sha = store._cas_script.sha.upper().encode()
        return lambda data: sha in data.upper()
    return lambda data: b"OJS_CELERY_CAS_" in data.upper()


def every_try(store: JobStore) -> int:
    """Cuts that make a write fail for its caller: redis-py sends a command three times."""
    return 3 if isinstance(store, RedisStore) else 1


# ------------------------------------------------------------------ the sweeper's batch write


def test_a_sweep_batch_whose_reply_was_lost_returns_what_it_wrote(
    proxied: tuple[JobStore, LosingProxy],
) -> None:
    """Every try of the batch is done and its reply lost (redis-py's retries included): the
    batch is read back and each job that carries the batch's write is its transition, as a
    single write's lost reply is settled (before: StoreError, and the sweeper never carried
    out the transitions it had written)."""
    store, proxy = proxied
    jobs = [parse_envelope({"type": "t.job", "args": [n]}) for n in range(3)]
    for job in jobs:
        store.create(job)
    ids = [job.id for job in jobs]
    proxy.arm(batch_cas(store), times=every_try(store))
    done = store.apply_many(ids, lambda r: lifecycle.cancel(r, time.time()))
    assert len(proxy.cut) == every_try(store)
    records = store.get_records(ids)
    assert [r.job.state for r in records if r is not None] == ["cancelled"] * 3
    assert [t.record.nonce for t in done if t is not None and t.record is not None] == [
        r.nonce for r in records if r is not None]


def test_a_sweep_batch_whose_request_was_lost_is_decided_again(
    proxied: tuple[JobStore, LosingProxy],
) -> None:
    """The contrast: the batch never reached the server. Nothing of it is taken for done:
    each job is left to the caller to decide again (None), and that write goes through."""
    store, proxy = proxied
    jobs = [parse_envelope({"type": "t.job", "args": [n]}) for n in range(2)]
    for job in jobs:
        store.create(job)
    ids = [job.id for job in jobs]
    proxy.arm(batch_cas(store), lose="request", times=every_try(store))
    try:
        done = store.apply_many(ids, lambda r: lifecycle.cancel(r, time.time()))
    except StoreError:
        done = [None, None]  # an outage: the sweeper ends its pass, the jobs stay due
    assert done == [None, None]
    assert [r.job.state for r in store.get_records(ids) if r is not None] == ["available"] * 2
    again = [store.apply(job_id, lambda r: lifecycle.cancel(r, time.time())) for job_id in ids]
    assert all(t.applied for t in again)


def test_a_sweep_whose_write_lost_its_reply_reports_the_outcome(
    proxied_url: tuple[str, LosingProxy], tmp_path: pathlib.Path,
) -> None:
    """An attempt past its execution deadline, no attempts left: the sweeper discards it, and
    the reply to that write is lost on every try. The pass still carries the transition out:
    the job's FAILURE reaches Celery's result backend (before: the pass ended with a StoreError
    and the job, discarded in the store, was never reported: ``AsyncResult.get()`` waited for
    ever, since no later pass finds a terminal job due)."""
    url, proxy = proxied_url
    with proxied_app(url, tmp_path) as app:
        runtime = get_runtime(app)
        store = runtime.store
        job = enqueue({"type": "e2e.add", "args": [1, 2], "timeout": 10, "grace_period": 5,
                       "retry": {"max_attempts": 1}}, app=app)
        start = time.time()
        assert store.start(job.id, 1, "worker_a", now=start).applied
        proxy.arm(batch_cas(store), times=every_try(store))
        report = sweep(runtime, now=start + 17)
        assert proxy.cut, "the sweep's write was not cut"
        assert report.error is None and report.applied["execution"] == 1, report
        stored = store.get(job.id)
        assert stored is not None and stored.state == "discarded"
        assert AsyncResult(job.id, app=app).state == "FAILURE"


# ------------------------------------------------------------------ a worker's directive


def deleting(store: JobStore) -> Match:
    """A request that deletes a meta value: a script on Redis, a DELETE on PostgreSQL."""
    word = b"EVALSHA" if isinstance(store, RedisStore) else b"DELETE"
    return lambda data: word in data.upper()


def takes(store: JobStore, worker_id: str, times: int) -> list[str | None]:
    """What ``times`` beats take as the worker's directive ("error": the beat failed)."""
    got: list[str | None] = []
    for _ in range(times):
        try:
            got.append(store.meta.take_directive(worker_id))
        except StoreError:
            got.append("error")
    return got


@pytest.mark.parametrize("lose", ["reply", "request"])
def test_a_directive_whose_taking_was_cut_is_still_delivered(
    proxied: tuple[JobStore, LosingProxy], lose: str,
) -> None:
    """The write that takes a directive away (so that the next beat does not get it again) is
    cut, before or after the server did it: the worker still gets the directive, once at least
    (applying it again is harmless: quiet, resume and terminate set a state), and it is gone
    after. Before: a lost reply lost the directive (redis-py sent the take again, which found
    nothing; PostgreSQL's beat failed after the delete was done)."""
    store, proxy = proxied
    worker_id = unique("w")
    store.meta.send_directive(worker_id, "terminate")
    # one lost reply: redis-py sends the command again at once
    proxy.arm(deleting(store), lose=lose, times=1 if lose == "reply" else every_try(store))
    got = takes(store, worker_id, 3)
    assert proxy.cut, "the taking was not cut"
    assert "terminate" in got, got
    assert got[-1] is None and store.meta.pending_directive(worker_id) is None, got


def saving(store: JobStore, worker_id: str) -> Match:
    """The request that saves ``worker_id``'s record (a beat's write, not a read of it)."""
    name = worker_id.upper().encode()
    word = b"MULTI" if isinstance(store, RedisStore) else b"INSERT"
    return lambda data: name in data.upper() and word in data.upper()


def test_a_beat_whose_save_was_cut_leaves_the_directive_for_the_next(
    proxied: tuple[JobStore, LosingProxy],
) -> None:
    """A beat's save of the worker's record fails (its request lost on every try): the beat
    fails, and the operator's directive waits for the next beat. Before, the beat took the
    directive first, and the failed beat lost it."""
    store, proxy = proxied
    worker_id = unique("w")
    info = WorkerInfo(worker_id=worker_id, hostname="h", pid=1, last_beat=1.0)
    registry = Registry(cast(Runtime, SimpleNamespace(store=store)), worker_id)
    registry.register(info)
    store.meta.send_directive(worker_id, "quiet")
    proxy.arm(saving(store, worker_id), lose="request", times=every_try(store))
    with pytest.raises(StoreError):
        registry.beat(info)
    assert proxy.cut, "the save was not cut"
    assert registry.beat(info) == ("quiet", True)
    assert store.meta.pending_directive(worker_id) is None


# ------------------------------------------------------------------ a dead worker's removal


def removal(store: JobStore, worker_id: str) -> Match:
    """The request that removes ``worker_id``'s record (not a read of it)."""
    name = worker_id.upper().encode()
    if isinstance(store, RedisStore):
        return lambda data: name in data.upper() and b"HGET" not in data.upper()
    return lambda data: name in data.upper() and b"DELETE" in data.upper()


def burial(store: JobStore, worker_id: str) -> Match:
    """The request that turns ``worker_id``'s record into a tombstone (not a read of it)."""
    name = worker_id.upper().encode()
    if isinstance(store, RedisStore):
        return lambda data: name in data.upper() and b"HGET" not in data.upper()
    return lambda data: name in data.upper() and b"UPDATE" in data.upper()


def dead_worker_with_a_job(store: JobStore, now: float) -> tuple[str, str]:
    """A worker last heard 40 s ago (declared dead after 30 s) running a job it started then
    (not stalled yet: 60 s); their ids."""
    job = parse_envelope({"type": "e2e.add", "args": [1, 2]})
    store.create(job, now=now - 41)
    worker_id = unique("w")
    assert store.start(job.id, 1, worker_id, now=now - 40).applied
    store.workers.save(WorkerInfo(worker_id=worker_id, hostname="h", pid=1,
                                  last_beat=now - 40, active_job_ids=[job.id]))
    return worker_id, job.id


def test_a_removal_whose_reply_was_lost_is_the_callers(
    proxied: tuple[JobStore, LosingProxy],
) -> None:
    """The removal is done and its reply lost: the caller is told it removed the worker (the
    sweeper then recovers its jobs), not that another sweeper did (before: redis-py sent it
    again, which found nothing to remove; PostgreSQL raised)."""
    store, proxy = proxied
    worker_id = unique("w")
    store.workers.save(WorkerInfo(worker_id=worker_id, hostname="h", pid=1, last_beat=1.0))
    proxy.arm(removal(store, worker_id))
    assert store.remove_worker(worker_id) is True
    assert proxy.cut and store.workers.get(worker_id) is None


@pytest.mark.parametrize("lose", ["reply", "request"])
def test_a_dead_worker_whose_removal_was_cut_has_its_jobs_recovered(
    proxied_url: tuple[str, LosingProxy], tmp_path: pathlib.Path, lose: str,
) -> None:
    """The sweeper's claim of a dead worker (the write of its tombstone, which the removal
    was before) is cut: its running job is recovered as ``worker_death`` by that pass (lost
    reply) or the next one (lost request), not left active until its stall clock (a reserved
    job: until the broker's redelivery), and its record is gone after."""
    url, proxy = proxied_url
    with proxied_app(url, tmp_path) as app:
        runtime = get_runtime(app)
        store = runtime.store
        now = time.time()
        worker_id, job_id = dead_worker_with_a_job(store, now)
        proxy.arm(burial(store, worker_id), lose=lose, times=every_try(store))
        for _ in range(2):
            sweep(runtime, now=now)
            stored = store.get(job_id)
            assert stored is not None
            if stored.state != "active":
                break
        assert proxy.cut, "the removal was not cut"
        assert stored.state == "retryable", stored.state
        assert stored.error is not None and stored.error["type"] == "worker_death"
        assert store.workers.get(worker_id) is None


# ------------------------------------------------------------------ a start, then the beat


def test_a_start_whose_reply_was_lost_and_its_beat_extended_is_still_applied(
    proxied: tuple[JobStore, LosingProxy],
) -> None:
    """A worker's start is done and every try's reply lost; before the start reads the record
    back, the worker's beat (another thread, which lists the message it holds) extends the
    attempt, so the record no longer carries the start's nonce. The start is still its own:
    the attempt is this worker's, with this token, started at this start's time, and only its
    owner writes an active attempt. Before: refused as a ``duplicate``, the message dropped
    and the job left active, running nowhere, until its stall clock (with no attempts left,
    discarded without having run)."""
    store, proxy = proxied
    job = parse_envelope({"type": "t.job", "args": []})
    store.create(job)
    hint = store.get_record(job.id)
    load = store._load  # type: ignore[attr-defined]
    beats: list[bool] = []

    def beat_then_load(job_id: str) -> lifecycle.Record | None:
        store._load = load  # type: ignore[attr-defined]
        proxy.disarm()
        beats.append(store.extend(job_id, 1, "w1", stall=True).applied)
        return load(job_id)  # type: ignore[no-any-return]

    proxy.arm(lambda data: b"EVALSHA" in data.upper() or b"OJS_CELERY_CAS_" in data.upper(),
              times=10)  # the lane's try and redis-py's three
    store._load = beat_then_load  # type: ignore[attr-defined]
    try:
        started = store.start(job.id, 1, "w1", now=time.time(), hint=hint)
    finally:
        store._load = load  # type: ignore[attr-defined]
    assert proxy.cut and beats == [True]  # the start landed; the beat found it and extended it
    assert started.applied and started.record is not None, started.reason
    assert started.record.job.state == "active" and started.record.job.attempt == 1
    assert [name for name, _ in started.events] == ["job.started"]
    stored = store.get_record(job.id)
    assert stored is not None and stored.nonce == started.record.nonce  # the current record
    # a second message with the same token is still a duplicate
    assert store.start(job.id, 1, "w1", hint=stored).reason == "duplicate"


# ------------------------------------------------------------------ the other writes, checked


def _started(store: JobStore) -> str:
    job = parse_envelope({"type": "t.job", "args": [], "retry": {"max_attempts": 3}})
    store.create(job)
    assert store.start(job.id, 1, "w1").applied
    return job.id


def _acked(store: JobStore) -> str:
    job = parse_envelope({"type": "t.job", "args": []})
    store.create(job)  # owes its message: the outbox entry
    return job.id


def _pruned(store: JobStore) -> str:
    job_id = _started(store)
    assert store.complete(job_id, 1, "w1", None, now=1.0).applied  # retention long past
    return job_id


#: name: (prepare, the write, PostgreSQL's request of it (a batch: its COMMIT), what the record
#: then shows)
WRITES: dict[str, tuple[Callable[[JobStore], str], Callable[[JobStore, str], Any], bytes,
                        Callable[[lifecycle.Record | None], bool]]] = {
    "cancel": (_acked, lambda s, j: s.cancel(j), b"OJS_CELERY_CAS_",
               lambda r: r is not None and r.job.state == "cancelled"),
    "fail": (_started, lambda s, j: s.fail(j, 1, "w1", lifecycle.make_error("E", "boom")),
             b"OJS_CELERY_CAS_",
             lambda r: r is not None and r.job.state == "retryable" and r.token == 2),
    "heartbeat": (_started, lambda s, j: s.heartbeat(j, 1, "w1", progress=0.5),
                  b"OJS_CELERY_CAS_",
                  lambda r: r is not None and (r.job.progress or {}).get("progress") == 0.5),
    "extend": (_started, lambda s, j: s.extend(j, 1, "w1", stall=True), b"OJS_CELERY_CAS_",
               lambda r: r is not None and r.job.state == "active"),
    "ack_dispatch": (_acked, lambda s, j: s.ack_dispatch_many([(j, 1)]), b"UPDATE",
                     lambda r: r is not None and r.dispatch_due is None),
    "prune": (_pruned, lambda s, j: s.prune(), b"COMMIT", lambda r: r is None),
}


@pytest.mark.parametrize("lose", ["reply", "request"])
@pytest.mark.parametrize("name", list(WRITES))
def test_a_write_whose_reply_was_lost_is_done_once(
    proxied: tuple[JobStore, LosingProxy], name: str, lose: str,
) -> None:
    """The compare-and-sets (a cancel, a worker's fail, heartbeat and beat's extension), the
    outbox's acknowledgement and pruning, each done by the server and its reply lost once:
    the record shows the write, once. A compare-and-set is settled (redis-py's try finds its
    own nonce; PostgreSQL's read finds it) and answers as applied; an acknowledgement and a
    prune may answer False or raise (the outbox leaves the entry to the sweeper, which
    republishes a message fencing drops; the sweep's pass ends), and nothing waits on them.
    The contrast, a request that never arrived: a compare-and-set is decided again and
    written; the others are sent again (Redis) or raise with nothing done (PostgreSQL)."""
    store, proxy = proxied
    prepare, write, pg_request, shows = WRITES[name]
    job_id = prepare(store)
    word = b"EVALSHA" if isinstance(store, RedisStore) else pg_request
    proxy.arm(lambda data: word in data.upper(), lose=lose)
    failed = False
    try:
        done = write(store, job_id)
    except StoreError:
        assert name in ("ack_dispatch", "prune") and not isinstance(store, RedisStore)
        done, failed = None, True
    assert proxy.cut, "the write was not cut"
    if isinstance(done, lifecycle.Transition):
        assert done.applied, done.reason
    assert shows(store.get_record(job_id)) is not (failed and lose == "request")


@pytest.mark.parametrize("batch", [False, True])
def test_an_insert_whose_request_was_lost_is_sent_again(
    proxied: tuple[JobStore, LosingProxy], batch: bool,
) -> None:
    """The contrast to a lost reply (``test_fencing_replies``): the insert never reached the
    server. The read that settles it finds no record, the insert is sent again and the caller
    gets the job, stored once, not ``StoreUncertain``."""
    store, proxy = proxied
    jobs = [parse_envelope({"type": "t.job", "args": [n]}) for n in range(2 if batch else 1)]
    word = b"EVALSHA" if isinstance(store, RedisStore) else b"COMMIT" if batch else b"INSERT"
    proxy.arm(lambda data: word in data.upper(), lose="request")
    made = store.create_many(jobs) if batch else [store.create(jobs[0])]
    assert proxy.cut, "the insert was not cut"
    records = store.get_records([job.id for job in jobs])
    assert [r.origin for r in records if r is not None] == [
        t.record.origin for t in made if t.record is not None]


# ------------------------------------------------------------------ the sweepers' broker mark


def test_a_broker_mark_swap_whose_reply_was_lost_is_the_callers(
    proxied: tuple[JobStore, LosingProxy],
) -> None:
    """The swap of the sweepers' mark of the broker's data is done and its reply lost: redis-py
    sends it again, which finds the value it writes already there, and the caller is told it
    swapped (before: "another sweeper changed it first", and the pass that saw the broker lose
    its data left the republishing to the next pass, a sweep interval later). PostgreSQL
    raises (the pass ends; the next one finds the mark written)."""
    store, proxy = proxied
    first = store.meta.swap_broker_mark(None, BrokerMark("m1"))
    assert first is not None
    after = BrokerMark("m2", lost_before=time.time())
    word = b"EVALSHA" if isinstance(store, RedisStore) else b"UPDATE"
    proxy.arm(lambda data: word in data.upper())
    try:
        swapped = store.meta.swap_broker_mark(first, after)
    except StoreError:
        assert not isinstance(store, RedisStore)
        swapped = None
    else:
        assert swapped is not None and swapped.mark == "m2"
    assert proxy.cut, "the swap was not cut"
    stored = store.meta.broker_mark()
    assert stored is not None and stored.mark == "m2" and stored.republishing
    # a swap from a value no longer there still loses
    assert store.meta.swap_broker_mark(first, BrokerMark("m3")) is None


# ------------------------------------------------------------------ a Celery caller's insert


def inserting(store: JobStore) -> Match:
    word = b"EVALSHA" if isinstance(store, RedisStore) else b"INSERT"
    return lambda data: word in data.upper()


@pytest.mark.parametrize("gone", [False, True])
def test_an_apply_async_whose_insert_lost_its_reply(
    proxied_url: tuple[str, LosingProxy], tmp_path: pathlib.Path, gone: bool,
) -> None:
    """``.apply_async()`` of an OJS task whose insert is done and its reply lost: it returns,
    the job stored once and its message published once. With the store gone after the cut
    (no read can settle it), it raises StoreUncertain naming the job, which is stored: the
    caller can look it up (its message went out while the insert was in flight, or stays
    owed in the outbox)."""
    url, proxy = proxied_url
    with proxied_app(url, tmp_path) as app:
        store = get_runtime(app).store
        before = len(messages(app))
        # gone: the store is gone once the insert's reply is lost
        proxy.arm(inserting(store), then=proxy.refuse if gone else None)
        if gone:
            with pytest.raises(StoreUncertain) as caught:
                app.tasks["e2e.add"].apply_async((1, 2))
            proxy.refusing.clear()
            job_id = caught.value.job_id
        else:
            job_id = app.tasks["e2e.add"].apply_async((1, 2)).id
        assert proxy.cut, "the insert was not cut"
        stored = store.get_record(job_id)
        assert stored is not None and stored.job.args == [1, 2]
        assert stored.job.state == "available"
        assert len(messages(app)) - before <= 1  # never twice; owed if not sent
        if not gone:
            assert len(messages(app)) - before == 1
