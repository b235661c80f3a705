"""A write whose reply was lost is not a lost race (issue 10, item 4).

A TCP proxy between the store client and the server forwards one write, waits for the server's
reply (so the write is done), drops the reply and cuts the connection. The store must then
recognise its own write by its nonce: the start or completion is applied, the insert returns.
Redis runs as a private ``redis-server`` started here; PostgreSQL is the shared server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

import psycopg
import pytest
import redis
from celery import Celery

from ojs_celery import enqueue, enqueue_batch, lifecycle
from ojs_celery.envelope import parse_envelope
from ojs_celery.runtime import get_runtime
from ojs_celery.store import JobStore, StoreError, StoreRefused, StoreUncertain, open_store
from ojs_celery.store.redis import RedisStore
from tests.conftest import messages
from tests.e2eapp import make_app
from tests.pgserver import NO_STANDBY, PrivatePostgres, waiting_for_standby
from tests.services import postgres_url
from tests.workers import filesystem_config, running_worker, unique, wait_for


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Proxy(Protocol):
    """What :func:`through_proxy` needs of a proxy: the port it listens on."""

    port: int


ProxyT = TypeVar("ProxyT", bound=Proxy)


class CuttingProxy:
    """Forwards TCP both ways; when armed, the next client request is forwarded, its reply is
    swallowed and both sides are closed (once; with ``every``, each such request while armed).
    With ``early`` the client's side is closed as soon as the request is forwarded, and the
    server's side stays open until its reply comes: a write the server holds (a lock, a
    synchronous standby, paused clients) is still done after the client lost it."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.armed = threading.Event()
        #: When set, only a request containing these bytes (upper-cased) is cut.
        self.match: bytes | None = None
        #: Cut every matching request while armed, not only the next one.
        self.every = False
        #: Close the client's side right after forwarding (see the class docstring).
        self.early = False
        #: Set: new connections are closed at once (the store is unreachable).
        self.refusing = threading.Event()
        self.cuts = 0
        #: The requests whose replies were cut.
        self.cut: list[bytes] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.refusing.is_set():
                client.close()
                continue
            server = socket.create_connection(self.upstream)
            state = {"cutting": False}
            threading.Thread(target=self._pump, args=(client, server, state, True),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, state, False),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, state: dict[str, bool],
              upstream: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if upstream and self.armed.is_set() and (
                        self.match is None or self.match in data.upper()):
                    if not self.every:
                        self.armed.clear()
                    state["cutting"] = True
                    self.cut.append(data)
                    if self.early:  # the server's side is closed once its reply comes
                        dst.sendall(data)
                        _close(src)
                        return
                elif not upstream and state["cutting"]:
                    self.cuts += 1  # the write is done: its reply is lost with the connection
                    break
                dst.sendall(data)
        except OSError:
            pass
        _close(src)
        _close(dst)

    def close(self) -> None:
        self._closed = True
        self.listener.close()


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


@pytest.fixture(scope="module")
def private_redis() -> Iterator[tuple[str, int]]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield ("127.0.0.1", port)
    finally:
        process.terminate()
        process.wait(10)


def through_proxy(request: pytest.FixtureRequest,
                  make: Callable[[tuple[str, int]], ProxyT]) -> tuple[str, ProxyT]:
    """A store URL (a private Redis, or the shared PostgreSQL, by ``request.param``) reached
    through the proxy that ``make`` builds for its server, and that proxy."""
    if request.param == "redis":
        proxy = make(request.getfixturevalue("private_redis"))
        return f"redis://127.0.0.1:{proxy.port}/0", proxy
    real = postgres_url()
    parts = urlsplit(real)
    proxy = make((parts.hostname or "127.0.0.1", parts.port or 5432))
    netloc = parts.netloc.rsplit("@", 1)
    host = f"127.0.0.1:{proxy.port}"
    return real.replace(parts.netloc, f"{netloc[0]}@{host}" if len(netloc) == 2 else host), proxy


@pytest.fixture(params=["redis", "postgres"])
def proxied_url(request: pytest.FixtureRequest) -> Iterator[tuple[str, CuttingProxy]]:
    """A store URL (a private Redis, or the shared PostgreSQL) reached through the proxy."""
    url, proxy = through_proxy(request, CuttingProxy)
    try:
        yield url, proxy
    finally:
        proxy.armed.clear()
        proxy.refusing.clear()
        proxy.close()


