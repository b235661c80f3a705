"""The job store on Redis: one hash per job, one sorted set per clock, one Lua script per write.

Layout (``P`` is the prefix): ``P:job:{id}`` is a hash with ``data`` (the job's JSON), ``state``,
the fields of :data:`~ojs_celery.store.base.RECORD_FIELDS` (``""`` stands for None) and
``indexed`` (which clocks' sets hold the id, so that a write takes it out of only those; see
``record.lua``);
``P:due:{clock}`` is a sorted set of job ids scored by that clock's deadline; ``P:worker:{id}``
is a hash whose ``data`` is the worker's JSON, ``P:workers`` a sorted set of worker ids by last
beat (a tombstone's at ``BURIED``: see ``bury_worker.lua``; ``P:removed-worker:{id}``, for a
few minutes, the nonce of the worker's removal: see ``remove_worker.lua``), and ``P:meta`` a
hash. Every write is one ``EVALSHA``, so the hash and the deadline index change together,
atomically, in one round trip; reads are one command. The batch primitives send many of those
in one pipeline (one round trip, each command still atomic on its own). The scripts are the
``*.lua`` files beside this module, read once per process.
"""

from __future__ import annotations

import functools
import json
import re
import zlib
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import redis
from redis.commands.core import Script
from redis.exceptions import AuthenticationWrongNumberOfArgsError, NoPermissionError, NoScriptError
from redis.retry import Retry

from .. import compat
from ..forking import forget_in_children
from ..lifecycle import CLOCKS, Policy, Record
from .base import (
    DEFAULT_TIMEOUT,
    RECORD_FIELDS,
    JobStore,
    NewRow,
    StoreMisconfigured,
    Write,
    decode_job,
    encode_job,
    mask_secrets,
    new_nonce,
    store_errors,
    store_message,
)
from .meta import MetaArea
from .redis_lane import MISSED, Lane
from .workers import BURIED, WorkerInfo, WorkerRegistry

__all__ = ["RedisMetaArea", "RedisStore", "RedisWorkerRegistry"]

#: Record fields written by every write script, in ARGV order (``version`` is managed in Lua).
_FIELDS = tuple(name for name in RECORD_FIELDS if name != "version")


#: The scripts that write a record (they start with ``record.lua``).
_RECORD_SCRIPTS = ("insert", "insert_many", "insert_push", "cas")


def _lua(name: str) -> str:
    """The text of ``name.lua`` in this package."""
    return resources.files(__package__).joinpath(f"{name}.lua").read_text(encoding="utf-8")


@functools.cache
def script(name: str) -> str:
    """A script as Redis runs it, read once per process. The scripts that write a record get
    ``record.lua`` (the record's argument layout and helpers) in front."""
    text = _lua(name)
    if name in _RECORD_SCRIPTS:
        text = _record_prelude() + "\n" + text
    return text


@functools.cache
def _record_prelude() -> str:
    """``record.lua``, after checking that its field list is the one :meth:`RedisStore._args`
    writes (one list in Python, one in Lua: they must not drift apart), with the clocks'
    fingerprint in front (``CLOCKS_ID``: a record's ``indexed`` mask is read by position, so a
    mask written for another list of clocks is not trusted)."""
    text = _lua("record")
    found = re.search(r"local RECORD_FIELDS = \{([^}]*)\}", text)
    fields = tuple(re.findall(r"'(\w+)'", found.group(1))) if found else ()
    if fields != _FIELDS:
        raise RuntimeError(f"record.lua lists the fields {fields}, the store writes {_FIELDS}")
    return f"local CLOCKS_ID = '{CLOCKS_ID}'\n{text}"


#: The list of clocks whose sorted sets the scripts index, as a short word (see record.lua).
CLOCKS_ID = format(zlib.crc32(",".join(CLOCKS).encode()), "08x")


