"""Real server faults reach callers as StoreError, and the same store works once they heal.

Redis faults are made on a private ``redis-server`` that each test starts on a free port (the
shared one is never touched): memory full under ``noeviction`` (``OOM``), a replica of a master
that is not there (``READONLY``), an ACL user that lacks a command (``NOPERM``), a snapshot
that cannot be written (``MISCONF``). PostgreSQL
faults are made on the store's own sessions: read-only sessions (as on a standby), and a
session the server terminates.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
import sqlalchemy as sa

from ojs_celery import enqueue, lifecycle
from ojs_celery.conf import read_settings
from ojs_celery.envelope import Job
from ojs_celery.lifecycle import Policy
from ojs_celery.runtime import get_runtime
from ojs_celery.store import (
    JobStore,
    StoreError,
    StoreRefused,
    StoreTimeout,
    StoreUncertain,
    WorkerInfo,
    open_store,
)
from ojs_celery.store.sql import SQLStore
from tests.e2eapp import make_app
from tests.services import postgres_url
from tests.workers import filesystem_config, wait_for

Op = Callable[[JobStore], Any]


def new_job() -> Job:
    return Job.model_validate({"type": "fault.job", "args": [1]})


# ------------------------------------------------------------------------- a private Redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateRedis:
    """A ``redis-server`` of this test's own, stopped at the end: without persistence, or
    ``durable``, writing every command to its append-only file, so that it can be stopped (its
    clients' connections refused: a store outage) and started again on the same port with all
    its data (:meth:`start`). ``password``: the server asks for it (``--requirepass``); ``url``
    and ``admin`` give it."""

    def __init__(self, directory: Path, durable: bool = False,
                 password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed")
        self.binary = binary
        self.directory = directory
        self.durable = durable
        self.password = password
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        given = f":{password}@" if password is not None else ""
        self.url = f"redis://{given}{self.address}/0"
        self.admin = redis.Redis(port=self.port, password=password, decode_responses=True)
        self.start()

    def start(self) -> None:
        persistence = (["--appendonly", "yes", "--appendfsync", "always"] if self.durable
                       else ["--appendonly", "no"])
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             *persistence, "--dir", str(self.directory),
             *(["--requirepass", self.password] if self.password is not None else []),
             "--enable-protected-configs", "local"],  # CONFIG SET dir (the MISCONF test)
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

        def up() -> bool:
            try:
                return bool(self.admin.ping())
            except redis.ConnectionError:
                return False

        wait_for(up, 10, f"redis-server on port {self.port}")

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """Stop the server, by force if it refuses (a server that cannot write its snapshot
        refuses to shut down on SIGTERM)."""
        self.admin.close()
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def private_redis(redis_server: PrivateRedis) -> PrivateRedis:
    """This module's name for the test's own ``redis-server`` (conftest's ``redis_server``)."""
    return redis_server


class Ops:
    """Store operations, each on state prepared before the fault (so each can be tried under
    the fault, then once more after it healed, with the same effect)."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.jobs = [new_job() for _ in range(2)]
        for job in self.jobs:
            store.create(job)
        #: The first job's record as its message carries it: a start with it writes at once
        #: (the lane's compare-and-set), without a read before.
        self.first_record = store.get_record(self.jobs[0].id)
        store.meta.send_directive("w-take", "quiet")

    def writes(self) -> dict[str, Op]:
        first, second = (job.id for job in self.jobs)
        worker = WorkerInfo(worker_id="w-save", hostname="h", pid=1, last_beat=time.time())
        return {
            "create": lambda s: s.create(new_job()),
            "create_many (batch)": lambda s: s.create_many([new_job(), new_job()]),
            "start (fast lane)": lambda s: s.start(first, 1, "w1", hint=self.first_record),
            "apply_many (batch)": lambda s: s.apply_many(
                [second], lambda r: lifecycle.cancel(r, time.time())),
            "ack_dispatch_many (batch)": lambda s: s.ack_dispatch_many([(second, 1)]),
            "workers.save": lambda s: s.workers.save(worker),
            "meta.send_directive": lambda s: s.meta.send_directive("w-send", "quiet"),
        }


def each_fails_then_works(store: JobStore, ops: dict[str, Op], heal: Callable[[], object],
                          message: str, within: float | None = None) -> None:
    """Each of ``ops`` fails with a StoreError saying ``message`` (in at most ``within``
    seconds), then works once ``heal()`` returned. The store's error reply is definite: an
    insert so refused is never StoreUncertain."""
    for name, op in ops.items():
        started = time.monotonic()
        with pytest.raises(StoreError) as info:
            op(store)
        took = time.monotonic() - started
        assert within is None or took < within, (name, took)
        assert message in str(info.value), (name, str(info.value))
        assert not isinstance(info.value, StoreUncertain), (name, str(info.value))
        assert info.value.__cause__ is not None, name
    heal()
    for name, op in ops.items():
        try:
            op(store)
        except StoreError as exc:  # pragma: no cover - the assertion names the operation
            raise AssertionError(f"{name} still fails after the fault healed: {exc}") from exc


@pytest.fixture
def redis_store(private_redis: PrivateRedis) -> Iterator[JobStore]:
    store = open_store(private_redis.url, policy=Policy(), prefix="faults")
    yield store
    store.close()


def test_redis_out_of_memory(private_redis: PrivateRedis, redis_store: JobStore) -> None:
    ops = Ops(redis_store)
    admin = private_redis.admin
    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", used + 1_000_000)
    chunk = "x" * 100_000
    with pytest.raises(redis.exceptions.OutOfMemoryError):  # fill it: writes now get OOM
        for index in range(100):
            admin.set(f"filler:{index}", chunk)
    # A refused command's own buffer is freed after the check: pin the limit below what is
    # used, so that no small write slips through that slack.
    admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) - 100_000)
    assert redis_store.get(ops.jobs[0].id) is not None  # reads still work

    def heal() -> None:
        admin.delete(*admin.keys("filler:*"))
        admin.config_set("maxmemory", 0)

    each_fails_then_works(redis_store, ops.writes(), heal, "maxmemory")


def test_redis_snapshot_failing(private_redis: PrivateRedis, redis_store: JobStore,
                                 tmp_path: Path) -> None:
    """``MISCONF``: Redis refuses writes while its last snapshot failed (with saving on and
    ``stop-writes-on-bgsave-error``, the defaults of a persistent Redis)."""
    ops = Ops(redis_store)
    admin = private_redis.admin
    gone = tmp_path / "gone"
    gone.mkdir()
    admin.config_set("save", "3600 1")
    admin.config_set("dir", str(gone))
    gone.rmdir()  # the snapshot cannot be written there any more

    def failed() -> bool:
        if admin.info("persistence")["rdb_bgsave_in_progress"]:
            return False
        if admin.info("persistence")["rdb_last_bgsave_status"] == "err":
            return True
        admin.bgsave()
        return False

    wait_for(failed, 10, "a snapshot to fail")

    def heal() -> None:
        back = tmp_path / "back"
        back.mkdir()
        admin.config_set("dir", str(back))
        admin.bgsave()
        wait_for(lambda: admin.info("persistence")["rdb_last_bgsave_status"] == "ok", 10,
                 "a snapshot to succeed")

    each_fails_then_works(redis_store, ops.writes(), heal, "MISCONF")


def test_redis_read_only_replica(private_redis: PrivateRedis, redis_store: JobStore) -> None:
    ops = Ops(redis_store)
    admin = private_redis.admin
    admin.replicaof("127.0.0.1", free_port())  # a master that is not there
    writes = {
        **ops.writes(),
        "workers.remove": lambda s: s.workers.remove("w-save"),
        "meta.take_directive": lambda s: s.meta.take_directive("w-take"),
    }
    each_fails_then_works(redis_store, writes,
                          lambda: admin.replicaof("NO", "ONE"),
                          "read only replica")


def test_redis_server_that_stops_answering(private_redis: PrivateRedis) -> None:
    """A Redis that stops answering (frozen by SIGSTOP: its kernel keeps the connections open,
    as with a hung server) fails each call after one ``store_timeout``, not after the kernel's
    quarter of an hour, and nothing is sent again into the silence. An insert is settled by one
    read, which times out too: StoreUncertain; so is a batch, which the server may still run
    (all of it). Once the server answers, the same store works."""
    timeout = 2.0
    store = open_store(private_redis.url, policy=Policy(), prefix="frozen", timeout=timeout)
    pid = private_redis.process.pid
    try:
        ops = Ops(store)
        batch = [new_job(), new_job()]
        operations = {
            **ops.writes(),
            "create_many (batch)": lambda s: s.create_many(batch),
            "get (a read)": lambda s: s.get(ops.jobs[0].id),
        }
        waits = {"create": 2}  # the insert, then its settling read; one for every other call
        os.kill(pid, signal.SIGSTOP)
        try:
            for name, op in operations.items():
                started = time.monotonic()
                with pytest.raises(StoreError, match="Timeout") as info:
                    op(store)
                took = time.monotonic() - started
                assert took < (waits.get(name, 1) + 0.75) * timeout, (name, took)
                uncertain = name.startswith("create")
                assert isinstance(info.value, StoreUncertain) == uncertain, (name, info.value)
        finally:
            os.kill(pid, signal.SIGCONT)
        stored = {store.get(job.id) is not None for job in batch}
        assert len(stored) == 1  # all of the batch or none (none if it was never sent)
        for name, op in operations.items():
            if name != "create_many (batch)":  # its ids are taken now
                op(store)
    finally:
        store.close()


@pytest.mark.parametrize(
    ("command", "ops"),
    [
        ("evalsha", ("create", "create_many (batch)", "start (fast lane)", "apply_many (batch)",
                     "ack_dispatch_many (batch)", "workers.all (script)",
                     "meta.take_directive (script)")),
        ("hset", ("workers.save", "meta.send_directive")),
    ],
)
def test_redis_acl_user_without_a_command(
    private_redis: PrivateRedis, command: str, ops: tuple[str, ...]
) -> None:
    admin = private_redis.admin
    user, password = "ojs-limited", uuid.uuid4().hex
    admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"],
                      channels=["*"], commands=["+@all", f"-{command}"])
    url = f"redis://{user}:{password}@127.0.0.1:{private_redis.port}/0"
    store = open_store(url, policy=Policy(), prefix="acl")
    try:
        prepared = Ops(open_store(private_redis.url, policy=Policy(), prefix="acl"))
        every = {
            **prepared.writes(),
            "workers.all (script)": lambda s: s.workers.all(),
            "meta.take_directive (script)": lambda s: s.meta.take_directive("w-take"),
        }
        chosen = {name: every[name] for name in ops}
        each_fails_then_works(
            store, chosen,
            lambda: admin.acl_setuser(user, enabled=True, commands=[f"+{command}"]),
            "no permissions")
    finally:
        prepared.store.close()
        store.close()


# ------------------------------------------------------------------------- PostgreSQL


@pytest.fixture
def pg_prefix() -> Iterator[str]:
    """A prefix whose tables exist (created by a read-write store) and are dropped after."""
    prefix = f"f{uuid.uuid4().hex[:10]}"
    owner = open_store(postgres_url(), policy=Policy(), prefix=prefix)
    owner.ping()
    yield prefix
    try:
        owner.clear()
        assert isinstance(owner, SQLStore)
        owner.drop_tables()
    finally:
        owner.close()


def _read_only_url() -> str:
    url = sa.make_url(postgres_url())
    url = url.update_query_dict({"options": "-c default_transaction_read_only=on"})
    return url.render_as_string(hide_password=False)


def _writable(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.execute("SET default_transaction_read_only = off")


def test_postgres_read_only_sessions(pg_prefix: str) -> None:
    """As on a standby: every write is refused with StoreError (not a raw driver error), the
    session stays usable (reads work between the refused writes), and once the session may
    write again the same store writes."""
    writer = open_store(postgres_url(), policy=Policy(), prefix=pg_prefix)
    ops = Ops(writer)
    store = open_store(_read_only_url(), policy=Policy(), prefix=pg_prefix)
    assert isinstance(store, SQLStore)
    try:
        for name, op in ops.writes().items():
            with pytest.raises(StoreError) as info:
                op(store)
            assert "read-only transaction" in str(info.value), name
            # the driver's error as its cause: SQLAlchemy's, or from the fast lane psycopg's
            # own (made from libpq's reply); a job's write refused for certain, not settled
            cause = info.value.__cause__
            assert isinstance(cause, (sa.exc.DBAPIError, psycopg.Error)), name
            if name.startswith(("create", "start", "apply_many")):
                assert isinstance(info.value, StoreRefused), name
            assert store.get(ops.jobs[0].id) is not None, name  # the session was rolled back
        # The standby is promoted, as it were: every session from now on may write (the
        # store's sessions are reopened: the pool's and the insert lane's).
        store.close()
        sa.event.listen(store.engine, "connect", _writable)
        with store.engine.connect() as conn:  # made before the listener, by the table check
            conn.exec_driver_sql("SET default_transaction_read_only = off")
        for name, op in ops.writes().items():
            try:
                op(store)
            except StoreError as exc:  # pragma: no cover - names the operation
                raise AssertionError(f"{name} still fails: {exc}") from exc
    finally:
        store.close()
        writer.close()


def test_postgres_session_terminated(pg_prefix: str) -> None:
    """A session the server ends (a restart, a failover, an idle killer): the next operation
    raises StoreError, and the one after works on a new connection. Tried for each kind of
    operation, single statements and transactions alike."""
    app_name = f"ojs_test_{pg_prefix}"  # names this store's sessions, and only them
    url = sa.make_url(postgres_url()).update_query_dict({"application_name": app_name})
    store = open_store(url.render_as_string(hide_password=False), policy=Policy(),
                       prefix=pg_prefix)
    assert isinstance(store, SQLStore)
    admin = sa.create_engine(sa.make_url(postgres_url()).set(drivername="postgresql+psycopg"),
                             isolation_level="AUTOCOMMIT")

    def terminate_session() -> None:
        """End every session of the store: the pooled ones and the insert lane's."""
        with admin.connect() as conn:
            query = sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                            "WHERE application_name = :a")
            conn.execute(query, {"a": app_name})

            def gone() -> bool:
                query = sa.text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :a")
                return conn.execute(query, {"a": app_name}).scalar() == 0

            wait_for(gone, 10, "the sessions to end")

    try:
        ops = Ops(store)
        store.create(new_job())  # the insert lane (PostgreSQL) holds a session to end too
        for name, op in ops.writes().items():
            terminate_session()
            # A write on a session that was ended fails with StoreError (never the driver's
            # own error), or works at once: an insert whose connection died is sent again
            # (fencing), the lane opens a new session when it finds its idle one ended, and
            # the pool may hold no session from before. Either way it works on a new one.
            try:
                op(store)
            except StoreError:
                try:
                    op(store)
                except StoreError as exc:  # pragma: no cover - names the operation
                    raise AssertionError(f"{name} fails on a new connection: {exc}") from exc
        for _ in range(3):  # every session ended: the next insert works on new ones
            terminate_session()
            job = new_job()
            store.create(job)
            assert store.get(job.id) is not None
    finally:
        admin.dispose()
        store.close()


def test_postgres_synchronous_commit_is_applied_to_every_session(pg_prefix: str) -> None:
    """``ojs.store_synchronous_commit`` reaches the store's pooled sessions and the insert
    lane's; jobs are stored as usual."""
    settings = read_settings({"store_url": postgres_url(), "store_prefix": pg_prefix,
                              "store_synchronous_commit": "off"})
    store = open_store(settings.store_url, policy=settings.policy, prefix=pg_prefix,
                       synchronous_commit=settings.store_synchronous_commit)
    assert isinstance(store, SQLStore)
    try:
        job = new_job()
        store.create(job)  # through the insert lane
        assert store.get(job.id) is not None
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "off"
        assert store._lane is not None and store._lane._raw is not None
        lane = store._lane._raw.execute("SHOW synchronous_commit").fetchone()
        assert lane == ("off",)
    finally:
        store.close()


def test_postgres_batch_write_is_all_or_nothing(pg_prefix: str) -> None:
    """A batch of compare-and-sets (a sweep's ``apply_many``) goes to PostgreSQL in one
    pipeline that commits as one transaction: when the server refuses one of its statements
    (here a token out of the column's range, in the batch's last statement, after two that
    succeeded) the caller gets StoreError and none of the batch is written; the next batch,
    and a single write, work on the same store."""
    store = open_store(postgres_url(), policy=Policy(), prefix=pg_prefix)
    assert isinstance(store, SQLStore)
    try:
        jobs = [new_job() for _ in range(3)]
        for job in jobs:
            store.create(job)
        ids = [job.id for job in jobs]
        lane = store._lane
        assert lane is not None
        pipelines: list[int] = []  # batches the lane took (its sender answered)
        send_many = lane.send_many

        def counted(name: str, rows: Any) -> Any:
            answer = send_many(name, rows)
            if answer is not None:
                pipelines.append(len(rows))
            return answer

        lane.send_many = counted  # type: ignore[method-assign]

        def next_token(too_big: str | None) -> Callable[[lifecycle.Record], lifecycle.Transition]:
            def rule(record: lifecycle.Record) -> lifecycle.Transition:
                new = record.copy()
                new.token = 2**40 if record.job.id == too_big else record.token + 1
                return lifecycle.Transition(new)
            return rule

        with pytest.raises(StoreError, match="out of range"):
            store.apply_many(ids, next_token(too_big=max(ids)))  # written last
        records = store.get_records(ids)
        assert [(r.token, r.version) for r in records if r is not None] == [(1, 1)] * 3

        done = store.apply_many(ids, next_token(too_big=None))
        assert all(t is not None and t.applied for t in done)
        assert [r.token for r in store.get_records(ids) if r is not None] == [2, 2, 2]
        assert pipelines == [3, 3]  # both batches went through the lane, whole
        assert store.start(ids[0], 2, "w1").applied  # a single write after the batches
    finally:
        store.close()


def test_postgres_lane_text_params_are_text_param_of_each() -> None:
    """The lane's fast encoding by type gives what the general one gives, for every type a
    record's columns hold and for subclasses of them."""
    from ojs_celery.store.pg_lane import text_param, text_params

    class Name(str):
        pass

    values = ["job", Name("w1"), 0, 7, 2**70, 1.5, -0.0, float("inf"), True, False, None]
    assert text_params(values) == [text_param(value) for value in values]
    assert text_params(values)[:3] == [b"job", b"w1", b"0"]


@pytest.mark.parametrize("url", ["postgresql://postgres@127.0.0.1:{port}/test",
                                 "redis://127.0.0.1:{port}/0"])
def test_a_store_that_is_down_says_so_in_one_line(url: str) -> None:
    """A store nobody listens on: ``StoreError`` with the driver's message, on one line (a log
    line or a CLI's error line; psycopg's own message takes two)."""
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        with pytest.raises(StoreError) as info:
            open_store(url.format(port=port), policy=Policy(), prefix="down").get(
                "01890a5d-ac96-774b-bcce-b302099a8057")
    said = str(info.value)
    assert "\n" not in said and said.startswith("job store error: ")
    assert "refused" in said.lower()


# ------------------------------------------------------------------ a server that never answers


@pytest.mark.parametrize("scheme", ["redis", "unix", "postgresql"])
def test_a_store_that_never_answers_fails_within_its_timeout(
    silent_port: int, tmp_path: Path, scheme: str
) -> None:
    """A server that accepts connections and never answers: an insert waits for it twice
    (the insert, then its settling read; on PostgreSQL each is libpq's connect, at least 2 s),
    then raises StoreUncertain."""
    listener = None
    if scheme == "unix":  # a Redis on a unix socket: the same timeouts
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(tmp_path / "silent.sock"))
        listener.listen(16)
    url = {"redis": f"redis://127.0.0.1:{silent_port}/0",
           "unix": f"unix://{tmp_path / 'silent.sock'}",
           "postgresql": f"postgresql://ojs@127.0.0.1:{silent_port}/ojs"}[scheme]
    timeout = 2.0
    store = open_store(url, policy=Policy(), prefix="silent", timeout=timeout)
    try:
        started = time.monotonic()
        with pytest.raises(StoreUncertain):
            store.create(new_job())
        assert time.monotonic() - started < 2.75 * timeout
    finally:
        store.close()
        if listener is not None:
            listener.close()