def forget(store: JobStore) -> None:
    store.clear()
    drop = getattr(store, "drop_tables", None)
    if drop is not None:
        drop()
    store.close()


@pytest.fixture
def proxied(proxied_url: tuple[str, CuttingProxy]) -> Iterator[tuple[JobStore, CuttingProxy]]:
    url, proxy = proxied_url
    store = open_store(url, prefix=f"r{uuid.uuid4().hex[:10]}")
    try:
        store.ping()  # connect (and create the tables) before any cut
        yield store, proxy
    finally:
        proxy.armed.clear()
        proxy.refusing.clear()
        forget(store)


def cut_batch_insert(store: JobStore, proxy: CuttingProxy) -> None:
    """Arm the proxy for a batch insert's write: its script call on Redis (once loaded), its
    transaction's ``COMMIT`` on PostgreSQL (the statements before it change nothing yet)."""
    store.create_many([parse_envelope({"type": "t.job", "args": ["warm"]})])
    proxy.match = b"EVALSHA" if isinstance(store, RedisStore) else b"COMMIT"
    proxy.armed.set()


def test_a_start_whose_reply_was_lost_is_applied(
    proxied: tuple[JobStore, CuttingProxy],
) -> None:
    store, proxy = proxied
    job = parse_envelope({"type": "t.job", "args": []})
    store.create(job)
    hint = store.get_record(job.id)
    proxy.armed.set()
    started = store.start(job.id, 1, "w1", hint=hint)
    assert proxy.cuts == 1
    assert started.applied and started.record is not None
    assert started.record.job.state == "active" and started.record.job.attempt == 1
    stored = store.get_record(job.id)
    assert stored is not None and stored.nonce == started.record.nonce


def test_a_completion_whose_reply_was_lost_is_applied(
    proxied: tuple[JobStore, CuttingProxy],
) -> None:
    store, proxy = proxied
    job = parse_envelope({"type": "t.job", "args": []})
    store.create(job)
    started = store.start(job.id, 1, "w1")
    proxy.armed.set()
    done = store.complete(job.id, 1, "w1", {"ok": True}, hint=started.record)
    assert proxy.cuts == 1
    assert done.applied and done.record is not None and done.record.job.state == "completed"


def test_an_insert_whose_reply_was_lost_returns_the_job(
    proxied: tuple[JobStore, CuttingProxy],
) -> None:
    store, proxy = proxied
    store.create(parse_envelope({"type": "t.job", "args": [0]}))  # the cut hits the insert
    job = parse_envelope({"type": "t.job", "args": [1]})
    proxy.armed.set()
    created = store.create(job)  # raises nothing: the insert is recognised as its own
    assert proxy.cuts == 1
    assert created.record is not None
    stored = store.get_record(job.id)
    assert stored is not None and stored.origin == created.record.origin


def test_an_insert_lost_with_the_store_is_uncertain(
    proxied: tuple[JobStore, CuttingProxy],
) -> None:
    store, proxy = proxied
    store.create(parse_envelope({"type": "t.job", "args": [0]}))  # the cut hits the insert
    job = parse_envelope({"type": "t.job", "args": [1]})
    proxy.armed.set()
    proxy.refusing.set()  # the store is gone once the write's reply is cut
    with pytest.raises(StoreUncertain) as caught:
        store.create(job)
    assert caught.value.job_id == job.id
    assert "job store error:" in str(caught.value)  # what the store said, named
    proxy.refusing.clear()
    stored = store.get_record(job.id)  # the caller can look it up: it was stored
    assert stored is not None and stored.job.args == [1]


def test_the_proxy_cuts_the_write_itself(proxied: tuple[JobStore, CuttingProxy]) -> None:
    """The cut request is the compare-and-set (not a connection handshake or a read)."""
    store, proxy = proxied
    job = parse_envelope({"type": "t.job", "args": []})
    store.create(job)
    hint = store.get_record(job.id)
    proxy.armed.set()
    assert store.start(job.id, 1, "w1", hint=hint).applied
    assert len(proxy.cut) == 1
    sent = proxy.cut[0].upper()  # a script call, or the PostgreSQL lane's prepared statement
    assert b"EVALSHA" in sent or b"UPDATE" in sent or b"OJS_CELERY_CAS_" in sent


