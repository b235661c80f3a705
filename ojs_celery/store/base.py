"""The job store protocol, and the rules every backend shares.

A backend implements a handful of atomic primitives (insert, load, compare-and-set write,
outbox acknowledgement, due-by-clock queries) and, on the same connection, the worker registry
(:mod:`.workers`) and the meta area (:mod:`.meta`). Every state change goes through
:meth:`JobStore.apply`: load the record, apply a pure rule from :mod:`ojs_celery.lifecycle`,
write it back only if nobody wrote in between, else start over. So the rules live in one place
and the backends only guarantee atomicity and indexing.

Fencing: every write stores a fresh random ``nonce`` in the record, and a compare-and-set
replaces the record only if it still carries the version *and* the nonce of the record the new
one was computed from. A version number can be matched by another record (a job that tried to
take an existing id was published with a snapshot of version 1, as the victim's first version
is); a nonce is this record's alone. The insert's nonce stays in the record as ``origin``, the
proof a message carries that it was published for this record. And a write whose reply was
lost (the connection cut after the write was sent) recognises its own success by its nonce when
it reads the record again, instead of mistaking itself for a lost race.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ParamSpec, TypeVar

from celery.exceptions import ImproperlyConfigured
from pydantic_core import PydanticSerializationError

from .. import lifecycle
from ..entropy import random_hex
from ..envelope import Job, JsonValue
from ..lifecycle import Policy, Record, Transition
from .meta import MetaArea
from .workers import WorkerInfo, WorkerRegistry

_P = ParamSpec("_P")
_T = TypeVar("_T")
logger = logging.getLogger(__name__)

Rule = Callable[[Record], Transition]
#: One compare-and-set write: the new record, the record it replaces (whose version and nonce
#: the store must still hold), the new record's deadlines.
Write = tuple[Record, Record, dict[str, float | None]]
#: One new record and its deadlines.
NewRow = tuple[Record, dict[str, float | None]]


def new_nonce() -> str:
    """A write nonce: 8 random bytes, unguessable and unique in practice (no round trip)."""
    return random_hex(16)


class StoreError(RuntimeError):
    """The store could not be reached or refused an operation."""


class StoreTimeout(StoreError):
    """The store gave no answer within its timeout: asking it again at once would only wait as
    long again, so a call that settles a lost reply does not."""


class StoreErrorReply(StoreError):
    """The store answered the call with an error (Redis: ``OOM``, ``READONLY``, ``NOPERM``;
    SQLite's error, raised in this process): that try is over, nothing of it is still on its
    way, so a read after it shows all it did. Any other :class:`StoreError` of a write may be a
    lost reply: the server may still do the write after a read found nothing (it waited for a
    lock, a synchronous standby, a paused server), so only an answer settles it."""


#: libpq's words for a session it could not open, whatever the server's reason (down, starting
#: up or shutting down, every connection slot taken): ``connection to server at "host", port
#: 5432 failed: FATAL: ...`` (``on socket "..."`` for a unix socket).
_NOT_CONNECTED = re.compile(r"connection to server (?:at|on socket) .*? failed:")


class StoreUncertain(StoreError):
    """The store failed during an insert and could not be asked afterwards whether the insert
    was done, or (``in_flight``) lost the reply to a try of it that it may still do after the
    read that found no record: the job may or may not be stored. (A refused connection cannot
    tell either: an earlier try of the same call, retried by the driver, may have been sent.)

    Look the job up by ``job_id`` later, or repeat the call with that id (an insert sent again
    recognises its own earlier success).
    """

    def __init__(self, job_id: str, error: str = "", batch: int = 1,
                 in_flight: bool = False) -> None:
        self.job_id = job_id
        self.error = error
        #: The jobs of the write (a batch is stored whole or not at all: look up ``job_id``,
        #: its first).
        self.batch = batch
        #: The store was asked and had no record, but a try whose reply was lost may still be
        #: done later (``error`` is that try's).
        self.in_flight = in_flight
        # its arguments, not its message: pickle and Celery's JSON result serializer rebuild
        # an exception from its args
        super().__init__(job_id, error, batch, in_flight)

    def __str__(self) -> str:
        said = f" ({self.error})" if self.error else ""
        if self.in_flight:
            lost = (f"the reply to the job store's write was lost{said}, and a read after it "
                    "found no record, but the server may still do that write (one it holds "
                    "behind a lock, a synchronous standby or a pause)")
            if self.batch > 1:
                return (f"a batch of {self.batch} jobs, the first {self.job_id}: {lost}; the "
                        "batch may or may not be stored, all of it or none (look up its first "
                        "job later)")
            return (f"job {self.job_id}: {lost}; the job may or may not be stored (look it up "
                    "later, or enqueue the same envelope again with this id: it returns the "
                    "job if it was stored)")
        if self.batch > 1:
            return (f"a batch of {self.batch} jobs, the first {self.job_id}: the job store "
                    f"failed during the write{said}; the batch may or may not be stored, all "
                    "of it or none (look up its first job)")
        if "refused" in self.error.lower() or _NOT_CONNECTED.search(self.error):
            # the usual case: the store was down all along (or refused every new session)
            return (f"job {self.job_id}: the job store refused the connection{said}; if it was "
                    "down all along the job is not stored, but it may be if it went down "
                    "during the write (enqueue the same envelope again with this id once the "
                    "store is back: it returns the job if it was stored)")
        return (f"job {self.job_id}: the job store failed during the write and could not be "
                f"asked whether it was done{said}; the job may or may not be stored (look it "
                "up, or enqueue the same envelope again with this id: it returns the job if it "
                "was stored)")


class StoreRefused(StoreError):
    """Nothing was stored, for certain: the store refused what has to come before any write (a
    SQL store's tables could not be made: no permission, a read-only session; a SQLite file
    that cannot be opened at all), or answered the write itself with an error that rolled it
    back (PostgreSQL cancelling a statement that waited past ``statement_timeout`` or
    ``lock_timeout`` for a lock another session holds). So the write is not uncertain, and no
    read is sent to settle it: under a lock that read would wait as long again. (It answers
    for its own try only: after an earlier try of the same insert lost its reply, that try
    may still be done, see :meth:`JobStore._settle_insert`.)"""


class StoreMisconfigured(StoreRefused, ImproperlyConfigured):  # type: ignore[misc]
    """``store_url`` names a store the server refuses every session to, for a reason only a
    change of the configuration mends: a PostgreSQL database that does not exist, a user or
    password the server does not accept. Raised when the first session is refused, before
    anything is written; retrying cannot help (it is Celery's ``ImproperlyConfigured`` too,
    as a bad setting is). The message names the database or user and what to do."""


def answered(failure: StoreError) -> bool:
    """Whether ``failure`` is the store's own answer to the try that raised it (an error
    reply, a refusal): nothing of that try is still on its way to be done after a read.
    Anything else (a connection lost after the write was sent) may be."""
    return isinstance(failure, (StoreErrorReply, StoreRefused))


class DuplicateJob(ValueError):
    """A job with this id exists already."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        super().__init__(job_id)  # its id, not its message, rebuilds it (pickle, Celery's JSON)

    def __str__(self) -> str:
        return f"id: a job with id {self.job_id} exists already (ids must be unique)"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.job_id,))