def _libpq_settings(store: SQLStore) -> dict[str, str]:
    with store.engine.connect() as conn:
        settings: dict[str, str] = conn.connection.dbapi_connection.info.get_parameters()
        return settings


def test_postgres_connections_carry_libpq_limits_from_store_timeout(pg_prefix: str) -> None:
    """libpq's own limits, set from ``store_timeout`` on every connection of the store (the
    pool's and so the insert lane's); those the URL names are kept."""
    store = open_store(postgres_url(), policy=Policy(), prefix=pg_prefix, timeout=12)
    url = sa.make_url(postgres_url()).update_query_dict({"keepalives_idle": "30"})
    named = open_store(url.render_as_string(hide_password=False), policy=Policy(),
                       prefix=pg_prefix, timeout=12)
    try:
        assert isinstance(store, SQLStore) and isinstance(named, SQLStore)
        settings = _libpq_settings(store)
        assert {name: settings.get(name) for name in (
            "connect_timeout", "keepalives", "keepalives_idle", "keepalives_interval",
            "keepalives_count", "tcp_user_timeout")} == {
            "connect_timeout": "12", "keepalives": "1", "keepalives_idle": "6",
            "keepalives_interval": "2", "keepalives_count": "3", "tcp_user_timeout": "12000"}
        assert _libpq_settings(named)["keepalives_idle"] == "30"
    finally:
        store.close()
        named.close()


