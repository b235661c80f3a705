"""One round trip for a new job's record and its message when the job store is the broker's
Redis.

A new job is otherwise stored by one write and published by kombu's ``LPUSH``: two round
trips (overlapped, see :func:`ojs_celery.api.enqueue_job`) and two clients' worth of CPU. When
the store's Redis is the broker's, one script does both, atomically: the record (without an
outbox entry, since its message goes in the same step) and the message. Celery's publish path
runs as it always does (routing, serializers, compression, ``before_task_publish`` and
``after_task_publish``); only its last step, kombu's Redis ``Channel._put``, hands the message
it was about to push to the store, and only for the message of the job being created in this
thread. Everything else (other messages, another broker) goes through kombu unchanged; the
job's own message on a queue with ``x-expires`` or in a kombu publish batch is pushed by kombu
after its record is written (with its outbox entry, as without the joint write).

If the message never reaches ``_put`` (the publish failed before it), the record is written
alone afterwards with its outbox entry, as for any job whose message is owed.

The same ``_put`` pushes every other OJS message (a store elsewhere, a retry, the sweeper's
publishes) with the Redis client kept per kombu channel (:mod:`ojs_celery.kept_client`) instead
of the one kombu builds for each publish. The push is kombu's own (its list key, its client
class, so its ``global_keyprefix``); a batch and a queue with ``x-expires`` go through kombu's
``_put``, and so does every message that is not an OJS job's.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from kombu.connection import Connection
from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps

from . import header
from .kept_client import client_of
from .lifecycle import Transition, deadlines
from .store import DuplicateJob, JobStore, StoreError
from .store.redis import RedisStore

__all__ = ["JointCreate", "install_put", "joint_store"]

_pending: ContextVar[JointCreate | None] = ContextVar("ojs_celery_joint_create", default=None)


class JointCreate:
    """A new job whose record and message are written together: enter it around the
    publish of the job's message, then :meth:`finish`.

    kombu's ``_put`` calls :meth:`push` for the job's message, or :meth:`store_first` when it
    must push it its own way (a queue with ``x-expires``, whose expiry kombu renews with the
    push; a publish batch): then the record is written first, with its outbox entry, and the
    message follows as before. Either way nothing is pushed for an id that is taken."""

    def __init__(self, store: RedisStore, transition: Transition) -> None:
        assert transition.record is not None
        self.store = store
        self.record = transition.record
        self.job_id = self.record.job.id
        #: The outbox deadline the record gets if its message has to be owed after all.
        self._owed = self.record.dispatch_due
        self.record.dispatch_due = None  # the message goes in the record's own write
        self.record.version = 1  # what it is once written (the message carries the snapshot)
        self._deadlines = deadlines(self.record, store.policy)
        #: The script's record arguments, encoded once when the publish begins: the message's
        #: snapshot (built before the push) reuses the job's JSON they hold. Only the push uses
        #: them: a record that comes to owe its message (:meth:`_owe`) gets arguments anew.
        self._args: list[str] | None = None
        #: ``_put`` began writing the record: its outcome is the write's, raised through the
        #: publish if it failed.
        self.attempted = False
        #: The record is written: by the script with the message (``"joint"``), or alone with
        #: its outbox entry before kombu's push (``"first"``).
        self.written: str | None = None
        self._token: Any = None

    def __enter__(self) -> JointCreate:
        self._args = self.store.insert_args(self.record, self._deadlines)
        self._token = _pending.set(self)
        return self

    def __exit__(self, *_: object) -> None:
        _pending.reset(self._token)

    def push(self, queue_key: str, message: str) -> None:
        """Write the record and push ``message`` in one script (sent again as it is if kombu
        retries the publish: the script finds its own record and pushes nothing more)."""
        self.attempted = True
        assert self._args is not None  # made as the publish began (__enter__)
        if not self.store.insert_pushing(self.record, self._deadlines, self._args, queue_key,
                                         message):
            raise DuplicateJob(self.job_id)
        self.written = "joint"

    def store_first(self) -> None:
        """Write the record alone, owing its message, before kombu pushes it."""
        self.attempted = True
        self._owe()
        if not self.store.insert_new(self.record, self._deadlines):
            raise DuplicateJob(self.job_id)
        self.written = "first"

    def finish(self, published: bool) -> None:
        """After the publish, when ``_put`` wrote nothing (it was never reached, or the message
        was not this job's to kombu: Celery's task protocol 1): write the record alone, with
        its outbox entry unless the message was ``published``. Raises as
        :meth:`JobStore.create` does."""
        if self.attempted:
            if self.written is None:  # its error was raised through the publish
                raise StoreError(f"job {self.job_id}: the write of its record did not finish")
            return
        if not published:
            self._owe()
        if not self.store.insert_new(self.record, self._deadlines):
            raise DuplicateJob(self.job_id)

    def _owe(self) -> None:
        self.record.dispatch_due = self._owed
        self._deadlines = deadlines(self.record, self.store.policy)


def joint_store(store: JobStore, broker: Connection) -> RedisStore | None:
    """``store`` when it is the Redis that the kombu connection ``broker`` reaches (a Redis
    URL without failover alternatives; the same host, port, database and credentials, read
    as kombu's Redis channel reads them), else None."""
    if not isinstance(store, RedisStore) or broker.transport_cls not in ("redis", "rediss"):
        return None
    if len(broker.alt) > 1:
        return None
    vhost = broker.virtual_host
    try:
        db = int(vhost.strip("/") or 0) if isinstance(vhost, str) else int(vhost or 0)
    except ValueError:
        return None
    theirs = (broker.hostname or "127.0.0.1", int(broker.port or 6379), db,
              broker.userid or None, broker.password or None)
    kwargs = store.client.connection_pool.connection_kwargs
    ours = (kwargs.get("host"), int(kwargs.get("port") or 6379), int(kwargs.get("db") or 0),
            kwargs.get("username") or None, kwargs.get("password") or None)
    return store if theirs == ours else None


def install_put() -> None:
    """Let kombu's Redis channel hand a joint job's message to its :class:`JointCreate`, and
    push the other OJS messages with a client kept per channel (idempotent; process-wide,
    a no-op for every other message)."""
    channel: Any = kombu_redis.Channel
    original: Any = channel._put
    if getattr(original, "__ojs_joint__", False):
        return

    def _put(self: Any, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        headers = message.get("headers") or {}
        if header.NAME not in headers:  # not an OJS job's message
            return original(self, queue, message, **kwargs)  # type: ignore[no-any-return]
        if (kwargs.get("_publish_batch") is not None
                or (getattr(self, "_expires", None) and queue in self._expires)):
            joint = _pending.get()
            if joint is not None and joint.written is None and headers.get("id") == joint.job_id:
                joint.store_first()
            return original(self, queue, message, **kwargs)  # type: ignore[no-any-return]
        key = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))
        payload = dumps(message)  # type: ignore[no-untyped-call]
        joint = _pending.get()
        if joint is None or joint.written is not None or headers.get("id") != joint.job_id:
            # not the job being created (a retry, the sweeper, a store elsewhere; another queue
            # of a fanout exchange, or kombu's retry of its own push after store_first)
            client_of(self).lpush(key, payload)
            return None
        joint.push(getattr(self, "global_keyprefix", "") + key, payload)
        return None

    _put.__ojs_joint__ = True  # type: ignore[attr-defined]
    channel._put = _put