def test_a_batch_whose_reply_was_lost_is_written_whole(
    proxied: tuple[JobStore, CuttingProxy],
) -> None:
    """A sweep's batch of compare-and-sets (one Redis pipeline of scripts, one PostgreSQL
    pipeline in one transaction) whose reply is lost after the server wrote it: the caller
    gets either the batch's transitions (Redis sends it again, and each script finds its own
    nonce) or StoreError, never a half-written batch; every job carries the batch's write."""
    store, proxy = proxied
    jobs = [parse_envelope({"type": "t.job", "args": [n]}) for n in range(3)]
    for job in jobs:
        store.create(job)
    ids = [job.id for job in jobs]
    # the batch's write, not its read: a script call, or the lane's prepared statement
    proxy.match = b"EVALSHA" if isinstance(store, RedisStore) else b"OJS_CELERY_CAS_"
    proxy.armed.set()
    try:
        done = store.apply_many(ids, lambda r: lifecycle.cancel(r, time.time()))
    except StoreError:
        done = None
    assert proxy.cuts == 1
    records = store.get_records(ids)
    assert [r.job.state for r in records if r is not None] == ["cancelled"] * 3
    if done is not None:
        assert [t.record.nonce for t in done if t is not None and t.record is not None] == [
            r.nonce for r in records if r is not None]


def test_a_batch_insert_whose_reply_was_lost_returns_its_jobs(
    proxied: tuple[JobStore, CuttingProxy],
) -> None:
    """All or none of a batch is stored: sent again, or read back on its first job, the write
    is recognised as the batch's own (not a duplicate, not an error)."""
    store, proxy = proxied
    cut_batch_insert(store, proxy)
    jobs = [parse_envelope({"type": "t.job", "args": [n]}) for n in range(3)]
    made = store.create_many(jobs)
    assert proxy.cuts == 1
    records = store.get_records([job.id for job in jobs])
    assert [r.origin for r in records if r is not None] == [
        t.record.origin for t in made if t.record is not None]


def test_a_batch_insert_lost_with_the_store_is_uncertain(
    proxied: tuple[JobStore, CuttingProxy],
) -> None:
    store, proxy = proxied
    cut_batch_insert(store, proxy)
    proxy.refusing.set()  # the store is gone once the write's reply is cut
    jobs = [parse_envelope({"type": "t.job", "args": [n]}) for n in range(3)]
    with pytest.raises(StoreUncertain) as caught:
        store.create_many(jobs)
    assert caught.value.job_id == jobs[0].id and caught.value.batch == 3
    proxy.refusing.clear()
    assert all(r is not None for r in store.get_records([job.id for job in jobs]))


def test_an_enqueue_batch_whose_reply_was_lost_returns_and_publishes_its_jobs(
    proxied_url: tuple[str, CuttingProxy], tmp_path: pathlib.Path,
) -> None:
    """The caller is told the batch is stored (it is), and its messages go out at once."""
    url, proxy = proxied_url
    config = filesystem_config(tmp_path)
    config["ojs"] = {"store_url": url, "store_prefix": unique("r"), "events": False}
    app = make_app(config)
    store = get_runtime(app).store
    try:
        cut_batch_insert(store, proxy)
        jobs = enqueue_batch([{"type": "e2e.add", "args": [n, 1]} for n in range(3)], app=app)
        assert proxy.cuts == 1
        assert all(r is not None for r in store.get_records([job.id for job in jobs]))
        assert len(messages(app)) == 3
    finally:
        get_runtime(app).flush()  # the outbox acknowledgements, or they would make the tables
        forget(store)             # again once these are dropped


def test_store_uncertain_is_rebuilt_from_its_arguments() -> None:
    """Celery's JSON result serializer rebuilds an exception from its ``args``."""
    sent = StoreUncertain("01890a5d-ac96-774b-bcce-b302099a8057", "job store error: refused")
    again = StoreUncertain(*sent.args)
    assert again.job_id == sent.job_id and str(again) == str(sent)


def test_store_uncertain_survives_pickling() -> None:
    import pickle

    from ojs_celery import StoreError
    from ojs_celery import StoreUncertain as Exported

    sent = Exported("01890a5d-ac96-774b-bcce-b302099a8057", "job store error: refused")
    error = pickle.loads(pickle.dumps(sent))
    assert isinstance(error, StoreError) and error.job_id == "01890a5d-ac96-774b-bcce-b302099a8057"
    assert str(error) == str(sent) and "(job store error: refused)" in str(error)