def test_postgres_a_call_that_waits_on_a_lock_fails_within_the_store_timeout(
    pg_prefix: str,
) -> None:
    """Another session holds a lock on the jobs table (a migration's ``ALTER TABLE``, a
    ``LOCK TABLE`` left open in psql): the server answers nothing while a statement waits for
    it, so libpq's limits never fire. Every store call (a read, the insert and the
    compare-and-set of the lane) fails with StoreError within a few ``store_timeout`` instead
    of waiting as long as the lock is held (before: for ever), and works once it is released.
    A ``statement_timeout`` the URL (or the role, the database) sets is kept, 0 (none) too."""
    import psycopg

    timeout = 1.0
    store = open_store(postgres_url(), policy=Policy(), prefix=pg_prefix, timeout=timeout)
    url = sa.make_url(postgres_url()).update_query_dict({"options": "-c statement_timeout=0"})
    own = open_store(url.render_as_string(hide_password=False), policy=Policy(),
                     prefix=pg_prefix, timeout=timeout)
    assert isinstance(store, SQLStore) and isinstance(own, SQLStore)
    locker = psycopg.connect(postgres_url(), autocommit=True)
    lock = threading.Lock()

    def release() -> None:  # the lock's end, if a store call waits for it (before the fix)
        with lock:
            if not locker.closed:
                locker.close()

    ender = threading.Timer(25, release)
    try:
        job = new_job()
        store.create(job)  # the pool's and the lane's sessions exist before the lock
        record = store.get_record(job.id)
        with own.engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW statement_timeout").scalar() == "0"
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW statement_timeout").scalar() == "1s"
        locker.execute("BEGIN")
        locker.execute(f'LOCK TABLE "{pg_prefix}_jobs" IN ACCESS EXCLUSIVE MODE')
        ender.start()
        calls: dict[str, Callable[[], object]] = {
            "get": lambda: store.get(job.id),
            "create": lambda: store.create(new_job()),
            "start (fast lane)": lambda: store.start(job.id, 1, "w1", hint=record),
        }
        for name, call in calls.items():
            started = time.monotonic()
            with pytest.raises(StoreError) as info:
                call()
            took = time.monotonic() - started
            assert took < 3 * timeout + 3, (name, took)
            assert "statement timeout" in str(info.value), (name, str(info.value))
            assert "\n" not in str(info.value), name
        release()
        assert store.start(job.id, 1, "w1").applied
    finally:
        ender.cancel()
        release()
        store.close()
        own.close()


