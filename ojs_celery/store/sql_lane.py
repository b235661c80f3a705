"""The SQL store's fast lanes for its hot writes (the insert, every compare-and-set): what
PostgreSQL's (:mod:`.pg_lane`) and SQLite's share, and SQLite's.

A write through SQLAlchemy spends more CPU in its layers (a pool checkout and return, the
compiled statement cache, parameter and result processing) than in the driver: on SQLite,
about twice the statement itself. A worker pays that twice per job (the start and the
outcome), a producer once. A lane keeps one driver connection per process aside (made by the
store's pool, so with the settings the pool applies on connect: on SQLite driver autocommit,
WAL, the busy timeout; then detached from it) and sends each hot write to the driver directly.

A lane never changes what a write does, only how it travels. A thread that finds the lane
taken takes the ordinary path. A forked child forgets its parent's connection (never using or
closing it) and makes its own.
"""

from __future__ import annotations

import select
import sqlite3
import threading
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.engine import URL

from ..forking import forget_in_children

__all__ = ["DetachedLane", "SqliteLane", "fits", "ready", "rolled_back", "unanswered"]


def ready(fd: int, *, write: bool = False, timeout: float | None = None) -> bool:
    """Whether the socket ``fd`` has something to read (with ``write``: room to write) within
    ``timeout`` seconds (None: wait until it has; 0: look only). A socket the server closed
    counts as readable. ``poll``, not ``select``: ``select`` refuses a descriptor numbered 1024
    or more, which a process with many files open (a busy web server) is given."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT if write else select.POLLIN)
    return bool(poller.poll(None if timeout is None else timeout * 1000))


def unanswered(exc: BaseException) -> bool:
    """The server gave no answer within libpq's ``connect_timeout`` (its message, "timeout
    expired", is libpq's in every psycopg version; SQLAlchemy's error keeps it as ``orig``):
    asking again at once would only wait as long again."""
    return "timeout expired" in str(getattr(exc, "orig", None) or exc)


def rolled_back(exc: BaseException) -> str | None:
    """The SQLSTATE of a PostgreSQL error reply of severity ERROR in ``exc`` (the driver's
    exception, SQLAlchemy's wrapping one as ``orig``, or a :class:`~.base.StoreError` raised
    from it), else None. An ERROR ends the statement's transaction with a rollback, whether it
    is one autocommit statement, a pipeline up to its sync or a ``BEGIN`` ... ``COMMIT``
    block (an ERROR to ``COMMIT`` itself included): the server commits after the statement's
    work and after its ``statement_timeout`` is disarmed, and a failure once the commit is
    written is a PANIC, not an ERROR. A cancel that arrives while a commit waits for a
    synchronous standby is a WARNING, the commit done. So the write was not done, for certain.
    A FATAL (a session terminated by an administrator) may come after a commit: not this;
    nor a connection error (class 08) sent as an ERROR, as a pooler sends one (PgBouncer
    before 1.21: ``server conn crashed?`` after passing a ``COMMIT`` on), nor any error after
    which SQLAlchemy found the session gone (``connection_invalidated``): the server may have
    committed before the session was lost, and such a write is settled by reading."""
    if getattr(exc, "connection_invalidated", False):
        return None
    for found in (exc, getattr(exc, "orig", None), exc.__cause__):
        sqlstate = getattr(found, "sqlstate", None) or getattr(found, "pgcode", None)
        severity = getattr(getattr(found, "diag", None), "severity_nonlocalized", None)
        if isinstance(sqlstate, str) and sqlstate and severity == "ERROR":
            return None if sqlstate.startswith("08") else sqlstate
    return None


class DetachedLane:
    """One driver connection of this process, kept aside from the store's pool and used by
    one thread at a time (see the module docstring)."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        """``connect``: a new DBAPI connection checked out of the store's pool (SQLAlchemy's
        ``engine.raw_connection()``)."""
        self._connect = connect
        self._lock = threading.Lock()
        self._raw: Any = None  # the driver's connection
        forget_in_children(self)

    def forget_parent(self) -> None:
        """In a forked child: the parent's connection is never used here, nor closed."""
        self._lock = threading.Lock()
        self._raw = None

    def _detached(self) -> Any:
        """A new driver connection from the pool, the lane's own from now on (the pool
        neither counts nor reuses it)."""
        pooled = self._connect()
        connection = pooled.driver_connection
        pooled.detach()
        return connection

    def close(self) -> None:
        """Close the connection (this process's only)."""
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        raw, self._raw = self._raw, None
        if raw is not None:
            try:
                raw.close()
            except Exception:  # a broken connection: nothing left to release
                pass


