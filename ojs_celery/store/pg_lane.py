"""A fast lane for the PostgreSQL store's hot writes (the insert, every compare-and-set).

A write through SQLAlchemy waits for its reply, which comes after the commit (an fsync at
full durability), and spends more CPU in SQLAlchemy's layers (pool checkout, compiled
statement cache, parameter and result processing) than in psycopg. A worker pays that twice
per job (the start and the outcome). The lane keeps one psycopg 3 connection per process aside
(made by the store's pool, so in autocommit mode and with the connection settings the pool
applies, then detached from it), prepares the statements on it once, and sends each write with
libpq's asynchronous calls: ``enqueue`` publishes the job's message while the server commits
its insert, as the Redis store does. Replies are waited for in ``poll`` (libpq's blocking
calls would hold the GIL for the whole commit).

The lane never changes what a write does, only how it travels and when its reply is read. A
thread that finds the lane taken, or a connection that cannot send, takes the ordinary path. A
reply that is the server's error is a :class:`StoreError` caused by psycopg's exception for it,
which the store turns into :class:`~.base.StoreRefused` (rolled back: nothing to settle, see
``SQLStore._refused``); a connection lost after the write was sent is a :class:`StoreError`
that the store settles as any lost reply (an insert by reading the record's origin,
:meth:`~.base.JobStore.begin_create`; a compare-and-set by looking for its nonce,
:meth:`~.base.JobStore.apply`). A forked child forgets its parent's connection and
checks out its own.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from psycopg import errors as psycopg_errors
from psycopg import pq

from .base import StoreError, store_message
from .sql_lane import DetachedLane, ready, unanswered

__all__ = ["PgLane", "text_param", "text_params"]


def text_param(value: Any) -> bytes | None:
    """A value as PostgreSQL's text input format reads it for the job table's columns."""
    if value is None:
        return None
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, float):
        return repr(value).encode()
    return str(value).encode()


def text_params(values: Sequence[Any]) -> list[bytes | None]:
    """:func:`text_param` of each value; a plain string, most of a record's values, encoded
    at once (a C call instead of a Python one, about two dozen values per write)."""
    return [value.encode() if type(value) is str else text_param(value) for value in values]


class PgLane(DetachedLane):
    """Prepared writes on one connection of this process (see the module docstring)."""

    def __init__(self, connect: Callable[[], Any], statements: dict[str, str]) -> None:
        """``connect``: a new DBAPI connection checked out of the store's pool (SQLAlchemy's
        ``engine.raw_connection()``); ``statements``: each prepared statement's name (unique
        to the store) and text, with ``$n`` parameters."""
        super().__init__(connect)
        self._statements = {name.encode(): text.encode() for name, text in statements.items()}
        self._pipelines = True  # False once libpq said it has no pipeline mode

    def send(self, name: str, values: Sequence[Any]) -> Callable[[], int] | None:
        """Send statement ``name`` with ``values`` (in its parameter order); return the
        function that waits for its reply (the number of rows written) and raises
        :class:`StoreError` if there is none. None: nothing was sent, take the ordinary path."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            pgconn = self._pgconn()
            pgconn.send_query_prepared(name.encode(), text_params(values))
            _flush(pgconn)
        except Exception as exc:
            self._drop()
            self._lock.release()
            if unanswered(exc):
                raise  # the ordinary path would wait for the silent server as long again
            return None

        def answer() -> int:
            try:
                return self._rows(pgconn)
            finally:
                self._lock.release()

        return answer

    def send_many(self, name: str, rows: Sequence[Sequence[Any]]) -> Callable[[], list[int]] | None:
        """Send statement ``name`` once per row of values, in one pipeline that PostgreSQL
        runs as one transaction (libpq's pipeline mode: the statements up to the sync commit
        together, or none does): one round trip and one commit for a batch. The reader returns
        each statement's row count, in order, and raises :class:`StoreError` if the batch
        failed (then nothing was written) or its reply was lost. None: nothing was sent (the
        lane is taken, or libpq is older than 14), take the ordinary path."""
        if not rows or not self._pipelines or not self._lock.acquire(blocking=False):
            return None
        try:
            pgconn = self._pgconn()
        except Exception:
            self._drop()
            self._lock.release()
            return None
        try:
            pgconn.enter_pipeline_mode()
        except Exception:  # psycopg's NotSupportedError: libpq before 14 has no pipelines
            self._pipelines = False
            self._lock.release()
            return None
        try:
            for values in rows:
                pgconn.send_query_prepared(name.encode(), text_params(values))
            pgconn.pipeline_sync()
            _flush(pgconn)
        except Exception as exc:  # the server may or may not have run it: a lost reply
            self._drop()
            self._lock.release()
            raise StoreError(f"job store error: connection lost while sending a batch ({exc})") \
                from exc

        def answer() -> list[int]:
            try:
                counts = [self._rows(pgconn) for _ in rows]
                self._end_pipeline(pgconn)
                return counts
            except BaseException:
                self._drop()  # a pipeline left half read cannot serve the next write
                raise
            finally:
                self._lock.release()

        return answer

    def _end_pipeline(self, pgconn: Any) -> None:
        """Read the sync point's result and leave pipeline mode."""
        synced = [result.status for result in _results(pgconn)]
        if synced != [pq.ExecStatus.PIPELINE_SYNC]:
            raise StoreError(f"job store error: unexpected end of a batch ({synced})")
        pgconn.exit_pipeline_mode()

    def _pgconn(self) -> Any:
        if self._raw is not None:
            pgconn = self._raw.pgconn
            if pgconn.status == pq.ConnStatus.OK and \
                    pgconn.transaction_status == pq.TransactionStatus.IDLE and \
                    not ready(pgconn.socket, timeout=0):
                return pgconn
            # something arrived unasked: the server ended the session (a restart, an
            # administrator's pg_terminate_backend, an idle timeout), or worse
            self._drop()
        connection = self._detached()
        try:
            pgconn = connection.pgconn
            for name, statement in self._statements.items():
                pgconn.send_prepare(name, statement)
                _flush(pgconn)
                results = list(_results(pgconn))
                failed = [r for r in results if r.status != pq.ExecStatus.COMMAND_OK]
                if failed or not results:
                    raise StoreError(_message(failed[0]) if failed else "no reply to PREPARE")
        except BaseException:
            connection.close()
            raise
        self._raw = connection
        return pgconn

    def _rows(self, pgconn: Any) -> int:
        rows: int | None = None
        error: str | None = None
        refusal: Any = None  # an error result of the server's (FATAL_ERROR: any severity)
        try:
            for result in _results(pgconn):
                if result.status == pq.ExecStatus.COMMAND_OK:
                    rows = int(result.command_tuples or 0)
                else:
                    error = _message(result)
                    if result.status == pq.ExecStatus.FATAL_ERROR and refusal is None:
                        refusal = result
        except Exception as exc:
            error = " ".join(f"{type(exc).__name__}: {exc}".split())  # psycopg: lines
        if pgconn.status != pq.ConnStatus.OK:
            self._drop()
            raise StoreError(f"job store error: connection lost after a write was sent "
                             f"({error or 'no reply'})")
        if refusal is not None:  # the server's own error: the driver's exception says it
            driver_error = psycopg_errors.error_from_result(refusal, encoding=_encoding(pgconn))
            raise StoreError(store_message(driver_error)) from driver_error
        if error is not None or rows is None:
            raise StoreError(f"job store error: {error or 'no reply to a write'}")
        return rows


def _flush(pgconn: Any) -> None:
    """Send what libpq buffered (psycopg keeps its connections non-blocking), waiting in
    :func:`.sql_lane.ready`, which lets other threads run, never in libpq, which holds the
    GIL."""
    while pgconn.flush():
        ready(pgconn.socket, write=True)


def _results(pgconn: Any) -> Iterator[Any]:
    """The results of the command sent, each waited for in ``poll`` (see :func:`_flush`)."""
    while True:
        pgconn.consume_input()
        while pgconn.is_busy():
            ready(pgconn.socket)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:
            return
        yield result



def _encoding(pgconn: Any) -> str:
    """The connection's client encoding as Python names it (for the server's messages)."""
    name = bytes(pgconn.parameter_status(b"client_encoding") or b"UTF8").decode()
    try:
        return codecs.lookup(name).name  # UTF8, LATIN1...; SQL_ASCII has no codec
    except LookupError:
        return "utf-8"


def _message(result: Any) -> str:
    return bytes(result.error_message or b"").decode(errors="replace").strip() or \
        f"status {result.status}"