#: Every error of Redis or of redis-py: a lost connection, and every error reply (``OOM`` under
#: ``maxmemory`` with ``noeviction``, ``READONLY`` on a replica, ``NOPERM`` from an ACL,
#: ``MISCONF``; ``LOADING`` from a server still reading its data, which redis-py raises as a
#: connection error), which is the server's answer (:class:`~.base.StoreErrorReply`: the
#: command is over or was never run). The connection that carried an error reply stays usable.
#: (At the first session, a refusal only a change of configuration mends, ``NOPERM`` included,
#: is :class:`~.base.StoreMisconfigured` instead: see :class:`FirstSession` and :func:`_call`.)
_wrap_errors = store_errors(lambda exc: isinstance(exc, (redis.RedisError, OSError)),
                            is_timeout=lambda exc: isinstance(exc, redis.TimeoutError),
                            is_reply=lambda exc: isinstance(
                                exc, (redis.ResponseError, redis.BusyLoadingError)))


_P = ParamSpec("_P")
_T = TypeVar("_T")

#: The words for a server that asks for a password the URL does not give: ``NOAUTH
#: Authentication required`` (redis-py 5), the refused ``HELLO`` redis-py 8 sends first, and
#: the protocol error Redis answers (and closes the connection with) when an unauthenticated
#: client sends a command of more than a few arguments, such as the store's scripts (redis-py 5,
#: whose first command it is: a ``ResponseError``).
_NO_PASSWORD = re.compile(r"Authentication required|must be called with the client already "
                          r"authenticated|Protocol error: unauthenticated (?:multi)?bulk",
                          re.IGNORECASE)
#: ... and for a password given to a server that has none (redis-py 5; 8 lets it pass).
_PASSWORD_UNASKED = re.compile(r"without any password configured|no password is set",
                               re.IGNORECASE)


