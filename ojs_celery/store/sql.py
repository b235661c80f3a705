"""The job store on SQL: SQLite (the zero-setup default) and PostgreSQL, via SQLAlchemy Core.

Every primitive is ONE statement on a connection in driver autocommit mode. A single
``UPDATE ... WHERE id = :id AND version = :expected`` is atomic by itself, so wrapping it in
``BEGIN``/``COMMIT`` would only add round trips (PostgreSQL) and, on SQLite, nothing: a lone
write statement takes the write lock when it starts (waiting on the busy timeout), exactly like
``BEGIN IMMEDIATE``, so there is no read-then-upgrade step that could fail with ``SQLITE_BUSY``.

Each clock of :data:`ojs_celery.lifecycle.CLOCKS` has its own nullable deadline column with a
partial index (``WHERE col IS NOT NULL``), so :meth:`SQLStore.due` is an index range scan:
O(log n + k), and jobs without that deadline cost nothing in the index.

The batch primitives are the exception: one ``SELECT ... WHERE id IN (...)`` for many records,
and many compare-and-set statements on one connection in one transaction (rows in id order, so
two batches never deadlock), which commits once instead of once per statement. A batch of new
jobs is inserted in one transaction too, and a duplicate id rolls all of it back.

The hot writes (the insert, every compare-and-set) skip SQLAlchemy's layers through a lane of
the driver's own (:mod:`.sql_lane` on a SQLite file, :mod:`.pg_lane` on PostgreSQL): the same
statements, on one connection kept aside per process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import sqlite3
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.pool import StaticPool

from ..lifecycle import CLOCKS, Policy, Record
from .base import (
    DEFAULT_TIMEOUT,
    RECORD_FIELDS,
    JobStore,
    NewRow,
    StoreError,
    StoreMisconfigured,
    StoreRefused,
    Write,
    decode_job,
    encode_job,
    mask_secrets,
    store_errors,
    store_message,
)
from .meta import MetaArea
from .sql_lane import SqliteLane, ready, rolled_back, unanswered
from .sql_lane import fits as sqlite_lane_fits
from .workers import BURIED, WorkerInfo, WorkerRegistry

if TYPE_CHECKING:
    from .pg_lane import PgLane

__all__ = ["SQLMetaArea", "SQLStore", "SQLWorkerRegistry", "normalise_url"]

logger = logging.getLogger(__name__)

#: The values of PostgreSQL's ``synchronous_commit`` (the setting ``store_synchronous_commit``).
_SYNCHRONOUS_COMMIT = ("on", "off", "local", "remote_write", "remote_apply")

#: SQLite waits this long for another process's write lock before giving up.
SQLITE_BUSY_TIMEOUT_MS = 30_000


def _is_fault(exc: Exception) -> bool:
    """Every error of the database, its driver or SQLAlchemy: a lost connection, and every
    refusal (a read-only transaction on a standby, a lock timeout, a disk full...)."""
    return isinstance(exc, (sa_exc.SQLAlchemyError, sqlite3.Error, OSError))


def _answered(exc: Exception) -> bool:
    """SQLite's errors are its answers: it runs in this process, so a statement that raised is
    over (rolled back), nothing of it left to be done later. PostgreSQL's error replies leave
    as :class:`StoreRefused` (see ``SQLStore._refused``); its other errors may hide a commit."""
    return isinstance(getattr(exc, "orig", None) or exc, sqlite3.Error)


#: The driver's own exception says what happened; SQLAlchemy's adds the SQL text and its
#: parameters (a whole job, perhaps), which have no place in a message.
_wrap_errors = store_errors(_is_fault, lambda exc: getattr(exc, "orig", None) or exc,
                            is_timeout=unanswered, is_reply=_answered)


@contextlib.contextmanager
def transaction(conn: sa.Connection, sqlite: bool) -> Iterator[sa.Connection]:
    """One transaction on ``conn`` (in driver autocommit mode): committed if the block ends
    normally, else rolled back (and the connection stays usable). On SQLite ``BEGIN
    IMMEDIATE`` takes the write lock up front, so no lock upgrade can fail midway."""
    conn.exec_driver_sql("BEGIN IMMEDIATE" if sqlite else "BEGIN")
    try:
        yield conn
        conn.exec_driver_sql("COMMIT")
    except BaseException:
        with contextlib.suppress(sa_exc.SQLAlchemyError):
            conn.exec_driver_sql("ROLLBACK")
        raise


def normalise_url(url: str) -> URL:
    """Parse ``url``; a PostgreSQL URL without a driver gets psycopg 3 (``postgres://`` too)."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    elif parsed.drivername.startswith("postgres+"):
        parsed = parsed.set(drivername="postgresql+" + parsed.drivername.split("+", 1)[1])
    return parsed


#: The PostgreSQL drivers built on libpq, which take :func:`_unanswered_after`'s settings.
_LIBPQ_DRIVERS = ("psycopg", "psycopg2")


def _unanswered_after(timeout: float, given: Mapping[str, object], driver: str) -> dict[str, Any]:
    """libpq's settings that end a PostgreSQL connection whose server stopped answering
    (a host or network gone) after about ``timeout`` seconds, instead of the kernel's quarter
    of an hour: the connect's own limit, TCP keepalives while a reply is awaited, and the limit
    on data the server leaves unacknowledged (libpq 12 and later). Those the URL names
    (``given``) are kept, and so is ``PGCONNECT_TIMEOUT``; a URL naming a ``service`` gets none
    (its file decides). A server that is up but stuck (frozen, or waiting for its disk) still
    answers at the TCP level, so none of these ends that wait (README, "When the job store
    stops answering")."""
    if "service" in given:
        return {}
    seconds = max(2, math.ceil(timeout))  # libpq's connect_timeout: whole seconds, at least 2
    wanted: dict[str, Any] = {
        "connect_timeout": seconds,
        "keepalives": 1,
        "keepalives_idle": max(1, seconds // 2),
        "keepalives_interval": max(1, seconds // 6),
        "keepalives_count": 3,
    }
    if "PGCONNECT_TIMEOUT" in os.environ:
        del wanted["connect_timeout"]
    if _libpq_version(driver) >= 120000:
        wanted["tcp_user_timeout"] = seconds * 1000
    return {name: value for name, value in wanted.items() if name not in given}


def _not_ended(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
    """A pooled PostgreSQL session that the server ended while it waited in the pool (a
    restart, a failover, ``pg_terminate_backend``, an idle timeout) is not handed out: an idle
    session has nothing to read unless the server said goodbye or closed it, as the lane
    checks its own. The pool then replaces every session it kept from before (SQLAlchemy's
    ``InvalidatePoolError``), without a round trip per checkout."""
    try:
        ended = ready(dbapi_connection.fileno(), timeout=0)
    except Exception:  # closed already: no descriptor
        ended = True
    if ended:
        raise sa_exc.InvalidatePoolError("the server ended this session")


def _server_warning(diagnostic: Any) -> None:
    """Log a WARNING the server sends a store session. The one that matters: a commit whose
    wait for a synchronous standby was cancelled (``pg_cancel_backend``, a session terminated,
    the server shutting down) is done locally, and the write succeeds, but "might not have
    been replicated to the standby": a failover to it may lose the write (README, "Synchronous
    standbys"). ``statement_timeout`` does not end that wait."""
    if getattr(diagnostic, "severity_nonlocalized", None) != "WARNING":
        return
    detail = diagnostic.message_detail
    logger.warning("ojs_celery: the job store's server warns: %s%s", diagnostic.message_primary,
                   f" ({detail})" if detail else "")


def _milliseconds(timeout: float) -> int:
    """``store_timeout`` as PostgreSQL's ``statement_timeout`` (whole milliseconds, never 0,
    which would mean no limit)."""
    return max(1, round(timeout * 1000))


def _libpq_version(driver: str) -> int:
    """The libpq the driver runs on, as ``PQlibVersion`` gives it (120000 for 12.0); 0 if it
    cannot say."""
    try:
        if driver == "psycopg":
            from psycopg import pq

            return int(pq.version())
        import psycopg2.extensions  # type: ignore[import-not-found,import-untyped,unused-ignore]

        return int(psycopg2.extensions.libpq_version())
    except Exception:
        return 0


def sqlite_file(url: URL) -> str | None:
    """The absolute path of a SQLite URL's file (None: in memory, or a ``file:`` URI)."""
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file:") or "uri" in url.query:
        return None
    return os.path.abspath(database)


def file_identity(path: str | None) -> tuple[int, int] | None:
    """The file at ``path`` as the file system knows it (device, inode); None if none is
    there."""
    if path is None:
        return None
    try:
        found = os.stat(path)
    except OSError:
        return None
    return (found.st_dev, found.st_ino)


#: SQLite's result code for a file it cannot open (``sqlite3.SQLITE_CANTOPEN``, Python 3.11+).
_SQLITE_CANTOPEN = 14


def _cannot_open(error: BaseException | None) -> bool:
    """Whether ``error`` is SQLite's "unable to open database file": the connection was never
    made, so nothing was written (a write that fails so is not uncertain)."""
    if not isinstance(error, sqlite3.OperationalError):
        return False
    code = getattr(error, "sqlite_errorcode", None)  # Python 3.11+
    return code == _SQLITE_CANTOPEN if code is not None else (
        "unable to open database file" in str(error))


def _why_not_opened(path: str) -> str:
    """Why the SQLite file ``path`` cannot be opened, as far as its folder tells."""
    folder = os.path.dirname(path)
    if not os.path.exists(folder):
        return f"its folder {folder} does not exist"
    if not os.path.isdir(folder):
        return f"{folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK) or (
            os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK)):
        return "no permission to open or create it"
    return "SQLite cannot open it"


#: What a PostgreSQL server refuses a new session for that only a change of ``store_url`` (or
#: of the server's configuration) mends: SQLSTATE, libpq's words (psycopg gives no SQLSTATE for
#: a session it could not open; the server words its FATAL in English unless its
#: ``lc_messages`` says otherwise), what to do. ``{name}``: the database (3D000) or user named.
_MISCONFIGURED = (
    ("3D000", re.compile(r'FATAL:\s+database "(?P<name>[^"]*)" does not exist'),
     'the database "{name}" does not exist on the PostgreSQL server at {server}: create it '
     "(createdb {name}) or name one that exists"),
    ("28P01", re.compile(r'FATAL:\s+password authentication failed for user "(?P<name>[^"]*)"'),
     'the PostgreSQL server at {server} does not accept the password of user "{name}": give '
     "the right one"),
    ("28000", re.compile(r'FATAL:\s+(?:role "(?P<name>[^"]*)" does not exist|no pg_hba\.conf '
                         r"entry|\w+ authentication failed for user)"),
     'the PostgreSQL server at {server} does not let user "{name}" in: name a user it knows '
     "and lets in from this host (pg_hba.conf)"),
    ("", re.compile(r"fe_sendauth: no password supplied"),
     'the PostgreSQL server at {server} asks user "{name}" for a password and the URL gives '
     "none: give one (or a ~/.pgpass entry)"),
)


def _misconfigured(url: URL, error: BaseException | None) -> StoreMisconfigured | None:
    """The :class:`StoreMisconfigured` for ``error``, the driver's refusal of a new session to
    the PostgreSQL server of ``url``, when it is one of :data:`_MISCONFIGURED` (a database
    that does not exist, a user or password the server does not accept); else None."""
    if error is None or url.get_backend_name() != "postgresql":
        return None
    sqlstate = getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)
    for code, words, rule in _MISCONFIGURED:
        found = words.search(str(error))
        if found is None and not (code and sqlstate == code):
            continue
        name = (found.groupdict().get("name") if found is not None else None) or (
            url.database if code == "3D000" else url.username) or "(libpq's default)"
        server = f"{url.host or 'localhost'}:{url.port or 5432}"
        return StoreMisconfigured(f"ojs.store_url: {rule.format(name=name, server=server)} "
                                  f"({store_message(error)})")
    return None


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    """WAL lets readers run beside one writer across processes; the busy timeout makes writers
    queue instead of failing; NORMAL sync is durable across process crashes in WAL mode."""
    dbapi_connection.isolation_level = None  # driver autocommit: no implicit BEGIN
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA synchronous = NORMAL")
    finally:
        cursor.close()


def _deadline_column(clock: str) -> str:
    return f"due_{clock}"


#: PostgreSQL's longest identifier, in bytes (``NAMEDATALEN`` - 1): a longer name is cut.
POSTGRES_MAX_IDENTIFIER = 63


def longest_name(prefix: str) -> str:
    """The longest table or index name of a store with ``prefix``."""
    metadata = build_metadata(prefix)
    names = [*metadata.tables, *(index.name or "" for table in metadata.tables.values()
                                 for index in table.indexes)]
    return max(names, key=len)


def build_metadata(prefix: str) -> sa.MetaData:
    """The three tables of one store (``{prefix}_jobs``, ``_workers``, ``_meta``)."""
    metadata = sa.MetaData()
    jobs = sa.Table(
        f"{prefix}_jobs",
        metadata,
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("data", sa.Text, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("token", sa.Integer, nullable=False),
        sa.Column("worker_id", sa.Text, nullable=True),
        sa.Column("heartbeat_at", sa.Double, nullable=True),
        sa.Column("extended_at", sa.Double, nullable=True),
        sa.Column("dispatch_due", sa.Double, nullable=True),
        sa.Column("promote_at", sa.Double, nullable=True),
        sa.Column("dead_letter", sa.Boolean, nullable=False, default=False),
        sa.Column("nonce", sa.Text, nullable=False, server_default=""),
        sa.Column("origin", sa.Text, nullable=False, server_default=""),
        *(sa.Column(_deadline_column(clock), sa.Double, nullable=True) for clock in CLOCKS),
    )
    missing = set(RECORD_FIELDS) - set(jobs.c.keys())
    assert not missing, f"jobs table lacks record fields {missing}"
    for clock in CLOCKS:
        column = jobs.c[_deadline_column(clock)]
        sa.Index(
            f"ix_{prefix}_jobs_due_{clock}",
            column,
            postgresql_where=column.is_not(None),
            sqlite_where=column.is_not(None),
        )
    workers = sa.Table(
        f"{prefix}_workers",
        metadata,
        sa.Column("worker_id", sa.Text, primary_key=True),
        sa.Column("data", sa.Text, nullable=False),
        sa.Column("last_beat", sa.Double, nullable=False),
    )
    sa.Index(f"ix_{prefix}_workers_last_beat", workers.c.last_beat)
    sa.Table(
        f"{prefix}_meta",
        metadata,
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
    )
    return metadata


def preload(url: str) -> None:
    """Import the modules a store for ``url`` needs (see
    :func:`ojs_celery.store.preload_store`): SQLAlchemy's dialect, the driver, and the
    PostgreSQL fast lane where psycopg 3 is the driver."""
    normal = normalise_url(url)
    normal.get_dialect().import_dbapi()
    if normal.drivername == "postgresql+psycopg":
        from . import pg_lane  # noqa: F401


class SQLStore(JobStore):
    """Job store on SQLite or PostgreSQL; see the module docstring.

    The engine is created on first use, and re-created (without closing the parent's
    connections) in a process forked after it was used: Celery's prefork pool forks late.
    """

    def __init__(
        self, url: str, policy: Policy | None = None, prefix: str = "ojs",
        synchronous_commit: str | None = None, timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(policy)
        self.url = normalise_url(url)
        self.timeout = timeout
        self.prefix = prefix
        backend = self.url.get_backend_name()
        if backend not in ("sqlite", "postgresql"):
            raise ValueError(f"store_url: unsupported SQL backend {backend!r} (sqlite, postgresql)")
        self._sqlite = backend == "sqlite"
        if synchronous_commit is not None and (self._sqlite or synchronous_commit not in
                                               _SYNCHRONOUS_COMMIT):
            raise ValueError(f"synchronous_commit: {synchronous_commit!r} is not a PostgreSQL "
                             f"value ({', '.join(_SYNCHRONOUS_COMMIT)})")
        #: PostgreSQL's ``synchronous_commit`` for every session of this store (None: the
        #: server's): set when a connection is made, so the insert lane's has it too.
        self.synchronous_commit = synchronous_commit
        self._shared_connection = self._sqlite and self.url.database in (None, "", ":memory:")
        #: The SQLite file (None: another database), and its identity when this process's
        #: connections opened it (see :meth:`_file_replaced`).
        self._file = sqlite_file(self.url) if self._sqlite else None
        self._file_opened: tuple[int, int] | None = None
        self.metadata = build_metadata(prefix)
        self._engine: Engine | None = None
        #: PostgreSQL: the ``statement_timeout`` the last session made had (``10s``; ``0``:
        #: none), as the server says it, for the message of a statement it cancels.
        self._statement_timeout: str | None = None
        self._ready = False
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.job_table = self.metadata.tables[f"{prefix}_jobs"]
        self.worker_table = self.metadata.tables[f"{prefix}_workers"]
        self.meta_table = self.metadata.tables[f"{prefix}_meta"]
        #: ``INSERT`` with this dialect's ``ON CONFLICT`` clauses.
        self.dialect_insert = sqlite_dialect.insert if self._sqlite else pg_dialect.insert
        self._prepare_statements()
        self._lane = self._build_lane()
        self.workers = SQLWorkerRegistry(self)
        self.meta = SQLMetaArea(self)

    # ------------------------------------------------------------------ engine and schema

    def _prepare_statements(self) -> None:
        """Build every statement once; SQLAlchemy then reuses their compiled form."""
        jobs = self.job_table
        insert = self.dialect_insert
        c = jobs.c
        self._record_columns = ("data", *RECORD_FIELDS)
        self._select_record = sa.select(*(c[name] for name in self._record_columns)).where(
            c.id == sa.bindparam("k_id")
        )
        self._select_records = sa.select(
            c.id, *(c[name] for name in self._record_columns)
        ).where(c.id.in_(sa.bindparam("k_ids", expanding=True)))
        # rowcount of an INSERT is only kept on request (0 when the id existed).
        self._insert_job = (
            insert(jobs)
            .on_conflict_do_nothing(index_elements=[c.id])
            .execution_options(preserve_rowcount=True)
        )
        # Several new jobs at once: a conflict raises (and the whole batch is rolled back).
        self._insert_new_job = sa.insert(jobs)
        self._select_ids = sa.select(c.id).where(c.id.in_(sa.bindparam("k_ids", expanding=True)))
        self._update_job = sa.update(jobs).where(
            c.id == sa.bindparam("k_id"),
            c.version == sa.bindparam("k_expected"),
            c.nonce == sa.bindparam("k_nonce"),
        )
        self._ack = (
            sa.update(jobs)
            .where(
                c.id == sa.bindparam("k_id"),
                c.token == sa.bindparam("k_token"),
                c.dispatch_due.is_not(None),
            )
            .values({c.dispatch_due: None, c[_deadline_column("dispatch")]: None})
        )
        self._ack_many = (
            sa.update(jobs)
            .where(
                sa.tuple_(c.id, c.token).in_(sa.bindparam("k_pairs", expanding=True)),
                c.dispatch_due.is_not(None),
            )
            .values({c.dispatch_due: None, c[_deadline_column("dispatch")]: None})
            .returning(c.id, c.token)
        )
        self._delete_job = sa.delete(jobs).where(
            c.id == sa.bindparam("k_id"), c.version == sa.bindparam("k_expected")
        )
        self._due: dict[str, sa.Select[Any]] = {}
        self._scan: dict[str, sa.Select[Any]] = {}
        for clock in CLOCKS:
            column = c[_deadline_column(clock)]
            self._due[clock] = (
                sa.select(c.id, column)
                .where(column <= sa.bindparam("k_now", type_=sa.Double))
                .order_by(column)
                .limit(sa.bindparam("k_limit", type_=sa.Integer))
            )
            self._scan[clock] = (
                sa.select(c.id)
                .where(column.is_not(None), c.id > sa.bindparam("k_after", type_=sa.Text))
                .order_by(c.id)
                .limit(sa.bindparam("k_limit", type_=sa.Integer))
            )

    def _build_lane(self) -> PgLane | SqliteLane | None:
        """The hot writes' fast lane (:mod:`.sql_lane`) on PostgreSQL with psycopg 3 and on a
        SQLite file, else None: the insert (``ON CONFLICT DO NOTHING``, as
        :attr:`_insert_job`) and the compare-and-set (as :attr:`_update_job`)."""
        if not (sqlite_lane_fits(self.url) if self._sqlite
                else self.url.drivername == "postgresql+psycopg"):
            return None
        jobs = self.job_table
        dialect: Any = sqlite_dialect if self._sqlite else pg_dialect
        preparer = dialect.dialect().identifier_preparer
        mark = "?" if self._sqlite else "$"

        def slot(n: int) -> str:
            return f"{mark}{n}"

        table = preparer.format_table(jobs)
        self._insert_columns = tuple(column.name for column in jobs.columns)
        names = ", ".join(preparer.quote(name) for name in self._insert_columns)
        slots = ", ".join(slot(n) for n in range(1, len(self._insert_columns) + 1))
        insert = (f"INSERT INTO {table} ({names}) VALUES ({slots}) "
                  f"ON CONFLICT ({preparer.quote('id')}) DO NOTHING")
        self._cas_columns = tuple(name for name in self._insert_columns if name != "id")
        sets = ", ".join(f"{preparer.quote(name)} = {slot(n)}"
                         for n, name in enumerate(self._cas_columns, start=1))
        at = len(self._cas_columns)
        cas = (f"UPDATE {table} SET {sets} WHERE {preparer.quote('id')} = {slot(at + 1)} "
               f"AND {preparer.quote('version')} = {slot(at + 2)} AND "
               f"{preparer.quote('nonce')} = {slot(at + 3)}")
        self._lane_insert = f"ojs_celery_insert_{self.prefix}"
        self._lane_cas = f"ojs_celery_cas_{self.prefix}"
        statements = {self._lane_insert: insert, self._lane_cas: cas}
        if self._sqlite:
            return SqliteLane(lambda: self.engine.raw_connection(), statements,
                              identity=lambda: file_identity(self._file))
        from .pg_lane import PgLane

        return PgLane(lambda: self.engine.raw_connection(), statements)

    @property
    def engine(self) -> Engine:
        """The engine for this process, with the tables created (first use does both)."""
        engine = self._engine  # read once: another thread's _setup may replace it meanwhile
        if engine is not None and self._ready and self._pid == os.getpid() \
                and not self._file_replaced():
            return engine
        return self._setup()

    def _file_replaced(self) -> bool:
        """Whether the SQLite file is not the one this process's connections opened: deleted
        (its folder removed, a cleaner of temporary files) or replaced. SQLite goes on writing
        to a file that is deleted while it is open, so without this check every job stored
        after it would be written where no other process, and no later one, ever reads it."""
        return self._file_opened is not None and file_identity(self._file) != self._file_opened

    def _setup(self) -> Engine:
        pid = os.getpid()
        if pid != self._pid:
            # Forked: the parent's pooled connections (and maybe its lock) are not ours. The
            # SQLAlchemy recipe: drop the pool without closing them, then connect afresh.
            self._lock = threading.Lock()
            if self._engine is not None:
                self._engine.dispose(close=False)
            self._pid = pid
        with self._lock:
            if self._engine is not None and self._file_replaced():
                # the deleted file's connections go; the path is opened again (a missing
                # folder fails there, a new file gets the tables)
                logger.warning("ojs_celery: the job store's SQLite file %s was deleted or "
                               "replaced while this process used it: opening it again",
                               self._file)
                self._engine.dispose()
                self._engine, self._ready, self._file_opened = None, False, None
            if self._engine is None:
                self._engine = self._create_engine()
            if not self._ready:
                try:
                    self._create_tables(self._engine)
                except sa_exc.OperationalError as exc:
                    refusal = _misconfigured(self.url, exc.orig)
                    if refusal is not None:
                        raise refusal from exc
                    if self._file is not None and _cannot_open(exc.orig):
                        raise StoreRefused(store_message(
                            exc.orig, "the job store is unavailable, it cannot open its "
                                      f"SQLite file {self._file} "
                                      f"({_why_not_opened(self._file)}): ")) from exc
                    raise
                self._file_opened = file_identity(self._file)
                self._ready = True
            return self._engine

    def _create_engine(self) -> Engine:
        if self._sqlite:
            kwargs: dict[str, Any] = {"isolation_level": "AUTOCOMMIT"}
            if self._shared_connection:
                # One shared connection, else every pooled connection sees its own database.
                kwargs["poolclass"] = StaticPool
                kwargs["connect_args"] = {"check_same_thread": False}
            engine = sa.create_engine(self.url, **kwargs)
            event.listen(engine, "connect", _sqlite_on_connect)
            return engine
        driver = self.url.get_driver_name()
        engine = sa.create_engine(
            self.url, isolation_level="AUTOCOMMIT",
            connect_args=(_unanswered_after(self.timeout, self.url.query, driver)
                          if driver in _LIBPQ_DRIVERS else {}))
        # A statement waiting for a lock another session holds gets no answer, and libpq's
        # limits above never end that wait (the server answers TCP): the server cancels it
        # after store_timeout, unless the server's configuration, the database, the role or
        # the URL sets a limit of its own (0, none, included).
        # The first statement answers with the limit in effect, for the message of a statement
        # it cancels (see _refused).
        statements = ["SELECT coalesce((SELECT set_config('statement_timeout', "
                      f"'{_milliseconds(self.timeout)}', false) FROM pg_settings "
                      "WHERE name = 'statement_timeout' AND source = 'default'), "
                      "current_setting('statement_timeout'))"]
        if self.synchronous_commit is not None:
            statements.append(f"SET synchronous_commit = {self.synchronous_commit}")  # literal

        def on_connect(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            try:
                for statement in statements:
                    cursor.execute(statement)
                    if statement is statements[0]:
                        row = cursor.fetchone()
                        self._statement_timeout = str(row[0]) if row else None
            finally:
                cursor.close()
            if not dbapi_connection.autocommit:  # kept: a rollback would undo them
                dbapi_connection.commit()
            add_notice_handler = getattr(dbapi_connection, "add_notice_handler", None)
            if add_notice_handler is not None:  # psycopg 3 (the lane's connection too)
                add_notice_handler(_server_warning)

        event.listen(engine, "connect", on_connect)
        if driver in _LIBPQ_DRIVERS:  # their connections give their socket (fileno)
            event.listen(engine, "checkout", _not_ended)
        return engine

    def _create_tables(self, engine: Engine) -> None:
        """``create_all`` under a lock, so processes starting together do not both try.

        A refusal by the database on a working connection (no permission to create the
        tables, a read-only session) leaves as :class:`StoreRefused`: the write that needed
        the tables was not sent, so it did not happen (a lost connection or an unanswered
        statement stays the error it is)."""
        with engine.connect() as conn:
            try:
                with transaction(conn, self._sqlite):
                    if not self._sqlite:
                        key = zlib.crc32(f"ojs_celery:{self.prefix}".encode())
                        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})
                    self.metadata.create_all(conn, checkfirst=True)
                    self._add_missing_columns(conn)
            except sa_exc.DBAPIError as exc:
                if exc.connection_invalidated or unanswered(exc):
                    raise
                raise StoreRefused(store_message(
                    getattr(exc, "orig", None) or exc,
                    f"could not create the job store's tables ({self.prefix}_*): ")) from exc

    def _add_missing_columns(self, conn: sa.Connection) -> None:
        """Give a jobs table made by an older version the columns added since (each has a
        server default, so existing rows stay valid): ``nonce`` and ``origin`` of fencing."""
        jobs = self.job_table
        existing = {column["name"] for column in sa.inspect(conn).get_columns(jobs.name)}
        preparer = conn.dialect.identifier_preparer
        for column in jobs.columns:
            if column.name in existing or column.server_default is None:
                continue
            kind = column.type.compile(dialect=conn.dialect)
            conn.exec_driver_sql(
                f"ALTER TABLE {preparer.format_table(jobs)} ADD COLUMN "
                f"{preparer.format_column(column)} {kind} NOT NULL DEFAULT ''"
            )

    @_wrap_errors
    def drop_tables(self) -> None:
        """Drop this prefix's tables (tests, uninstall)."""
        self.metadata.drop_all(self.engine, checkfirst=True)
        self._ready = False
        if self._lane is not None:  # its next connection comes through the engine, which
            self._lane.close()  # makes the tables again (and PostgreSQL's statements anew)

    def close(self) -> None:
        if self._lane is not None:
            self._lane.close()
        if self._engine is not None:
            if self._pid == os.getpid():
                self._engine.dispose()
            else:
                self._engine.dispose(close=False)
            self._engine = None
            self._ready = False

    # ------------------------------------------------------------------ record codec

    def _values(self, record: Record, deadlines: dict[str, float | None]) -> dict[str, Any]:
        job = record.job
        record.written_json = encode_job(job)
        values: dict[str, Any] = {
            "data": record.written_json,
            "state": job.state,
            "token": record.token,
            "worker_id": record.worker_id,
            "heartbeat_at": record.heartbeat_at,
            "extended_at": record.extended_at,
            "dispatch_due": record.dispatch_due,
            "promote_at": record.promote_at,
            "dead_letter": bool(record.dead_letter),
            "nonce": record.nonce,
            "origin": record.origin,
        }
        for clock in CLOCKS:
            values[_deadline_column(clock)] = deadlines.get(clock)
        return values

    def _cas_values(
        self, record: Record, previous: Record, deadlines: dict[str, float | None]
    ) -> dict[str, Any]:
        """The compare-and-set statement's parameters: replace ``previous`` by ``record``."""
        values = self._values(record, deadlines)
        values["version"] = previous.version + 1
        values["k_id"] = record.job.id
        values["k_expected"] = previous.version
        values["k_nonce"] = previous.nonce
        return values

    # ------------------------------------------------------------------ job primitives

    @_wrap_errors
    def _insert(self, record: Record, deadlines: dict[str, float | None]) -> bool:
        values = self._values(record, deadlines)
        values["id"] = record.job.id
        values["version"] = 1
        try:
            with self._refusals(), self.engine.connect() as conn:
                return conn.execute(self._insert_job, values).rowcount == 1
        except sa_exc.IntegrityError:
            return False

    @_wrap_errors
    def _insert_begin(
        self, record: Record, deadlines: dict[str, float | None]
    ) -> Callable[[], bool]:
        """Send the insert through the lane now and read its reply when asked (on PostgreSQL
        the commit overlaps the caller's publish; on SQLite it is done already); without the
        lane, insert at once."""
        answer = None
        if self._lane is not None:
            values = self._values(record, deadlines)
            values["id"] = record.job.id
            values["version"] = 1
            answer = self._lane.send(self._lane_insert,
                                     [values[name] for name in self._insert_columns])
        if answer is None:
            inserted = self._insert(record, deadlines)
            return lambda: inserted
        reply = answer  # a lost reply is settled by begin_create (origin read back)

        def confirm() -> bool:
            with self._refusals():  # an error reply is not settled: nothing was stored
                return reply() == 1

        return confirm

    @_wrap_errors
    def _insert_many(self, rows: Sequence[NewRow]) -> str | None:
        values = []
        for record, deadlines in rows:
            row = self._values(record, deadlines)
            row["id"] = record.job.id
            row["version"] = 1
            values.append(row)
        values.sort(key=lambda row: str(row["id"]))  # one lock order: concurrent batches
        ids = [record.job.id for record, _ in rows]  # cannot deadlock each other
        for _ in range(self.max_conflicts):
            try:
                if self._shared_connection:  # no transaction there: one statement is atomic
                    with self.engine.connect() as conn:
                        conn.execute(sa.insert(self.job_table).values(values))
                else:
                    with self._refusals(), self._transaction() as conn:
                        conn.execute(self._insert_new_job, values)
                return None
            except sa_exc.IntegrityError:
                with self.engine.connect() as conn:
                    found = set(conn.execute(self._select_ids, {"k_ids": ids}).scalars())
                taken = next((job_id for job_id in ids if job_id in found), None)
                if taken is not None:
                    return taken
                # the conflicting job was pruned meanwhile: try again
        raise StoreError("inserting a batch of jobs: too many conflicts, gave up")

    @_wrap_errors
    def _load(self, job_id: str) -> Record | None:
        with self.engine.connect() as conn:
            row = conn.execute(self._select_record, {"k_id": job_id}).first()
        return None if row is None else self._record(row)

    def _record(self, row: Sequence[Any]) -> Record:
        """A row of ``_record_columns`` as a record."""
        fields = dict(zip(self._record_columns, row, strict=True))
        return Record(
            job=decode_job(fields["data"]),
            token=int(fields["token"]),
            version=int(fields["version"]),
            worker_id=fields["worker_id"],
            heartbeat_at=fields["heartbeat_at"],
            extended_at=fields["extended_at"],
            dispatch_due=fields["dispatch_due"],
            promote_at=fields["promote_at"],
            dead_letter=bool(fields["dead_letter"]),
            nonce=fields["nonce"] or "",
            origin=fields["origin"] or "",
        )

    @_wrap_errors
    def _cas(self, record: Record, previous: Record, deadlines: dict[str, float | None]) -> bool:
        values = self._cas_values(record, previous, deadlines)
        with self._refusals():
            if self._lane is not None:
                answer = self._lane.send(self._lane_cas, self._lane_cas_row(values))
                if answer is not None:
                    return answer() == 1
            with self.engine.connect() as conn:
                return conn.execute(self._update_job, values).rowcount == 1

    def _lane_cas_row(self, values: dict[str, Any]) -> list[Any]:
        """:meth:`_cas_values` in the order of the lane's compare-and-set parameters."""
        return [*(values[name] for name in self._cas_columns),
                values["k_id"], values["k_expected"], values["k_nonce"]]

    @_wrap_errors
    def _ack_dispatch(self, job_id: str, token: int) -> bool:
        with self.engine.connect() as conn:
            return conn.execute(self._ack, {"k_id": job_id, "k_token": token}).rowcount == 1

    @_wrap_errors
    def _load_many(self, job_ids: Sequence[str]) -> list[Record | None]:
        with self.engine.connect() as conn:
            rows = conn.execute(self._select_records, {"k_ids": list(job_ids)}).all()
        found = {row[0]: self._record(row[1:]) for row in rows}
        return [found.get(job_id) for job_id in job_ids]

    @_wrap_errors
    def _cas_many(self, writes: Sequence[Write]) -> list[bool]:
        """One transaction, the rows taken in id order (two batches never wait for each other
        in opposite orders); on PostgreSQL through the lane, in one round trip."""
        results = [False] * len(writes)
        order = sorted(range(len(writes)), key=lambda i: writes[i][0].job.id)
        values = [self._cas_values(*writes[index]) for index in order]
        with self._refusals():
            if self._lane is not None:
                answer = self._lane.send_many(self._lane_cas,
                                              [self._lane_cas_row(v) for v in values])
                if answer is not None:
                    for index, rows in zip(order, answer(), strict=True):
                        results[index] = rows == 1
                    return results
            with self._transaction() as conn:
                for index, row in zip(order, values, strict=True):
                    results[index] = conn.execute(self._update_job, row).rowcount == 1
        return results

    @contextlib.contextmanager
    def _refusals(self) -> Iterator[None]:
        """Around a write (an insert, a batch, a compare-and-set): the server's error reply
        that rolled it back leaves as :class:`StoreRefused` (see :meth:`_refused`); anything
        else as it came."""
        try:
            yield
        except Exception as exc:
            refused = self._refused(exc)
            if refused is None:
                raise
            # the driver's error as its cause (the lane's StoreError carries psycopg's)
            raise refused from (exc.__cause__ if isinstance(exc, StoreError) else exc)

    def _refused(self, exc: Exception) -> StoreRefused | None:
        """A write's error that says, for certain, that nothing of it was stored (PostgreSQL's
        error reply, which rolls the write's transaction back: :func:`.sql_lane.rolled_back`)
        as :class:`StoreRefused`, its message saying why; None for any other (a lost reply
        may hide a commit, and is settled by reading)."""
        sqlstate = rolled_back(exc)
        if sqlstate is None or self._sqlite or isinstance(exc, sa_exc.IntegrityError):
            return None  # an integrity error is the write's own answer: a taken id
        cause: Any = getattr(exc, "orig", None) or exc.__cause__ or exc
        said = str(cause)
        if sqlstate == "57014" and "statement timeout" in said:
            limit = self._statement_timeout or f"{self.timeout:g}s"
            why = (f"the server cancelled the write after the session's statement_timeout "
                   f"({limit}): it waited that long, most likely for a lock another session "
                   "holds (a LOCK TABLE, a migration's ALTER TABLE), else on a server too busy "
                   "to run it")
        elif sqlstate == "55P03":
            why = ("the server cancelled the write: a lock another session holds (a LOCK "
                   "TABLE, a migration's ALTER TABLE) was not granted within the session's "
                   "lock_timeout")
        elif sqlstate == "57014":
            why = "the write was cancelled (pg_cancel_backend, or its client)"
        else:
            why = "the server refused the write"
        return StoreRefused(f"{store_message(cause)}: {why}; the write was rolled back, "
                            "nothing of it is stored (safe to try again)")

    @_wrap_errors
    def _ack_dispatch_many(self, acks: Sequence[tuple[str, int]]) -> list[bool]:
        if not self._sqlite:  # one statement for the whole batch (the outbox acker's)
            with self.engine.connect() as conn:
                cleared = set(conn.execute(self._ack_many, {"k_pairs": list(acks)}).all())
            return [(job_id, token) in cleared for job_id, token in acks]
        return self._each_row(self._ack, acks, "k_token")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sa.Connection]:
        """One connection in one transaction (see :func:`transaction`) for a batch of writes.
        An in-memory SQLite database has one connection shared by all threads: there a
        transaction would take in other threads' statements, so each statement commits alone.
        """
        with self.engine.connect() as conn:
            if self._shared_connection:
                yield conn
                return
            with transaction(conn, self._sqlite):
                yield conn

    @_wrap_errors
    def due(self, clock: str, now: float, limit: int) -> list[tuple[str, float]]:
        try:
            statement = self._due[clock]
        except KeyError:
            raise ValueError(f"clock: unknown clock {clock!r} (one of {CLOCKS})") from None
        with self.engine.connect() as conn:
            rows = conn.execute(statement, {"k_now": float(now), "k_limit": int(limit)}).all()
        return [(str(job_id), float(deadline)) for job_id, deadline in rows]

    @_wrap_errors
    def scan(self, clock: str, cursor: str | None, limit: int) -> tuple[list[str], str | None]:
        """In id order from the last id of the page before (ids never change)."""
        with self.engine.connect() as conn:
            rows = conn.execute(self._scan[clock], {"k_after": cursor or "",
                                                    "k_limit": int(limit)}).scalars().all()
        ids = [str(job_id) for job_id in rows]
        return ids, (ids[-1] if len(ids) >= limit else None)

    @_wrap_errors
    def _delete(self, job_id: str, expected: int) -> bool:
        with self.engine.connect() as conn:
            result = conn.execute(self._delete_job, {"k_id": job_id, "k_expected": expected})
            return result.rowcount == 1

    @_wrap_errors
    def _delete_many(self, deletes: Sequence[tuple[str, int]]) -> list[bool]:
        return self._each_row(self._delete_job, deletes, "k_expected")

    def _each_row(self, statement: Any, items: Sequence[tuple[str, int]],
                  number: str) -> list[bool]:
        """``statement`` once per ``(job id, number)`` in one transaction, in id order (so
        that two batches never take the same rows in opposite orders); True where it changed
        its row."""
        results = [False] * len(items)
        order = sorted(range(len(items)), key=lambda i: items[i][0])
        with self._transaction() as conn:
            for index in order:
                job_id, value = items[index]
                params = {"k_id": job_id, number: value}
                results[index] = conn.execute(statement, params).rowcount == 1
        return results

    @_wrap_errors
    def _move_due(self, clock: str, moves: Sequence[tuple[str, float, float]]) -> int:
        column = self.job_table.c[_deadline_column(clock)]
        statement = (sa.update(self.job_table)
                     .where(self.job_table.c.id == sa.bindparam("k_id"),
                            column == sa.bindparam("k_seen", type_=sa.Double))
                     .values({column: sa.bindparam("k_new", type_=sa.Double)}))
        moved = 0
        with self._transaction() as conn:
            for job_id, seen, new in sorted(moves):  # id order, as _each_row
                moved += conn.execute(statement, {"k_id": job_id, "k_seen": float(seen),
                                                  "k_new": float(new)}).rowcount
        return moved

    # ------------------------------------------------------------------ admin

    @_wrap_errors
    def ping(self) -> None:
        with self.engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1").scalar()

    @_wrap_errors
    def clear(self) -> None:
        with self.engine.connect() as conn:
            for table in (self.job_table, self.worker_table, self.meta_table):
                conn.execute(sa.delete(table))

    def __repr__(self) -> str:
        url = mask_secrets(self.url.render_as_string(hide_password=True))
        return f"SQLStore({url!r}, prefix={self.prefix!r})"


class SQLWorkerRegistry(WorkerRegistry):
    """Worker records in ``{prefix}_workers`` (JSON data, an indexed ``last_beat``: a
    tombstone's is ``BURIED``)."""

    def __init__(self, store: SQLStore) -> None:
        self._store = store
        workers = store.worker_table
        upsert = store.dialect_insert(workers)
        self._upsert = upsert.on_conflict_do_update(
            index_elements=[workers.c.worker_id],
            set_={"data": upsert.excluded.data, "last_beat": upsert.excluded.last_beat},
        )
        self._get = sa.select(workers.c.data).where(workers.c.worker_id == sa.bindparam("k_id"))
        self._all = sa.select(workers.c.data).order_by(workers.c.worker_id)
        self._delete = sa.delete(workers).where(workers.c.worker_id == sa.bindparam("k_id"))
        self._delete_buried = self._delete.where(workers.c.last_beat == BURIED)
        self._bury = (
            sa.update(workers)
            .where(workers.c.worker_id == sa.bindparam("k_id"), workers.c.last_beat != BURIED)
            .values(data=sa.bindparam("k_data"), last_beat=BURIED)
        )
        self._stale = (
            sa.select(workers.c.worker_id)
            .where(workers.c.last_beat <= sa.bindparam("k_cutoff", type_=sa.Double))
            .order_by(workers.c.last_beat)
            .limit(sa.bindparam("k_limit", type_=sa.Integer))
        )

    @_wrap_errors
    def save(self, info: WorkerInfo) -> None:
        values = {
            "worker_id": info.worker_id,
            "data": json.dumps(info.to_dict(), separators=(",", ":")),
            "last_beat": float(info.last_beat),
        }
        with self._store.engine.connect() as conn:
            conn.execute(self._upsert, values)

    @_wrap_errors
    def get(self, worker_id: str) -> WorkerInfo | None:
        with self._store.engine.connect() as conn:
            data = conn.execute(self._get, {"k_id": worker_id}).scalar()
        return None if data is None else WorkerInfo.from_dict(json.loads(data))

    @_wrap_errors
    def remove(self, worker_id: str, buried: bool = False) -> bool:
        with self._store.engine.connect() as conn:
            return conn.execute(self._delete_buried if buried else self._delete,
                                {"k_id": worker_id}).rowcount > 0

    @_wrap_errors
    def bury(self, tombstone: WorkerInfo) -> bool:
        """One UPDATE, of a record that is not a tombstone yet (a lost reply: see
        ``JobStore.bury_worker``)."""
        data = json.dumps(tombstone.to_dict(), separators=(",", ":"))
        with self._store.engine.connect() as conn:
            return conn.execute(self._bury, {"k_id": tombstone.worker_id,
                                             "k_data": data}).rowcount > 0

    @_wrap_errors
    def all(self) -> list[WorkerInfo]:
        with self._store.engine.connect() as conn:
            rows = conn.execute(self._all).scalars().all()
        return [WorkerInfo.from_dict(json.loads(data)) for data in rows]

    @_wrap_errors
    def stale(self, cutoff: float, limit: int) -> list[str]:
        with self._store.engine.connect() as conn:
            rows = conn.execute(self._stale, {"k_cutoff": cutoff, "k_limit": limit})
            return [str(worker_id) for worker_id in rows.scalars().all()]


class SQLMetaArea(MetaArea):
    """The meta area in ``{prefix}_meta`` (key, value)."""

    def __init__(self, store: SQLStore) -> None:
        self._store = store
        meta = store.meta_table
        upsert = store.dialect_insert(meta)
        self._upsert = upsert.on_conflict_do_update(
            index_elements=[meta.c.key], set_={"value": upsert.excluded.value}
        )
        self._select = sa.select(meta.c.value).where(meta.c.key == sa.bindparam("k_key"))
        self._delete = (
            sa.delete(meta).where(meta.c.key == sa.bindparam("k_key")).returning(meta.c.value)
        )
        self._drop_if = sa.delete(meta).where(meta.c.key == sa.bindparam("k_key"),
                                              meta.c.value == sa.bindparam("k_old"))
        # RETURNING, not the row count: psycopg reports -1 for an INSERT ... ON CONFLICT
        # DO NOTHING, which told every first writer it had lost
        self._add = (store.dialect_insert(meta).on_conflict_do_nothing(index_elements=[meta.c.key])
                     .returning(meta.c.key))
        self._replace = (
            sa.update(meta)
            .where(meta.c.key == sa.bindparam("k_key"), meta.c.value == sa.bindparam("k_old"))
            .values(value=sa.bindparam("k_new"))
        )

    @_wrap_errors
    def _put(self, key: str, value: str) -> None:
        with self._store.engine.connect() as conn:
            conn.execute(self._upsert, {"key": key, "value": value})

    @_wrap_errors
    def _get(self, key: str) -> str | None:
        with self._store.engine.connect() as conn:
            value = conn.execute(self._select, {"k_key": key}).scalar()
        return None if value is None else str(value)

    @_wrap_errors
    def _take(self, key: str) -> str | None:
        with self._store.engine.connect() as conn:
            value = conn.execute(self._delete, {"k_key": key}).scalar()
        return None if value is None else str(value)

    @_wrap_errors
    def _drop(self, key: str, expected: str) -> bool:
        with self._store.engine.connect() as conn:
            result = conn.execute(self._drop_if, {"k_key": key, "k_old": expected})
            return bool(result.rowcount == 1)

    @_wrap_errors
    def _swap(self, key: str, expected: str | None, value: str) -> bool:
        with self._store.engine.connect() as conn:
            if expected is None:
                return conn.execute(self._add, {"key": key, "value": value}).first() is not None
            result = conn.execute(self._replace,
                                  {"k_key": key, "k_old": expected, "k_new": value})
            return bool(result.rowcount == 1)