# ----------------------------------------------------------------- writes the server holds
# An insert whose reply is lost while the server holds the write (Redis paused for writes, as
# a failover pauses it; PostgreSQL waiting for a synchronous standby) is done after the reads
# that settle it found no record. Before, a second try lost too (or refused while the first
# still waited) made enqueue raise a definite StoreError, and the job was stored and ran.


@pytest.fixture(scope="module")
def standby_pg() -> Iterator[PrivatePostgres]:
    """A private PostgreSQL whose commits (of sessions with ``synchronous_commit`` on) wait
    for a standby that never comes, until the test cancels the wait (the commit stands)."""
    server = PrivatePostgres(NO_STANDBY)
    try:
        yield server
    finally:
        server.destroy()


@dataclasses.dataclass
class Holding:
    """A store server that holds writes, behind a proxy that cuts the client's side of a
    write's connection as soon as the write is forwarded (``CuttingProxy.early``)."""

    url: str
    proxy: CuttingProxy
    #: The request of a job's insert (the batch insert's: ``batch``), as the proxy matches it
    #: (PostgreSQL's ``COMMIT`` statement, not ``SET synchronous_commit`` of a new session).
    insert: bytes
    batch: bytes
    #: Settings of the app's store.
    settings: dict[str, object]
    hold: Callable[[], object]
    #: End the hold: the writes held are done now.
    release: Callable[[], object]
    #: Make a store prefix's tables (their commits must not wait).
    tables: Callable[[str], object] = lambda prefix: None

    def cut(self, match: bytes, every: bool) -> None:
        self.proxy.match, self.proxy.every, self.proxy.early = match, every, True
        self.hold()
        self.proxy.armed.set()

    def warm(self, store: JobStore) -> None:
        """Load the scripts, prepare the lane's statements: the cut then hits the write."""
        job = parse_envelope({"type": "e2e.add", "args": [0, 0]})
        making = threading.Thread(target=store.create, args=(job,), daemon=True)
        making.start()
        wait_for(lambda: not making.is_alive() or self.release(), 10, "the first insert")
        making.join(10)
        if isinstance(store, RedisStore):
            store.create_many([parse_envelope({"type": "e2e.add", "args": [0, 0]})])


@pytest.fixture(params=["redis", "postgres"])
def holding(request: pytest.FixtureRequest) -> Iterator[Holding]:
    if request.param == "redis":
        upstream: tuple[str, int] = request.getfixturevalue("private_redis")
        admin = redis.Redis(*upstream)
        proxy = CuttingProxy(upstream)
        held = Holding(f"redis://127.0.0.1:{proxy.port}/0", proxy, b"EVALSHA", b"EVALSHA", {},
                       lambda: admin.execute_command("CLIENT", "PAUSE", "30000", "WRITE"),
                       lambda: admin.execute_command("CLIENT", "UNPAUSE"))
    else:
        server: PrivatePostgres = request.getfixturevalue("standby_pg")
        admin = psycopg.connect(server.url, autocommit=True)

        def release() -> int:
            waiting = waiting_for_standby(admin)
            for pid in waiting:
                admin.execute("SELECT pg_cancel_backend(%s)", (pid,))
            return len(waiting)

        def tables(prefix: str) -> None:
            store = open_store(server.url, prefix=prefix)
            store.ping()
            store.close()

        proxy = CuttingProxy(("127.0.0.1", server.port))
        held = Holding(f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres", proxy,
                       b"INSERT", b"COMMIT\x00", {"store_synchronous_commit": "on"},
                       lambda: None, release, tables)
    try:
        yield held
    finally:
        proxy.armed.clear()
        held.release()
        proxy.close()
        admin.close()


@contextlib.contextmanager
def holding_app(
    holding: Holding, tmp_path: pathlib.Path,
) -> Iterator[tuple[Celery, JobStore, dict[str, Any]]]:
    """An app (filesystem broker) whose store is behind ``holding``'s proxy; its tables made
    beforehand by a store whose commits do not wait."""
    prefix = unique("h")
    holding.tables(prefix)
    config = filesystem_config(tmp_path)
    config["ojs"] = {"store_url": holding.url, "store_prefix": prefix, "events": False,
                     "store_timeout": 1.0, **holding.settings}
    app = make_app(config)
    store = get_runtime(app).store
    watchdog = threading.Timer(30, holding.release)  # a failing test does not wait for ever
    watchdog.start()
    try:
        holding.warm(store)
        yield app, store, config
    finally:
        watchdog.cancel()
        holding.proxy.armed.clear()
        holding.release()
        get_runtime(app).close()  # the private server goes with its module: no clearing
        app.close()