#: At most this many jobs' unanswered writes are remembered per thread (see
#: ``JobStore.remembering``): a worker retries one job at a time, so this bounds only what is
#: never retried; and at most this many tries of each (all from one version: one landed at most).
UNSETTLED_KEPT = 64
UNSETTLED_PER_OPERATION = 4


#: Seconds a store call waits for the store's answer (and for a new connection) before it fails
#: with :class:`StoreError` (:class:`StoreUncertain` for a write that may have been done): the
#: default of the ``store_timeout`` setting. Without one, a store host that stops answering would
#: hold every caller until the kernel gives up on the connection, a quarter of an hour later.
DEFAULT_TIMEOUT = 10.0


#: A URL's password: ``scheme://user:PASSWORD@`` (up to the netloc's last ``@``), or a query
#: parameter such as ``?password=PASSWORD``.
_SECRETS = re.compile(
    r"(?P<head>\b[a-z][a-z0-9+.-]*://[^\s:/@]*:)[^\s/]*(?P<tail>@)"
    r"|(?P<param>[?&](?:password|passwd|pass|sslpassword)=)[^&#\s]*",
    re.IGNORECASE,
)


def mask_secrets(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``**``, as Celery shows
    broker URLs (kombu's ``maybe_sanitize_url``), query parameters that carry one included.
    For a store's ``repr`` and every message that might quote its URL."""
    return _SECRETS.sub(
        lambda m: f"{m['head']}**@" if m["head"] is not None else f"{m['param']}**", text
    )


class _Remembering:
    """:meth:`JobStore.remembering`'s context (a class: it is entered twice per job)."""

    __slots__ = ("_memory", "_operation", "_outer")

    def __init__(self, memory: threading.local, operation: str) -> None:
        self._memory = memory
        self._operation = operation
        self._outer: str | None = None

    def __enter__(self) -> None:
        memory = self._memory
        pid = os.getpid()
        if getattr(memory, "pid", None) != pid:  # a forked child: not its writes
            memory.pid, memory.jobs = pid, {}
        self._outer = getattr(memory, "operation", None)
        memory.operation = self._operation

    def __exit__(self, *_: object) -> None:
        self._memory.operation = self._outer


def store_message(cause: object, what: str = "") -> str:
    """A store error's one-line message: what failed (if said), the server's or driver's
    exception and its text (psycopg's takes two lines), with any secret masked."""
    said = " ".join(str(cause).split())
    return mask_secrets(f"job store error: {what}{type(cause).__name__}: {said}")


def store_errors(
    is_fault: Callable[[Exception], bool],
    detail: Callable[[Exception], object] = lambda exc: exc,
    is_timeout: Callable[[Exception], bool] = lambda exc: False,
    is_reply: Callable[[Exception], bool] = lambda exc: False,
) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]:
    """A decorator for a backend's operations: an exception that ``is_fault`` recognises as
    its server's or driver's leaves as :class:`StoreError` with the server's message (``detail``
    picks the part that says it) and the original as its cause, so that callers handle one
    exception type whatever the backend; as :class:`StoreTimeout` when ``is_timeout`` says the
    server did not answer in time, as :class:`StoreErrorReply` when ``is_reply`` says it is the
    server's own answer (else it may be a lost reply). :class:`DuplicateJob` keeps its meaning.
    """

    def decorate(method: Callable[_P, _T]) -> Callable[_P, _T]:
        @functools.wraps(method)
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _T:
            try:
                return method(*args, **kwargs)
            except (StoreError, DuplicateJob):
                raise
            except Exception as exc:
                if not is_fault(exc):
                    raise
                message = store_message(detail(exc))
                kind = (StoreTimeout if is_timeout(exc) else
                        StoreErrorReply if is_reply(exc) else StoreError)
                raise kind(message) from exc

        return wrapper

    return decorate


class JobStore(ABC):
    """Where the OJS state of every job lives; see the module docstring.

    One backend holds three parts: the jobs (this class), the worker registry
    (``store.workers``) and the meta area (``store.meta``), each behind its own interface.
    """

    #: Worker records (registration, beats, dead-worker detection).
    workers: WorkerRegistry
    #: Values processes leave for each other (directives, the shutdown drain, the last sweep).
    meta: MetaArea

    #: How many times :meth:`apply` re-reads after losing a compare-and-set race.
    max_conflicts = 50

    def __init__(self, policy: Policy | None = None) -> None:
        self.policy = policy or Policy()
        #: Per thread, the writes whose replies never came, by job and operation (see
        #: :meth:`remembering`).
        self._unsettled = threading.local()

    # ------------------------------------------------------------------ primitives (backends)

    @abstractmethod
    def _insert(self, record: Record, deadlines: dict[str, float | None]) -> bool:
        """Write a new record with version 1; False if the id exists."""

    @abstractmethod
    def _insert_many(self, rows: Sequence[NewRow]) -> str | None:
        """Write new records (with their deadlines), each with version 1, in ONE atomic step:
        all of them and None, or none of them and the id of one that exists already. The ids
        are distinct (the caller checks)."""

    @abstractmethod
    def _load(self, job_id: str) -> Record | None:
        """The record with its current version, or None."""

    @abstractmethod
    def _cas(self, record: Record, previous: Record, deadlines: dict[str, float | None]) -> bool:
        """Replace the record (and its deadline index entries) if it still has the version and
        the nonce of ``previous``; the stored version becomes ``previous.version + 1``."""

    @abstractmethod
    def _ack_dispatch(self, job_id: str, token: int) -> bool:
        """Clear the outbox entry if the record still owes a message for ``token``."""

    @abstractmethod
    def due(self, clock: str, now: float, limit: int) -> list[tuple[str, float]]:
        """``(job id, deadline)`` pairs whose ``clock`` deadline is ``<= now``, earliest first,
        at most ``limit``; costs O(log n + k)."""

    @abstractmethod
    def scan(self, clock: str, cursor: str | None, limit: int) -> tuple[list[str], str | None]:
        """A page of the ids ``clock`` indexes, about ``limit`` of them, from ``cursor`` (None:
        the start); and the cursor of the next page (None: the end). Unlike :meth:`due` the
        order does not follow the deadlines, so writes that move them do not disturb a scan:
        an id indexed for the whole scan is returned at least once (maybe more)."""

    @abstractmethod
    def _delete(self, job_id: str, expected: int) -> bool:
        """Delete the record if its version is ``expected`` (pruning)."""

    @abstractmethod
    def ping(self) -> None:
        """Raise :class:`StoreError` when the store cannot be reached."""

    @abstractmethod
    def clear(self) -> None:
        """Delete everything this store holds (tests, demos)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    # ------------------------------------------------------------------ batch primitives
    # One call for many jobs. These loops are correct for any backend; backends override them
    # to cost one round trip (Redis pipeline) or one transaction (SQL).

    def _load_many(self, job_ids: Sequence[str]) -> list[Record | None]:
        """The records of ``job_ids`` in order (None where a job does not exist)."""
        return [self._load(job_id) for job_id in job_ids]

    def _cas_many(self, writes: Sequence[Write]) -> list[bool]:
        """Independent compare-and-set writes (see :meth:`_cas`): each applies or not on its
        own, whatever the others do; the result says which did."""
        return [self._cas(record, previous, deadlines) for record, previous, deadlines in writes]

    def _ack_dispatch_many(self, acks: Sequence[tuple[str, int]]) -> list[bool]:
        """:meth:`_ack_dispatch` for each ``(job id, token)``."""
        return [self._ack_dispatch(job_id, token) for job_id, token in acks]

    def forget_missing(self, clock: str, job_ids: Sequence[str]) -> int:
        """Take out of ``clock``'s index the ids among ``job_ids`` that have no record (a write
        that failed half way can leave such entries where indexes are kept apart from the
        records, as on Redis); returns how many. Default: none to take out (SQL indexes are
        the records' own columns)."""
        return 0

    def move_due(self, clock: str, moves: Sequence[tuple[str, float, float]]) -> int:
        """Move ``clock``'s index entries to later deadlines: ``(job id, deadline read,
        deadline)`` each, moved only if the entry still holds the deadline read (a write since
        has set its own). For entries a sweep found not due by its rule (written under other
        settings, or by an older version): left in place, a batch of them would be read at the
        head of the index every pass. Returns how many moved."""
        return self._move_due(clock, moves) if moves else 0

    @abstractmethod
    def _move_due(self, clock: str, moves: Sequence[tuple[str, float, float]]) -> int: ...

    def _delete_many(self, deletes: Sequence[tuple[str, int]]) -> list[bool]:
        """:meth:`_delete` for each ``(job id, expected version)``: a pass prunes up to its
        batch at once."""
        return [self._delete(job_id, expected) for job_id, expected in deletes]

    # ------------------------------------------------------------------ shared rules

    def _deadlines(self, record: Record) -> dict[str, float | None]:
        return lifecycle.deadlines(record, self.policy)

    def create(self, job: Job, now: float | None = None) -> Transition:
        """Store a new job (``available`` or ``scheduled``) with its outbox entry."""
        transition, confirm = self.begin_create(job, now)
        confirm()
        return transition

    def begin_create(
        self, job: Job, now: float | None = None
    ) -> tuple[Transition, Callable[[], None]]:
        """Start storing a new job; ``confirm()`` waits for the write and raises
        :class:`DuplicateJob` or :class:`StoreError` if it failed.

        Backends that can send a write without waiting for its reply (Redis) let the caller do
        something in between, such as publishing the job's message: enqueue then costs one
        round trip instead of two.
        """
        transition = self.new_record(job, now)
        record = transition.record
        assert record is not None
        deadlines = self._deadlines(record)
        try:
            written = self._insert_begin(record, deadlines)
        except (StoreUncertain, StoreRefused):
            raise
        except StoreError as failure:
            inserted = self._settle_insert(record, deadlines, failure)
            written = lambda: inserted  # noqa: E731
        record.version = 1  # what it is once written (a message may carry it before confirm)

        def confirm() -> None:
            if not self._insert_settled(record, deadlines, written):
                raise DuplicateJob(job.id)

        return transition, confirm

    def new_record(self, job: Job, now: float | None = None) -> Transition:
        """The transition that creates ``job``, its record given the nonce and origin of the
        insert that will store it (nothing is written)."""
        transition = lifecycle.create(job, time.time() if now is None else now, self.policy)
        assert transition.record is not None
        transition.record.nonce = transition.record.origin = new_nonce()
        return transition

    def insert_new(self, record: Record, deadlines: dict[str, float | None]) -> bool:
        """Write a record that :meth:`new_record` built: False if another job has the id.
        A lost reply is settled as :meth:`begin_create` settles it."""
        return self._insert_settled(record, deadlines, lambda: self._insert(record, deadlines))

    def _insert_settled(
        self, record: Record, deadlines: dict[str, float | None], attempt: Callable[[], bool],
        again: Callable[[], bool] | None = None,
    ) -> bool:
        """``attempt()`` of an insert, or, when it fails with :class:`StoreError` (a lost reply
        or an error reply), whether the insert was done after all: :meth:`_settle_insert`,
        which sends ``again`` (default :meth:`_insert`) if the record is not there."""
        try:
            return attempt()
        except (StoreUncertain, StoreRefused):
            raise
        except StoreError as failure:
            return self._settle_insert(record, deadlines, failure, again)

    def create_many(self, jobs: Sequence[Job], now: float | None = None) -> list[Transition]:
        """Store new jobs, each with its outbox entry, in one atomic step: all of them or none.

        Raises :class:`DuplicateJob` naming an id that exists already or that two of the jobs
        share; then nothing was stored.
        """
        at = time.time() if now is None else now
        seen: set[str] = set()
        for job in jobs:
            if job.id in seen:
                raise DuplicateJob(job.id)
            seen.add(job.id)
        transitions = [lifecycle.create(job, at, self.policy) for job in jobs]
        records = [transition.record for transition in transitions]
        rows = [(record, self._deadlines(record)) for record in records if record is not None]
        for record, _ in rows:
            record.nonce = record.origin = new_nonce()
        if rows:
            try:
                taken = self._insert_many(rows)
            except StoreTimeout as unanswered:  # all or none of it may still be stored
                raise StoreUncertain(rows[0][0].job.id, str(unanswered), batch=len(rows)) \
                    from unanswered
            except (StoreUncertain, StoreRefused):
                raise
            except StoreError as failure:  # a lost reply (the write may be done), an error reply
                taken = self._settle_batch(rows, failure)
            if taken is not None:
                raise DuplicateJob(taken)
        for record, _ in rows:
            record.version = 1
        return transitions

    def _settle_batch(self, rows: Sequence[NewRow], failure: StoreError) -> str | None:
        """Whether a batch insert that failed with ``failure`` was stored, settled as
        :meth:`_settle_insert` settles one insert, on the batch's first job (the batch is
        stored whole or not at all): None when it is stored, else the id another job has.
        Raises the store's refusal when nothing was stored, :class:`StoreUncertain` (naming
        the batch) when the store cannot tell."""
        first, deadlines = rows[0]
        taken: list[str] = []

        def again() -> bool:
            found = self._insert_many(rows)
            if found is not None:
                taken.append(found)
            return found is None

        try:
            stored = self._settle_insert(first, deadlines, failure, again)
        except StoreUncertain as unsure:
            raise StoreUncertain(first.job.id, unsure.error, batch=len(rows),
                                 in_flight=unsure.in_flight) from unsure
        if stored:
            return None
        return taken[0] if taken else first.job.id

    def _settle_insert(
        self, record: Record, deadlines: dict[str, float | None], failure: StoreError,
        insert: Callable[[], bool] | None = None,
    ) -> bool:
        """Whether an insert that failed with ``failure`` (a lost reply, or an error reply)
        was written: a stored record with its origin is this insert's (perhaps changed since
        by a worker); none: send it again (``insert``, by default :meth:`_insert`; a second
        arrival finds its own origin). When that send fails too and a read still finds no
        record, the insert is refused (that :class:`StoreError` is raised, nothing stored)
        only if the store answered every try with an error (:func:`answered`: read-only, out
        of memory, no permission, rolled back); a try whose reply was lost may still be done
        after the read, so then it is :class:`StoreUncertain`, as when the store cannot tell."""
        lost = None if answered(failure) else failure
        current = self._load_or_uncertain(record.job.id)
        if current is None:
            try:
                if insert() if insert is not None else self._insert(record, deadlines):
                    return True
            except StoreTimeout as unanswered:  # it may still arrive and be done
                raise StoreUncertain(record.job.id, str(unanswered)) from unanswered
            except StoreError as refused:
                lost = lost if answered(refused) else refused
                current = self._load_or_uncertain(record.job.id)
                if current is None and lost is not None:
                    raise StoreUncertain(record.job.id, str(lost), in_flight=True) from refused
                if current is None:
                    raise  # every try was answered: nothing stored (the driver error its cause)
                return current.origin == record.origin
            current = self._load_or_uncertain(record.job.id)
        return current is not None and current.origin == record.origin

    def _load_or_uncertain(self, job_id: str) -> Record | None:
        """The record, read to settle an insert; tried twice, because the failure that made
        the insert uncertain often ended the pooled connection the first read takes (a
        session terminated in a failover), and the second gets a new one. Not after a
        :class:`StoreTimeout`: the store is not answering, and would not answer the second."""
        try:
            return self._load(job_id)
        except StoreTimeout as exc:
            raise StoreUncertain(job_id, str(exc)) from exc
        except StoreError:
            pass
        try:
            return self._load(job_id)
        except StoreError as exc:
            raise StoreUncertain(job_id, str(exc)) from exc

    def _insert_begin(
        self, record: Record, deadlines: dict[str, float | None]
    ) -> Callable[[], bool]:
        """:meth:`_insert`, possibly sent now and answered later (default: right away)."""
        inserted = self._insert(record, deadlines)
        return lambda: inserted

    def bury_worker(self, info: WorkerInfo, now: float) -> WorkerInfo | None:
        """Begin the burial of a worker a sweeper declared dead at ``now``: its record as read
        (``info``) becomes its tombstone (:meth:`WorkerRegistry.bury`), which
        ``workers.stale`` returns to every sweeper until :meth:`remove_worker` (``buried``)
        ends the burial, so that a pass the store failed half way is resumed. Returns the
        tombstone, or None if another sweeper began it first (or the worker is gone)."""
        tombstone = dataclasses.replace(info, buried_at=now, burial=new_nonce())
        try:
            won = self.workers.bury(tombstone)
        except StoreTimeout:
            raise  # not answering: a read would wait as long again
        except StoreError as failure:  # a lost reply (redis-py's own tries of it included)
            won = self._settle_burial(tombstone, failure)
        return tombstone if won else None

    def _settle_burial(self, tombstone: WorkerInfo, failure: StoreError) -> bool:
        """Whether a burial's claim that failed with ``failure`` (a lost reply) was done: the
        record is this very tombstone (its nonce). Raises ``failure`` when the record is still
        the worker's (the write was lost: the next pass claims it again) or cannot be read."""
        try:
            found = self.workers.get(tombstone.worker_id)
        except StoreError as unread:
            raise failure from unread
        if found is not None and not found.buried:
            raise failure
        return found is not None and found.burial == tombstone.burial

    def remove_worker(self, worker_id: str, job_ids: Iterable[str] = (),
                      buried: bool = False) -> bool:
        """Remove a worker's record and what was left for it in the meta area (a directive,
        the drain's marks of ``job_ids``): at its shutdown, or when a sweeper has recovered
        the jobs of a worker it declared dead (``buried``: only its tombstone, not the record
        of a worker that came back meanwhile). False if there was no record to remove."""
        try:
            removed = self.workers.remove(worker_id, buried)
        except StoreTimeout:
            raise  # not answering: a read would wait as long again
        except StoreError as failure:  # a lost reply (redis-py's own tries of it included)
            removed = self._settle_removal(worker_id, failure, buried)
        if removed:
            try:  # leftovers are small: their loss must not fail the worker's shutdown
                self.meta.forget_worker(worker_id, job_ids)
            except StoreError as exc:
                logger.warning("ojs_celery: worker %s is removed but what was left for it "
                               "stays in the store's meta area: %s", worker_id, exc)
        return removed

    def _settle_removal(self, worker_id: str, failure: StoreError, buried: bool) -> bool:
        """Whether a worker's removal that failed with ``failure`` (a lost reply) was done:
        its record is gone (taken as this caller's removal: a removal has no other effect).
        False if ``buried`` and the record is the worker's again (it came back). Raises
        ``failure`` when the record is still there (a burial is resumed by the next pass) or
        cannot be read."""
        try:
            found = self.workers.get(worker_id)
        except StoreError as unread:
            raise failure from unread
        if found is None:
            return True
        if buried and not found.buried:
            return False
        raise failure

    def get(self, job_id: str) -> Job | None:
        record = self._load(job_id)
        return None if record is None else record.job

    def get_record(self, job_id: str) -> Record | None:
        return self._load(job_id)

    def get_records(self, job_ids: Sequence[str]) -> list[Record | None]:
        """Several records in one batched read (None where a job does not exist)."""
        return self._load_many(job_ids) if job_ids else []

    def apply(self, job_id: str, rule: Rule, hint: Record | None = None) -> Transition:
        """Apply ``rule`` with compare-and-set, re-reading on conflict.

        ``hint`` is a record the caller already holds (saves a read when nobody wrote since).

        A write that fails with :class:`StoreError` may have committed with its reply lost:
        the record is read again, and if it carries that write's nonce the write is done and
        its transition returned; a second failure is raised. A write that got no answer in
        time (:class:`StoreTimeout`) is raised at once; inside :meth:`remembering` it is also
        remembered, since the store may still run it (see there). A write the store refused
        (:class:`StoreRefused`: rolled back) is raised at once and not remembered.
        """
        key = self._remembered_as(job_id)
        lost = self._unsettled_take(key) if key is not None else {}
        try:
            return self._apply(job_id, rule, hint, lost)
        except BaseException:
            if lost and key is not None:
                self._unsettled_keep(key, lost)
            raise

    def remembering(self, operation: str) -> _Remembering:
        """A context within which this thread's :meth:`apply` remembers the writes that got no
        answer in time (the store may still run them) under the job and ``operation`` (an
        attempt's start, its outcome); a later ``apply`` of the same job and operation in this
        thread and process whose rule the record refuses because it carries such a write's
        nonce returns that write's transition, as if its reply had come. So a worker that
        tries an unanswered outcome or start again knows it as its own when the store did run
        it. Only the same operation's retries: another caller's refusal stays a refusal."""
        return _Remembering(self._unsettled, operation)

    def _apply(
        self, job_id: str, rule: Rule, hint: Record | None, lost: dict[str, Transition]
    ) -> Transition:
        """:meth:`apply`; ``lost``: the writes whose replies were lost, by nonce (this call's
        and the thread's earlier unsettled ones)."""
        record = hint
        failed = False
        for _ in range(self.max_conflicts):
            if record is None:
                record = self._load(job_id)
                if record is None:
                    return lifecycle.rejected("unknown_job")
            transition = rule(record)
            transition.previous = record
            if transition.record is None:
                mine = lost.get(record.nonce) or _extended_start(record, lost)
                if mine is not None:  # refused because our own write, unanswered, was done
                    return mine
                if hint is not None and record is hint:
                    record = None  # a stale hint may be why: decide on fresh data
                    hint = None
                    continue
                return transition
            new = transition.record
            new.nonce = new_nonce()
            try:
                won = self._cas(new, record, self._deadlines(new))
            except StoreTimeout:
                new.version = record.version + 1
                lost[new.nonce] = transition
                raise  # not answering: a read to settle it would wait as long again
            except StoreRefused:
                raise  # rolled back: nothing to settle, and trying again at once would wait
            except StoreError:
                if failed:
                    raise
                failed = True
                won = False
                new.version = record.version + 1
                lost[new.nonce] = transition
            if won:
                new.version = record.version + 1
                return transition
            record = None
            hint = None
        raise StoreError(f"job {job_id}: too many concurrent writers, gave up")

    def _remembered_as(self, job_id: str) -> tuple[str, str] | None:
        """The key of ``job_id``'s unanswered writes in :meth:`remembering`, else None."""
        memory = self._unsettled
        operation: str | None = getattr(memory, "operation", None)
        if operation is None or getattr(memory, "pid", None) != os.getpid():
            return None
        return job_id, operation

    def _unsettled_take(self, key: tuple[str, str]) -> dict[str, Transition]:
        """The remembered unanswered writes under ``key`` (see :meth:`remembering`), forgotten
        here: :meth:`apply` keeps them again if it fails once more."""
        kept: dict[tuple[str, str], dict[str, Transition]] = self._unsettled.jobs
        return kept.pop(key, {})

    def _unsettled_keep(self, key: tuple[str, str], lost: dict[str, Transition]) -> None:
        while len(lost) > UNSETTLED_PER_OPERATION:  # the oldest tries: one at most landed
            del lost[next(iter(lost))]
        kept: dict[tuple[str, str], dict[str, Transition]] = self._unsettled.jobs
        kept[key] = lost
        while len(kept) > UNSETTLED_KEPT:  # the oldest: their retries are long over
            del kept[next(iter(kept))]

    def apply_many(self, job_ids: Sequence[str], rule: Rule) -> list[Transition | None]:
        """:meth:`apply` for several jobs with one batched read and one batched write.

        An entry is None where that job's compare-and-set lost a race: the caller applies
        the rule to it again with :meth:`apply` (which re-reads). Every other entry is what
        :meth:`apply` would have returned: each job still changes by one compare-and-set, so
        concurrent callers never apply a rule twice. A batch that fails with a lost reply is
        read back (:meth:`_settle_many`): a job that carries its write is written, as in
        :meth:`apply`, and the others are None.
        """
        results: list[Transition | None] = []
        writes: list[Write] = []
        written: list[int] = []
        for index, record in enumerate(self.get_records(job_ids)):
            if record is None:
                results.append(lifecycle.rejected("unknown_job"))
                continue
            transition = rule(record)
            transition.previous = record
            results.append(transition)
            if transition.record is not None:
                transition.record.nonce = new_nonce()
                writes.append((transition.record, record, self._deadlines(transition.record)))
                written.append(index)
        if writes:
            try:
                wins = self._cas_many(writes)
            except (StoreTimeout, StoreRefused):
                raise  # not answering (a read would wait as long again), or rolled back
            except StoreError as failure:
                wins = self._settle_many(writes, failure)
            for index, won, (new, previous, _) in zip(written, wins, writes, strict=True):
                if won:
                    new.version = previous.version + 1
                else:
                    results[index] = None
        return results

    def _settle_many(self, writes: Sequence[Write], failure: StoreError) -> list[bool]:
        """Which writes of a batch that failed with ``failure`` were done: each job whose
        record carries its write's nonce (a lost reply, redis-py's own tries of it included;
        on Redis, where a batch is not one transaction, the writes before one the server
        refused). The others count as not written: the caller decides them again on fresh
        data. Raises ``failure`` when none was done, or the batch cannot be read back.

        Without this, a sweeper whose batch was written but not answered ended its pass and
        never carried out what it wrote (the events, the end of the running attempt, the
        outcome in Celery's result backend), and no later pass would: the jobs were no
        longer due."""
        try:
            current = self._load_many([new.job.id for new, _, _ in writes])
        except StoreError as unread:
            raise failure from unread
        wins = [record is not None and record.nonce == new.nonce
                for record, (new, _, _) in zip(current, writes, strict=True)]
        if not any(wins):
            raise failure
        return wins

    def ack_dispatch(self, job_id: str, token: int) -> bool:
        return self._ack_dispatch(job_id, token)

    def ack_dispatch_many(self, acks: Sequence[tuple[str, int]]) -> list[bool]:
        """Clear several outbox entries at once (``(job id, token)`` pairs)."""
        return self._ack_dispatch_many(acks) if acks else []

    def start(
        self,
        job_id: str,
        token: int,
        worker_id: str,
        now: float | None = None,
        hint: Record | None = None,
        origin: str | None = None,
        carries: Callable[[Job], bool] | None = None,
    ) -> Transition:
        """Start the attempt a message with ``token`` asks for. ``hint``: the record as the
        message was published with it (one write instead of read + write when current).

        ``origin`` (else the hint's): the origin of the record the message was published for.
        A record with another origin is another job that has the same id (a producer tried to
        take an existing id): the message is rejected as ``foreign`` and the record untouched;
        so is one that ``carries`` says is not the job's (its task, its arguments).
        """
        at = time.time() if now is None else now
        proof = origin if origin is not None else None if hint is None else hint.origin

        return self.apply(
            job_id,
            lambda r: lifecycle.start(r, token, worker_id, at, self.policy, proof, carries),
            hint,
        )

    def heartbeat(
        self,
        job_id: str,
        attempt: int,
        worker_id: str,
        *,
        stall: bool = True,
        progress: float | None = None,
        data: JsonValue = None,
        checkpoint: JsonValue = None,
        now: float | None = None,
        hint: Record | None = None,
    ) -> Transition:
        at = time.time() if now is None else now
        return self.apply(
            job_id,
            lambda r: lifecycle.heartbeat(
                r, attempt, worker_id, at, stall=stall, progress=progress, data=data,
                checkpoint=checkpoint,
            ),
            hint,
        )

    def extend(
        self, job_id: str, token: int, worker_id: str, *, stall: bool, now: float | None = None
    ) -> Transition:
        """A worker beat listing the attempt that ``token`` started: extend its reservation
        (and its stall clock when ``stall``, i.e. unless the job wants handler heartbeats)."""
        at = time.time() if now is None else now
        return self.apply(
            job_id, lambda r: lifecycle.extend(r, token, worker_id, at, stall=stall)
        )

    def complete(
        self,
        job_id: str,
        attempt: int,
        worker_id: str,
        result: JsonValue,
        now: float | None = None,
        hint: Record | None = None,
    ) -> Transition:
        at = time.time() if now is None else now
        return self.apply(
            job_id, lambda r: lifecycle.complete(r, attempt, worker_id, result, at), hint
        )

    def fail(
        self,
        job_id: str,
        attempt: int,
        worker_id: str | None,
        error: dict[str, JsonValue],
        *,
        delay: float | None = None,
        retryable: bool = True,
        now: float | None = None,
        hint: Record | None = None,
    ) -> Transition:
        at = time.time() if now is None else now
        return self.apply(
            job_id,
            lambda r: lifecycle.fail(
                r, attempt, worker_id, error, at, delay=delay, retryable=retryable,
                policy=self.policy,
            ),
            hint,
        )

    def fail_token(
        self,
        job_id: str,
        token: int,
        worker_id: str,
        error: dict[str, JsonValue],
        now: float | None = None,
    ) -> Transition:
        """Fail the attempt that ``token`` started on ``worker_id`` (the main process knows the
        message, not the attempt number)."""
        at = time.time() if now is None else now
        return self.apply(
            job_id, lambda r: lifecycle.fail_token(r, token, worker_id, error, at, self.policy)
        )

    def cancel(self, job_id: str, now: float | None = None) -> Transition:
        at = time.time() if now is None else now
        return self.apply(job_id, lambda r: lifecycle.cancel(r, at))

    def expire_ttl(self, job_id: str, now: float | None = None) -> Transition:
        at = time.time() if now is None else now
        return self.apply(job_id, lambda r: lifecycle.expire_ttl(r, at, self.policy))

    def expire_total(self, job_id: str, now: float | None = None) -> Transition:
        at = time.time() if now is None else now
        return self.apply(job_id, lambda r: lifecycle.expire_total(r, at, self.policy))

    def prune(self, now: float | None = None, limit: int = 500) -> int:
        """Delete terminal jobs whose retention has passed; returns how many, at most
        ``limit``. Fewer than ``limit`` means that no more readable job is due (a sweep's
        pruning goes on while the batches come back full).

        A record among them that cannot be read (corrupt, or a field another version wrote
        that this one cannot decode) is passed over: see :meth:`_put_off_unreadable`. Its
        place in the batch goes to the next due entries, read at most :data:`PRUNE_READ_PAST`
        × ``limit`` entries a call, so that a run of such records does not cut a pass short.
        An entry whose record this store's own ``retention`` setting keeps longer (written
        under other settings) is moved to the deadline the record gives, as a sweep moves the
        not-due entries of its other clocks: at the head of the index, a batch of them would
        stop the pruning behind them on every pass. A store error (an outage) is raised, as
        always."""
        at = time.time() if now is None else now
        seen: set[str] = set()
        readable = 0
        expired: list[tuple[str, int]] = []
        missing: list[str] = []
        later: list[tuple[str, float, float]] = []  # entries this store's settings say are early
        while readable < limit and len(seen) < PRUNE_READ_PAST * limit:
            wanted = limit - readable
            due = [entry for entry in self.due("retention", at, len(seen) + wanted)
                   if entry[0] not in seen][:wanted]
            if not due:
                break
            seen.update(job_id for job_id, _ in due)
            unreadable: list[tuple[str, float, Exception]] = []
            for (job_id, read_at), record in zip(due, self._read_each(due), strict=True):
                if isinstance(record, Exception):
                    unreadable.append((job_id, read_at, record))
                    continue
                readable += 1
                if record is None:
                    missing.append(job_id)
                    continue
                deadline = self._deadlines(record)["retention"]
                if deadline is not None and deadline <= at:
                    expired.append((job_id, record.version))
                elif deadline is not None and deadline > read_at:
                    later.append((job_id, read_at, deadline))
            if not unreadable:
                break  # the batch was read whole: ``due`` had no more to give
            self._put_off_unreadable(unreadable, at)
        if missing:
            self.forget_missing("retention", missing)
        if later:  # as a sweep does for its other clocks (:meth:`move_due`)
            self.move_due("retention", later)
        return sum(self._delete_many(expired)) if expired else 0

    def _read_each(self, due: Sequence[tuple[str, float]]) -> list[Record | Exception | None]:
        """The records of ``due`` in one batched read; when one of them cannot be decoded
        (which fails the whole batch), one by one, with the error in place of each record
        that cannot be. A :class:`StoreError` is raised: an outage, no record's fault."""
        job_ids = [job_id for job_id, _ in due]
        try:
            return list(self.get_records(job_ids))
        except StoreError:
            raise
        except Exception:  # one record spoils the batch: go job by job to find it
            pass
        records: list[Record | Exception | None] = []
        for job_id in job_ids:
            try:
                records.append(self.get_record(job_id))
            except StoreError:
                raise
            except Exception as exc:
                records.append(exc)
        return records

    def _put_off_unreadable(self, unreadable: Sequence[tuple[str, float, Exception]],
                            now: float) -> None:
        """Records due for pruning that cannot be read: each is logged (a WARNING naming the
        job and the error) and its retention index entry moved :data:`UNREADABLE_RETRY`
        seconds past ``now``; the record itself is left alone.

        Not deleted: an index entry alone does not say the job may go. In a rolling deploy a
        newer version may have written the record, live and in a format this version cannot
        read, and a deletion could not be undone; a corrupt record is for an operator to look
        at. Not left where it is: at the head of the index it would stop the pruning behind it
        on every pass (the store then grows without bound). Moved by a bounded delay, so it
        is read again later (by then a version that reads it may prune it, or an operator
        mended it), once per :data:`UNREADABLE_RETRY` rather than every pass. The move is the
        one a sweep makes for entries found not due (:meth:`move_due`: only if the entry
        still holds the deadline read, so a write since keeps its own)."""
        for job_id, _, exc in unreadable:  # one line each: a decoder's message has several
            logger.warning("ojs_celery: could not read job %s to prune it (retention passed); "
                           "left in the store, tried again in %.0fs: %s: %s", job_id,
                           UNREADABLE_RETRY, type(exc).__name__,
                           " | ".join(line.strip() for line in str(exc).splitlines()))
        self.move_due("retention", [(job_id, read_at, now + UNREADABLE_RETRY)
                                    for job_id, read_at, _ in unreadable])


#: How long a record that cannot be read waits before pruning tries it again (see
#: ``JobStore._put_off_unreadable``): an hour, so that it warns once an hour, not every pass.
UNREADABLE_RETRY = 3600.0
#: How many batches' worth of retention entries one ``prune`` reads past unreadable records.
PRUNE_READ_PAST = 10


def _extended_start(record: Record, lost: dict[str, Transition]) -> Transition | None:
    """The unanswered write among ``lost`` that started the attempt ``record`` holds, which
    its owner has written since (the worker's beat extends an attempt of a message it holds:
    the record no longer carries the start's nonce), as a transition to ``record``; else None.

    Only an active attempt: its owner alone writes it (extend, heartbeat), and those writes
    keep the state, attempt, token, worker and start time, which together name one start
    (another start of the same token is refused, and its time would differ). A terminal or
    retryable record is written by others too (a sweeper's recovery), so there only the
    nonce tells."""
    if record.job.state != "active":
        return None
    for transition in lost.values():
        new = transition.record
        started = any(name == "job.started" for name, _ in transition.events)
        if (started and new is not None and new.origin == record.origin
                and new.worker_id == record.worker_id and new.token == record.token
                and new.job.attempt == record.job.attempt
                and new.job.started_at == record.job.started_at):
            return dataclasses.replace(transition, record=record)
    return None


# ---------------------------------------------------------------------- row codec (all backends)

RECORD_FIELDS = (
    "version",
    "token",
    "worker_id",
    "heartbeat_at",
    "extended_at",
    "dispatch_due",
    "promote_at",
    "dead_letter",
    "nonce",
    "origin",
)


def encode_job(job: Job) -> str:
    """The job as stored: compact OJS JSON (system fields included), as ``Job.to_json``.

    pydantic's own JSON writer does it several times faster and decodes to the same job, with
    one exception: it writes NaN and infinities as ``null``. So a text with a ``null`` in it
    (rare: JSON nulls inside args, result or extensions), or one pydantic cannot write (a lone
    surrogate), is made by ``to_json`` instead, which fails or succeeds as it always did.
    """
    try:
        text = job.model_dump_json(by_alias=True, exclude_none=True)
    except PydanticSerializationError:
        return job.to_json()
    return job.to_json() if "null" in text else text


def decode_job(text: str | bytes) -> Job:
    return Job.model_validate_json(text)