def fits(url: URL) -> bool:
    """Whether a SQLite URL is a file that any number of connections share, on ``sqlite3``,
    which SQLAlchemy lets any thread use: not an in-memory database (each connection would
    have its own, or the pool's only one would be taken), not another driver (whose errors
    are not ``sqlite3``'s), not a URL that asks for ``check_same_thread``."""
    database = url.database or ""
    query = url.query
    return (url.drivername in ("sqlite", "sqlite+pysqlite")
            and database not in ("", ":memory:") and not database.startswith("file::memory:")
            and query.get("mode") != "memory" and "check_same_thread" not in query)


class SqliteLane(DetachedLane):
    """The SQLite store's hot writes on a ``sqlite3`` connection of this process.

    SQLite has no round trip to overlap: :meth:`send` runs the statement at once and returns
    its answer, so that the store calls both lanes alike. An error of the database (locked past
    the busy timeout, disk full, read-only) is raised as ``sqlite3`` raises it, for the store's
    own wrapper to turn into :class:`~.base.StoreError`; the connection is then made again.
    Only for a file on the standard driver (:func:`fits`), where every connection of the pool
    sees the same database and may be used from any thread."""

    def __init__(self, connect: Callable[[], Any], statements: dict[str, str],
                 identity: Callable[[], Any] | None = None) -> None:
        """``statements``: each statement's name and text, with ``?`` parameters;
        ``identity``: the database file's identity now (its device and inode), which must
        still be the one the connection opened (a deleted file is not written to: the
        connection is made again, through the store, which opens the path anew)."""
        super().__init__(connect)
        self._statements = statements
        self._identity = identity
        self._opened: Any = None

    def send(self, name: str, values: Sequence[Any]) -> Callable[[], int] | None:
        """Run statement ``name`` with ``values``; return the function that gives the number
        of rows it wrote. None: the lane is taken, take the ordinary path."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            rows = int(self._run(lambda c: c.execute(self._statements[name], values).rowcount))
        finally:
            self._lock.release()
        return lambda: rows

    def send_many(self, name: str, rows: Sequence[Sequence[Any]]) -> Callable[[], list[int]] | None:
        """Run statement ``name`` once per row of values in one transaction (all or none);
        return the function that gives each one's row count. None: take the ordinary path."""
        if not rows or not self._lock.acquire(blocking=False):
            return None
        statement = self._statements[name]

        def run(connection: sqlite3.Connection) -> list[int]:
            connection.execute("BEGIN IMMEDIATE")  # the write lock up front, as the store does
            counts = [connection.execute(statement, values).rowcount for values in rows]
            connection.execute("COMMIT")
            return counts

        try:
            counts = self._run(run)
        finally:
            self._lock.release()
        return lambda: counts

    def _run(self, work: Callable[[sqlite3.Connection], Any]) -> Any:
        """``work`` on the lane's connection (made on first use). Anything raised on the way
        (an error of the database, or an exception such as a time limit between two
        statements) drops the connection, and with it any transaction left open: the next
        write never runs inside a transaction that is not its own."""
        if (self._raw is None or self._raw.in_transaction
                or (self._identity is not None and self._identity() != self._opened)):
            self._drop()
            self._raw = self._detached()  # it may create the file: its identity comes after
            self._opened = self._identity() if self._identity is not None else None
        try:
            return work(self._raw)
        except BaseException:
            self._drop()
            raise
