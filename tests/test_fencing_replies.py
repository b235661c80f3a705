"""A write whose reply was lost is not a lost race (issue 10, item 4).

A TCP proxy between the store client and the server forwards one write, waits for the server's
reply (so the write is done), drops the reply and cuts the connection. The store must then
recognise its own write by its nonce: the start or completion is applied, the insert returns.
Redis runs as a private ``redis-server`` started here; PostgreSQL is the shared server.
"""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from ojs_celery import enqueue_batch, lifecycle
from ojs_celery.envelope import parse_envelope
from ojs_celery.runtime import get_runtime
from ojs_celery.store import JobStore, StoreError, StoreUncertain, open_store
from ojs_celery.store.redis import RedisStore
from tests.conftest import messages
from tests.e2eapp import make_app
from tests.services import postgres_url
from tests.workers import filesystem_config, unique


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class CuttingProxy:
    """Forwards TCP both ways; when armed, the next client request is forwarded, its reply is
    swallowed and both sides are closed (once)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.armed = threading.Event()
        #: When set, only a request containing these bytes (upper-cased) is cut.
        self.match: bytes | None = None
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
                    self.armed.clear()
                    state["cutting"] = True
                    self.cut.append(data)
                elif not upstream and state["cutting"]:
                    self.cuts += 1  # the write is done: its reply is lost with the connection
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._closed = True
        self.listener.close()


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


@pytest.fixture(params=["redis", "postgres"])
def proxied_url(request: pytest.FixtureRequest) -> Iterator[tuple[str, CuttingProxy]]:
    """A store URL (a private Redis, or the shared PostgreSQL) reached through the proxy."""
    if request.param == "redis":
        upstream: tuple[str, int] = request.getfixturevalue("private_redis")
        proxy = CuttingProxy(upstream)
        url = f"redis://127.0.0.1:{proxy.port}/0"
    else:
        real = postgres_url()
        parts = urlsplit(real)
        proxy = CuttingProxy((parts.hostname or "127.0.0.1", parts.port or 5432))
        netloc = parts.netloc.rsplit("@", 1)
        host = f"127.0.0.1:{proxy.port}"
        url = real.replace(parts.netloc, f"{netloc[0]}@{host}" if len(netloc) == 2 else host)
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