class FirstSession:
    """What the Redis store's first session tells (one per store, shared by its jobs, worker
    registry and meta area): until the server has answered one of the store's commands, a
    refusal that only a change of ``store_url`` (or of the server's configuration) mends is
    :class:`~.base.StoreMisconfigured`, naming the user or the database and what to do: a
    password or user the server does not accept (redis-py's ``AuthenticationError``, a
    ``ConnectionError`` to it, retried as an outage), a database number the server does not
    have (``DB index is out of range`` at ``SELECT``), an ACL user without permission for the
    store's commands or keys (``NOPERM``). A refusal after an answer is an ordinary
    :class:`~.base.StoreError`, as the PostgreSQL store's is; a server that is down (the
    connection refused) is never one of these, and leaves the first session open. The password
    is never kept here, nor said."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        kwargs = client.connection_pool.connection_kwargs
        path = kwargs.get("path")
        self.server = (f"unix:{path}" if path
                       else f"{kwargs.get('host') or 'localhost'}:{kwargs.get('port') or 6379}")
        self.db = int(kwargs.get("db") or 0)
        self.user = str(kwargs.get("username") or "default")
        self.password_given = kwargs.get("password") is not None
        self.prefix = prefix
        #: The server has answered one of the store's commands: refusals are not classified.
        self.answered = False

    def refusal(self, error: BaseException) -> StoreMisconfigured | None:
        """The :class:`~.base.StoreMisconfigured` for ``error``, redis-py's exception at the
        first session, when only a change of configuration mends it; else None."""
        text = str(error)
        server, user = f"the Redis server at {self.server}", f'user "{self.user}"'
        unauthenticated = not self.password_given and _NO_PASSWORD.search(text) is not None
        if unauthenticated or isinstance(
                error, (redis.AuthenticationError, AuthenticationWrongNumberOfArgsError)):
            if unauthenticated:
                rule = (f"{server} asks for a password and the URL gives none: give the "
                        f"password of {user} (redis://{self.user}:PASSWORD@host:port/{self.db})")
            elif self.password_given and _PASSWORD_UNASKED.search(text):
                rule = (f"{server} has no password for {user} and the URL gives one: give "
                        "none, or set it on the server (requirepass, or the user's ACL)")
            else:
                given = "the URL's password" if self.password_given else "no password"
                rule = (f"{server} does not accept {user} with {given} (a wrong password, or "
                        "a user it does not know or has disabled): give the right user and "
                        "password")
        elif isinstance(error, NoPermissionError):
            rule = (f"{user} has no permission on {server} for the job store's commands or "
                    f'keys: grant it the keys "{self.prefix}:*" and the commands of reads, '
                    "writes, scripts and transactions in its ACL (ACL SETUSER "
                    f"{self.user} ~{self.prefix}:* +@read +@write +@scripting +@transaction "
                    "+@connection), or name a user that has them")
        elif "DB index is out of range" in text or "Invalid Database" in text:
            rule = (f"{server} has no database {self.db} (its databases setting allows "
                    "fewer): name one it has (numbered from 0)")
        else:
            return None
        return StoreMisconfigured(f"ojs.store_url: {rule} ({store_message(error)})")


class _Sessioned(Protocol):
    _session: FirstSession


_S = TypeVar("_S", bound=_Sessioned)


def _call(method: Callable[Concatenate[_S, _P], _T]) -> Callable[Concatenate[_S, _P], _T]:
    """A decorator for the store's operations: :data:`_wrap_errors`, and before that, while
    the first session is open (:class:`FirstSession`), redis-py's refusal that only a change
    of configuration mends as :class:`~.base.StoreMisconfigured`. A call that returns has had
    the server's answer (the one that sends without reading, :meth:`RedisStore._insert_begin`,
    waits for it in the first session): it ends the first session."""

    @functools.wraps(method)
    def first(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        session = self._session
        if session.answered:
            return method(self, *args, **kwargs)
        try:
            result = method(self, *args, **kwargs)
        except redis.RedisError as exc:
            refusal = session.refusal(exc)
            if refusal is not None:
                raise refusal from exc
            raise
        session.answered = True
        return result

    return _wrap_errors(first)


def _num(value: float | None) -> str:
    """A float as Redis stores it exactly (``repr`` round-trips); None as ``""``."""
    return "" if value is None else repr(float(value))


def _float(value: str | None) -> float | None:
    return None if value is None or value == "" else float(value)


def _record(fields: dict[str, str]) -> Record | None:
    """A job hash as the store wrote it (None: no such job)."""
    if not fields or "data" not in fields:
        return None
    return Record(
        job=decode_job(fields["data"]),
        token=int(fields.get("token") or 1),
        version=int(fields.get("version") or 0),
        worker_id=fields.get("worker_id") or None,
        heartbeat_at=_float(fields.get("heartbeat_at")),
        extended_at=_float(fields.get("extended_at")),
        dispatch_due=_float(fields.get("dispatch_due")),
        promote_at=_float(fields.get("promote_at")),
        dead_letter=fields.get("dead_letter") == "1",
        nonce=fields.get("nonce") or "",
        origin=fields.get("origin") or "",
    )


def _escape_glob(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


class RedisStore(JobStore):
    """Job store on Redis; see the module docstring.

    redis-py's connection pool notices a fork (it compares pids) and opens fresh connections in
    the child, so a store used before Celery's prefork pool forks keeps working after; the
    pool's locks are replaced in the child at the fork (:meth:`forget_parent`), since a parent
    thread may hold them then.
    """

    def __init__(self, url: str, policy: Policy | None = None, prefix: str = "ojs",
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(policy)
        #: The URL without its password (the client keeps the real one).
        self.url = mask_secrets(url)
        self.prefix = prefix
        # Few, quick retries: a store call should fail fast (StoreError) when Redis is down.
        # A lost connection is retried; a server that stopped answering (a timeout) is not: it
        # would only make the caller wait ``timeout`` again. The URL's own ``socket_timeout``
        # and ``socket_connect_timeout`` win over ``timeout`` (redis-py lets them).
        self.client: redis.Redis = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(compat.jitter_backoff(base=0.01, cap=0.2), retries=2,
                        supported_errors=(redis.ConnectionError,)),
        )
        self._job_prefix = f"{prefix}:job:"
        self._due_keys = {clock: f"{prefix}:due:{clock}" for clock in CLOCKS}
        self._all_due_keys = [self._due_keys[clock] for clock in CLOCKS]
        self._insert_script = self.client.register_script(script("insert"))
        self._insert_many_script = self.client.register_script(script("insert_many"))
        self._insert_push_script = self.client.register_script(script("insert_push"))
        self._cas_script = self.client.register_script(script("cas"))
        self._ack_script = self.client.register_script(script("ack_dispatch"))
        self._delete_script = self.client.register_script(script("delete"))
        self._forget_script = self.client.register_script(script("forget"))
        self._move_due_script = self.client.register_script(script("move_due"))
        self._lane = Lane(self.client)
        #: Shared with the worker registry and the meta area: the first answer of any of them
        #: ends the first session (see :class:`FirstSession`).
        self._session = FirstSession(self.client, prefix)
        self.workers = RedisWorkerRegistry(self.client, prefix, self._session)
        self.meta = RedisMetaArea(self.client, prefix, self._session)
        forget_in_children(self)

    def forget_parent(self) -> None:
        """In a forked child: the client's pool resets itself at its first use here (it
        compares pids), under locks that a thread of the parent may have held at the fork (the
        worker's beat thread uses this store while Celery's prefork pool forks a replacement
        child): give it fresh ones first (see :func:`ojs_celery.compat.forget_pool_locks`)."""
        compat.forget_pool_locks(self.client.connection_pool)

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------ record codec

    def _job_keys(self, job_id: str) -> list[str]:
        """KEYS of the insert, compare-and-set and delete scripts: the job's hash, then every
        clock's sorted set in CLOCKS order."""
        return [self._job_prefix + job_id, *self._all_due_keys]

    def _args(self, record: Record, version: int, deadlines: dict[str, float | None]) -> list[str]:
        job = record.job
        record.written_json = encode_job(job)
        return [
            job.id, str(version), record.written_json, job.state,
            str(record.token), record.worker_id or "", _num(record.heartbeat_at),
            _num(record.extended_at), _num(record.dispatch_due), _num(record.promote_at),
            "1" if record.dead_letter else "0", record.nonce, record.origin,
            *[_num(deadlines.get(clock)) for clock in CLOCKS],
        ]

    def _cas_args(
        self, record: Record, previous: Record, deadlines: dict[str, float | None]
    ) -> list[str]:
        """The compare-and-set script's ARGV: the new record, then the nonce it replaces."""
        args = self._args(record, previous.version, deadlines)
        args.append(previous.nonce)
        return args

    # ------------------------------------------------------------------ job primitives

    @_call
    def _insert(self, record: Record, deadlines: dict[str, float | None]) -> bool:
        keys = self._job_keys(record.job.id)
        return bool(self._insert_script(keys, self._args(record, 1, deadlines)))

    @_call
    def _insert_begin(
        self, record: Record, deadlines: dict[str, float | None]
    ) -> Callable[[], bool]:
        """Send the insert script now, read its answer when asked. Not in the first session:
        its refusal (``NOPERM``) is a configuration error, to be said before enqueue publishes
        a message naming a job that was never stored."""
        if not self._session.answered:
            inserted = self._insert(record, deadlines)
            return lambda: inserted
        keys = self._job_keys(record.job.id)
        args = self._args(record, 1, deadlines)
        answer = self._lane.send("EVALSHA", self._insert_script.sha, len(keys), *keys, *args)
        if answer is None:
            inserted = self._insert(record, deadlines)  # redis-py's retries, then StoreError
            return lambda: inserted
        return functools.partial(self._confirm_insert, answer, record, deadlines)

    @_call
    def _confirm_insert(
        self, answer: Callable[[], Any], record: Record, deadlines: dict[str, float | None]
    ) -> bool:
        """The reply to an insert :meth:`_insert_begin` sent. A lost one (or none in time)
        leaves as :class:`~.base.StoreError`, settled as every insert's is (a read, then the
        script sent again: :meth:`~.base.JobStore._settle_insert`), which remembers that this
        try may still be done."""
        done = answer()
        if done is MISSED:
            return self._insert(record, deadlines)  # script flushed: load and retry
        return bool(done)

    def insert_args(self, record: Record, deadlines: dict[str, float | None]) -> list[str]:
        """The record's arguments to an insert, encoded now (the job's JSON then also serves
        the message's snapshot, see :attr:`Record.written_json`): for :meth:`insert_pushing`
        of this record as it is now."""
        return self._args(record, 1, deadlines)

    def insert_pushing(
        self, record: Record, deadlines: dict[str, float | None], record_args: list[str],
        queue_key: str, message: str,
    ) -> bool:
        """Insert a new record and ``LPUSH`` its ``message`` onto ``queue_key`` in the same
        script (the broker is this Redis, see :mod:`ojs_celery.joint`): both or neither. True
        when done (or done already), False when another job has the id (nothing pushed).
        Raises :class:`StoreError` when refused (nothing written, nothing pushed) and
        :class:`StoreUncertain` when the store cannot tell, as :meth:`create` does.
        ``record_args``: :meth:`insert_args` of ``record`` with ``deadlines``."""
        keys = [*self._job_keys(record.job.id), queue_key]
        args = [*record_args, message]
        insert = functools.partial(self._insert_push, keys, args)
        return self._insert_settled(record, deadlines, insert, insert)

    @_call
    def _insert_push(self, keys: list[str], args: list[str]) -> bool:
        """One call of the insert-and-push script (see :meth:`insert_pushing`). A lost reply
        leaves as :class:`~.base.StoreError` and is settled as :meth:`_confirm_insert`'s."""
        answer = self._lane.send("EVALSHA", self._insert_push_script.sha, len(keys), *keys,
                                 *args, check=False)  # settled anyway: no poll first
        done = MISSED if answer is None else answer()
        if done is MISSED:  # nothing sent, or NOSCRIPT: redis-py's path loads the script
            done = self._insert_push_script(keys, args)
        return bool(done)

    @_call
    def _insert_many(self, rows: Sequence[NewRow]) -> str | None:
        """One script call: it checks every id, then writes every record (or none)."""
        keys = [*self._all_due_keys, *(self._job_prefix + record.job.id for record, _ in rows)]
        args = [str(len(self._all_due_keys))]
        for record, deadlines in rows:
            args.extend(self._args(record, 1, deadlines))
        taken: str | None = self._insert_many_script(keys, args)
        return taken

    @_call
    def _load(self, job_id: str) -> Record | None:
        fields: dict[str, str] = self.client.hgetall(self._job_prefix + job_id)  # type: ignore[assignment]
        return _record(fields)

    @_call
    def _cas(self, record: Record, previous: Record, deadlines: dict[str, float | None]) -> bool:
        keys = self._job_keys(record.job.id)
        args = self._cas_args(record, previous, deadlines)
        done = self._lane.call("EVALSHA", self._cas_script.sha, len(keys), *keys, *args)
        if done is MISSED:
            done = self._cas_script(keys, args)
        return bool(done)

    def _ack_dispatch(self, job_id: str, token: int) -> bool:
        return self._ack_dispatch_many([(job_id, token)])[0]

    @_call
    def _load_many(self, job_ids: Sequence[str]) -> list[Record | None]:
        pipe = self.client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(self._job_prefix + job_id)
        return [_record(fields) for fields in pipe.execute()]

    @_call
    def _cas_many(self, writes: Sequence[Write]) -> list[bool]:
        calls = [
            (self._job_keys(record.job.id), self._cas_args(record, previous, deadlines))
            for record, previous, deadlines in writes
        ]
        return [bool(done) for done in self._evalsha_many(self._cas_script, calls)]

    @_call
    def _ack_dispatch_many(self, acks: Sequence[tuple[str, int]]) -> list[bool]:
        keys = [self._due_keys["dispatch"], *(self._job_prefix + job_id for job_id, _ in acks)]
        args = [part for job_id, token in acks for part in (job_id, str(token))]
        return [bool(done) for done in self._ack_script(keys, args)]

    def _evalsha_many(self, script: Script, calls: list[tuple[list[str], list[str]]]) -> list[Any]:
        """Run ``script`` once per ``(keys, args)`` in one pipeline (no transaction: each call
        is atomic by itself). A call Redis refused with NOSCRIPT (a restart or SCRIPT FLUSH
        since the script was loaded) did nothing: load the script and run those again."""
        results: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            for index in todo:
                keys, args = calls[index]
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            answers = pipe.execute(raise_on_error=False)
            retry: list[int] = []
            for index, answer in zip(todo, answers, strict=True):
                if isinstance(answer, NoScriptError) and attempt == 0:
                    retry.append(index)
                elif isinstance(answer, Exception):
                    raise answer
                else:
                    results[index] = answer
            if not retry:
                break
            self.client.script_load(script.script)
            todo = retry
        return results

    @_call
    def due(self, clock: str, now: float, limit: int) -> list[tuple[str, float]]:
        try:
            key = self._due_keys[clock]
        except KeyError:
            raise ValueError(f"clock: unknown clock {clock!r} (one of {CLOCKS})") from None
        rows: list[tuple[str, float]] = self.client.zrangebyscore(  # type: ignore[assignment]
            key, "-inf", _num(now), start=0, num=int(limit), withscores=True
        )
        return [(str(job_id), float(score)) for job_id, score in rows]

    @_call
    def scan(self, clock: str, cursor: str | None, limit: int) -> tuple[list[str], str | None]:
        """``ZSCAN`` of the clock's sorted set (its cursor walks the hash table, which a new
        score does not reorder)."""
        following, rows = self.client.zscan(self._due_keys[clock], int(cursor or 0),
                                            count=int(limit))
        return [str(job_id) for job_id, _ in rows], (str(following) if following else None)

    @_call
    def _delete(self, job_id: str, expected: int) -> bool:
        keys = self._job_keys(job_id)
        return bool(self._delete_script(keys, [job_id, str(expected)]))

    @_call
    def _delete_many(self, deletes: Sequence[tuple[str, int]]) -> list[bool]:
        calls = [(self._job_keys(job_id), [job_id, str(expected)]) for job_id, expected in deletes]
        return [bool(done) for done in self._evalsha_many(self._delete_script, calls)]

    @_call
    def forget_missing(self, clock: str, job_ids: Sequence[str]) -> int:
        if not job_ids:
            return 0
        keys = [self._due_keys[clock], *(self._job_prefix + job_id for job_id in job_ids)]
        return int(self._forget_script(keys, list(job_ids)))

    @_call
    def _move_due(self, clock: str, moves: Sequence[tuple[str, float, float]]) -> int:
        args = [str(part) if isinstance(part, str) else _num(part)
                for move in moves for part in move]
        return int(self._move_due_script([self._due_keys[clock]], args))

    # ------------------------------------------------------------------ admin

    @_call
    def ping(self) -> None:
        self.client.ping()

    @_call
    def clear(self) -> None:
        """Delete every key under ``{prefix}:`` (SCAN, never KEYS: the server is shared)."""
        pattern = _escape_glob(self.prefix) + ":*"
        batch: list[Any] = []
        for key in self.client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 500:
                self.client.unlink(*batch)
                batch.clear()
        if batch:
            self.client.unlink(*batch)

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, prefix={self.prefix!r})"  # masked