def test_an_enqueue_the_store_refuses_leaves_no_outbox_entry_to_clear(
    pg_prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``enqueue`` of a job with a generated id publishes while its insert is in flight. When
    the store refuses the insert (read-only sessions, as on a standby), enqueue raises and
    nothing is stored, so there is no outbox entry: none is cleared, and nothing says that one
    could not be (PostgreSQL refuses even an update of no rows there)."""
    config = filesystem_config(tmp_path)
    config["ojs"] = {**config["ojs"], "store_url": _read_only_url(), "store_prefix": pg_prefix,
                     "events": False}
    app = make_app(config)
    runtime = get_runtime(app)
    try:
        with caplog.at_level(logging.WARNING, logger="ojs_celery"):
            with pytest.raises(StoreError, match="read-only transaction"):
                enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
            assert runtime.acks.flush()
        assert runtime.store.due("dispatch", time.time() + 3600, 10) == []  # no entry
        assert not [r for r in caplog.records if "outbox" in r.getMessage()], caplog.text
    finally:
        runtime.close()
        app.close()


@contextlib.contextmanager
def unanswered_then_landed(
    private_redis: PrivateRedis, write: Callable[[JobStore, Job, Any], object],
    landed: Callable[[Job], bool],
) -> Iterator[tuple[JobStore, Job, Any]]:
    """A started job; then ``write`` (the worker's outcome operation) sent into the frozen
    server times out, and the thawed server runs it (``landed``). Yields the store, the job
    and its start's record."""
    store = open_store(private_redis.url, policy=Policy(), prefix="unsettled", timeout=1.0)
    pid = private_redis.process.pid
    try:
        job = new_job()
        store.create(job)
        started = store.start(job.id, 1, "w1").record
        assert started is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            with store.remembering("outcome"), pytest.raises(StoreError, match="Timeout"):
                write(store, job, started)
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: (j := store.get(job.id)) is not None and landed(j), 10,
                 "the thawed server to run the write")
        yield store, job, started
    finally:
        store.close()


def test_an_outcome_whose_reply_never_came_is_recognised_when_retried(
    private_redis: PrivateRedis,
) -> None:
    """A completion sent into a frozen Redis times out (StoreTimeout), and the server runs it
    once it thaws. The worker's retry of that outcome then finds the job completed by its own
    write (the nonce it remembered) and gets the completion, not a rejection as a stale
    outcome that would keep the result from Celery's backend and callbacks."""
    with unanswered_then_landed(
        private_redis, lambda s, job, rec: s.complete(job.id, 1, "w1", "the result", hint=rec),
        lambda j: j.state == "completed",
    ) as (store, job, started):
        with store.remembering("outcome"):
            again = store.complete(job.id, 1, "w1", "the result", hint=started)
        assert again.record is not None and again.record.job.result == "the result", again
        # another job's, or a later, completion is still fenced as before
        assert store.complete(job.id, 1, "w1", "the result").record is None


def test_a_remembered_write_answers_only_the_refusal_it_caused(
    private_redis: PrivateRedis,
) -> None:
    """A progress write that timed out and then landed is remembered; the completion that
    follows is not refused by it (the job is still active), so it is written as usual, not
    answered with the progress write's transition."""
    with unanswered_then_landed(
        private_redis, lambda s, job, rec: s.heartbeat(job.id, 1, "w1", progress=0.5, hint=rec),
        lambda j: j.progress is not None,
    ) as (store, job, started):
        with store.remembering("outcome"):
            done = store.complete(job.id, 1, "w1", "the result", hint=started)
        assert done.record is not None and done.record.job.state == "completed", done
        stored = store.get(job.id)
        assert stored is not None and (stored.state, stored.result) == ("completed", "the result")


def unanswered_once(store: JobStore) -> None:
    """The store's next compare-and-set is done and its reply then lost to a timeout."""
    cas = store._cas  # type: ignore[attr-defined]

    def once(*args: Any) -> bool:
        store._cas = cas  # type: ignore[attr-defined]
        cas(*args)
        raise StoreTimeout("job store error: TimeoutError: the test's lost reply")

    store._cas = once  # type: ignore[attr-defined]


def test_an_unanswered_write_is_known_only_to_its_own_operation_and_process(
    tmp_path: Path,
) -> None:
    """Remembered writes answer only the same operation's retries (``remembering``), in the
    same process: a cancel that landed unanswered is no answer to another caller's refusal,
    and a forked child (a pool process) does not inherit what its parent sent."""
    store = open_store(f"sqlite:///{tmp_path / 's.sqlite3'}", policy=Policy(), prefix="mem")
    job = new_job()
    store.create(job)
    started = store.start(job.id, 1, "w1")
    assert started.record is not None
    unanswered_once(store)
    with store.remembering("cancel"), pytest.raises(StoreTimeout):
        store.cancel(job.id)
    assert store.get(job.id).state == "cancelled"  # type: ignore[union-attr]  # it landed
    # another operation, or none, gets the refusal
    assert store.fail_token(job.id, 1, "w1", lifecycle.make_error("x", "y")).record is None
    with store.remembering("outcome"):
        assert store.cancel(job.id).record is None
    # a forked child, with the same operation: not its write
    child = os.fork()
    if child == 0:
        with store.remembering("cancel"):
            os._exit(0 if store.cancel(job.id).record is None else 1)
    assert os.waitpid(child, 0)[1] == 0
    with store.remembering("cancel"):  # the same operation here: its own, once
        assert store.cancel(job.id).record is not None
        assert store.cancel(job.id).record is None
    store.close()