def test_an_enqueue_whose_every_try_lost_its_reply_is_uncertain(
    holding: Holding, tmp_path: pathlib.Path,
) -> None:
    """The insert and its second try both lose their replies while the server holds them;
    the reads between find no record. The caller is told the job may be stored, by id (before:
    a definite StoreError), and it is: enqueue again with that id returns it, and it runs
    once."""
    with holding_app(holding, tmp_path) as (app, store, config):
        holding.cut(holding.insert, every=True)
        with pytest.raises(StoreUncertain) as caught:
            enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
        assert caught.value.in_flight and "may or may not be stored" in str(caught.value)
        holding.proxy.armed.clear()
        assert len(holding.proxy.cut) >= 2  # the insert, and its second try
        job_id = caught.value.job_id
        wait_for(holding.release, 10, "the held writes")
        stored = wait_for(lambda: store.get_record(job_id), 10, "the held insert to land")
        assert stored.job.state == "available" and stored.job.args == [1, 2]
        again = enqueue({"id": job_id, "type": "e2e.add", "args": [1, 2]}, app=app)
        assert again.id == job_id
        assert store.get_record(job_id).origin == stored.origin  # type: ignore[union-attr]
        if isinstance(store, RedisStore):
            return  # one worker run for both (the suite's time): PostgreSQL's, below
        # its message went out while the insert was held (a generated id); a worker runs it
        ojs = {k: v for k, v in config["ojs"].items() if k != "store_synchronous_commit"}
        with running_worker({**config, "ojs": ojs}, tmp_path / "worker.log", pool="solo",
                            concurrency=1):
            done = wait_for(lambda: (j := store.get(job_id)) is not None and
                            j.state == "completed" and j, 30, "the job to run")
        assert done.attempt == 1 and done.result == 3  # it ran, once


def test_an_enqueue_batch_whose_tries_lost_their_replies_is_uncertain(
    holding: Holding, tmp_path: pathlib.Path,
) -> None:
    """A batch: on Redis both tries lose their replies; on PostgreSQL the first's commit is
    held and the second try is cancelled by ``statement_timeout`` while it waits for the first
    (an error reply, which before was taken as "nothing stored")."""
    with holding_app(holding, tmp_path) as (app, store, _):
        holding.cut(holding.batch, every=isinstance(store, RedisStore))
        ids = [parse_envelope({"type": "e2e.add", "args": []}).id for _ in range(3)]
        with pytest.raises(StoreUncertain) as caught:
            enqueue_batch([{"id": job_id, "type": "e2e.add", "args": [n, 1]}
                           for n, job_id in enumerate(ids)], app=app)
        assert (caught.value.job_id, caught.value.batch) == (ids[0], 3)
        assert caught.value.in_flight
        holding.proxy.armed.clear()
        wait_for(holding.release, 10, "the held writes")
        wait_for(lambda: store.get_record(ids[0]), 10, "the batch to land")
        records = store.get_records(ids)  # all of it
        assert [r.job.args for r in records if r is not None] == [[0, 1], [1, 1], [2, 1]]


@pytest.mark.parametrize("holding", ["postgres"], indirect=True)
def test_a_postgres_insert_refused_while_its_lost_first_try_waits_is_uncertain(
    holding: Holding, tmp_path: pathlib.Path,
) -> None:
    """The first try's reply is lost while its commit waits for the standby; the second try
    waits for it (the same id) until ``statement_timeout`` cancels it: that error reply says
    only that the second try was rolled back, not the first. Before: StoreRefused ("nothing
    of it is stored"), and the first committed."""
    with holding_app(holding, tmp_path) as (app, store, _):
        holding.cut(holding.insert, every=False)
        with pytest.raises(StoreUncertain) as caught:
            enqueue({"type": "e2e.add", "args": [3, 4]}, app=app)
        assert caught.value.in_flight
        assert isinstance(caught.value.__cause__, StoreRefused)  # the second try's answer
        wait_for(holding.release, 10, "the held commit")
        stored = wait_for(lambda: store.get_record(caught.value.job_id), 10, "the insert")
        assert stored.job.args == [3, 4]