#: Seconds a worker's removal keeps its mark (``remove_worker.lua``): long enough for redis-py's
#: own tries of the script after a lost reply, which follow at once.
REMOVAL_MARK_KEPT = 300


class RedisWorkerRegistry(WorkerRegistry):
    """Worker records: ``P:worker:{id}`` hashes and the ``P:workers`` sorted set by last beat."""

    def __init__(self, client: redis.Redis, prefix: str,
                 session: FirstSession | None = None) -> None:
        self.client = client
        self._session = session or FirstSession(client, prefix)
        self._worker_prefix = f"{prefix}:worker:"
        self._workers_key = f"{prefix}:workers"
        self._removed_prefix = f"{prefix}:removed-worker:"
        self._list_script = client.register_script(script("list_workers"))
        self._remove_script = client.register_script(script("remove_worker"))
        self._bury_script = client.register_script(script("bury_worker"))

    @_call
    def save(self, info: WorkerInfo) -> None:
        """The record and its index entry in one MULTI/EXEC round trip."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(
            self._worker_prefix + info.worker_id,
            "data",
            json.dumps(info.to_dict(), separators=(",", ":")),
        )
        pipe.zadd(self._workers_key, {info.worker_id: float(info.last_beat)})
        pipe.execute()

    @_call
    def get(self, worker_id: str) -> WorkerInfo | None:
        data: str | None = self.client.hget(self._worker_prefix + worker_id, "data")  # type: ignore[assignment]
        return None if data is None else WorkerInfo.from_dict(json.loads(data))

    @_call
    def remove(self, worker_id: str, buried: bool = False) -> bool:
        """One script that leaves a short-lived mark with its nonce: redis-py sends a command
        again when its reply is lost, and a plain delete sent again finds nothing and said
        False ("another sweeper removed it")."""
        keys = [self._worker_prefix + worker_id, self._workers_key,
                self._removed_prefix + worker_id]
        return bool(self._remove_script(keys, [worker_id, new_nonce(), str(REMOVAL_MARK_KEPT),
                                               repr(BURIED) if buried else ""]))

    @_call
    def bury(self, tombstone: WorkerInfo) -> bool:
        """One script (``bury_worker.lua``): the record and its index entry at once; sent
        again by redis-py after a lost reply, it finds its own nonce in the tombstone."""
        keys = [self._worker_prefix + tombstone.worker_id, self._workers_key]
        data = json.dumps(tombstone.to_dict(), separators=(",", ":"))
        return bool(self._bury_script(keys, [tombstone.worker_id, data, tombstone.burial,
                                             repr(BURIED)]))

    @_call
    def all(self) -> list[WorkerInfo]:
        rows: list[str] = self._list_script([self._workers_key], [self._worker_prefix])
        workers = [WorkerInfo.from_dict(json.loads(data)) for data in rows]
        return sorted(workers, key=lambda w: w.worker_id)

    @_call
    def stale(self, cutoff: float, limit: int) -> list[str]:
        ids: list[str] = self.client.zrangebyscore(  # type: ignore[assignment]
            self._workers_key, "-inf", cutoff, start=0, num=limit
        )
        return list(ids)


class RedisMetaArea(MetaArea):
    """The meta area: the ``P:meta`` hash."""

    def __init__(self, client: redis.Redis, prefix: str,
                 session: FirstSession | None = None) -> None:
        self.client = client
        self._session = session or FirstSession(client, prefix)
        self._meta_key = f"{prefix}:meta"
        self._take_script = client.register_script(script("take_meta"))
        self._swap_script = client.register_script(script("swap_meta"))
        self._drop_script = client.register_script(script("drop_meta"))

    @_call
    def _put(self, key: str, value: str) -> None:
        self.client.hset(self._meta_key, key, value)

    @_call
    def _get(self, key: str) -> str | None:
        value: str | None = self.client.hget(self._meta_key, key)  # type: ignore[assignment]
        return value

    @_call
    def _take(self, key: str) -> str | None:
        value: str | None = self._take_script([self._meta_key], [key])
        return value

    @_call
    def _drop(self, key: str, expected: str) -> bool:
        return bool(self._drop_script([self._meta_key], [key, expected]))

    @_call
    def _swap(self, key: str, expected: str | None, value: str) -> bool:
        none = "1" if expected is None else "0"
        return bool(self._swap_script([self._meta_key], [key, expected or "", value, none]))
