"""One kombu Redis client per channel for what kombu does with OJS messages, and their acks
taken off the worker's consumer loop.

kombu's Redis transport builds a new ``redis.Redis`` client for every command it sends outside
its consumer loop: each publish (``Channel._put``) and, in a worker, each message's bookkeeping
(``QoS.append`` when it is delivered, ``QoS.ack`` or ``QoS.reject`` when it is done). With
redis-py's table of reply callbacks a client costs about 50 µs to build, so a worker's main
process paid two per message, as much as a fifth of its work per job.

For OJS messages (those with an ``ojs`` header) the client kombu would build is built once per
channel and kept: :func:`client_of` here, used by the ``_put`` of :mod:`ojs_celery.joint` and
by the QoS hooks that :func:`install_qos` adds. The commands, their keys and the client's class
(so its ``global_keyprefix``) stay kombu's; only the client object is reused. A reject with
requeue (kombu's restore, a transaction of its own) and every other message keep kombu's path.

An OJS message's ack goes one step further. kombu removes an acknowledged message from its
record of deliveries (the ``unacked`` hash and index) with a round trip that the worker's
consumer loop waits for. For an OJS message :class:`DeferredAcks` sends those removals in
batches from a background thread, a moment later (kombu's in-memory ack happens at once, as
before). Until a removal is sent the only consequence is that a worker killed meanwhile leaves
the message in the record, and kombu's visibility timeout delivers it again: the attempt it
started has ended, so its start is refused (fencing) and the copy is dropped unrun. A removal
that Redis refuses leaves the same, with a warning.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from kombu.transport import redis as kombu_redis

from . import header
from .batching import Batcher

logger = logging.getLogger(__name__)

__all__ = ["DeferredAcks", "client_of", "deferred_acks", "install_qos"]

#: An acknowledged message's removal from kombu's record: the channel's kept client, the
#: record's index and hash keys (as kombu names them, before its key prefix), the delivery tag.
Removal = tuple[Any, str, str, str]
#: Seconds the thread waits after an ack for more to send with it.
LINGER = 0.05
MAX_BATCH = 500

#: kombu's Redis client of each channel, made once (see the module docstring).
_clients: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
#: Set while kombu's QoS handles an OJS message: its pipelines come from the kept client.
_keeping: ContextVar[bool] = ContextVar("ojs_celery_kept_client", default=False)


def client_of(channel: Any) -> Any:
    """The client kombu would make for ``channel``, made once per channel and its connection
    pool (kombu makes a new pool after a reconnect)."""
    client = _clients.get(channel)
    if client is None or client.connection_pool is not channel.pool:
        client = _clients[channel] = channel._create_client()
    return client


class DeferredAcks(Batcher[Removal]):
    """kombu's removal of acknowledged OJS messages from its record of deliveries, sent in
    batches (one MULTI/EXEC per channel and batch, as kombu sends one per message)."""

    thread_name = "ojs-kombu-acks"

    def __init__(self) -> None:
        super().__init__(linger=LINGER, max_batch=MAX_BATCH)

    def _open(self) -> Callable[[list[Removal]], None]:
        return self._remove

    def _remove(self, batch: list[Removal]) -> None:
        records: dict[tuple[int, str, str], tuple[Any, list[str]]] = {}
        for client, index_key, hash_key, tag in batch:
            records.setdefault((id(client), index_key, hash_key), (client, []))[1].append(tag)
        for (_, index_key, hash_key), (client, tags) in records.items():
            try:
                client.pipeline().zrem(index_key, *tags).hdel(hash_key, *tags).execute()
            except Exception as exc:  # the entries stay: redelivered after the visibility
                logger.warning(  # timeout, where fencing drops each copy unrun
                    "ojs_celery: could not remove %d acknowledged message(s) from kombu's "
                    "record of deliveries (%r); the broker delivers them again after its "
                    "visibility timeout, and each copy is dropped without running", len(tags),
                    exc)


#: The process's deferred acks (its thread starts at the first one; flushed at exit).
deferred_acks = DeferredAcks()


def _is_ojs(message: Any) -> bool:
    headers = getattr(message, "headers", None)
    return isinstance(headers, dict) and header.NAME in headers


def install_qos() -> None:
    """Let kombu's Redis QoS record and reject OJS messages with the channel's kept client,
    and remove acknowledged ones from its record through :data:`deferred_acks` (idempotent;
    process-wide, a no-op for every other message)."""
    qos: Any = kombu_redis.QoS
    if getattr(qos.pipe_or_acquire, "__ojs_kept__", False):
        return
    pipe_or_acquire, append, ack, reject = qos.pipe_or_acquire, qos.append, qos.ack, qos.reject

    def kept_pipe_or_acquire(self: Any, pipe: Any = None, client: Any = None) -> Any:
        if pipe is None and client is None and _keeping.get():
            client = client_of(self.channel)
        return pipe_or_acquire(self, pipe, client)

    def kept(method: Any, message_of: Any) -> Any:
        def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not _is_ojs(message_of(self, args)):
                return method(self, *args, **kwargs)
            token = _keeping.set(True)
            try:
                return method(self, *args, **kwargs)
            finally:
                _keeping.reset(token)

        return hooked

    def delivered(self: Any, args: tuple[Any, ...]) -> Any:
        return self._delivered.get(args[0]) if args else None

    def deferred_ack(self: Any, delivery_tag: Any) -> None:
        """kombu's ack (its Redis ``QoS.ack``: the removal, then the in-memory ack), with the
        removal of an OJS message deferred."""
        if not _is_ojs(self._delivered.get(delivery_tag)):
            return ack(self, delivery_tag)  # type: ignore[no-any-return]
        deferred_acks.put((client_of(self.channel), self.unacked_index_key, self.unacked_key,
                           delivery_tag))
        super(kombu_redis.QoS, self).ack(delivery_tag)
        return None

    kept_pipe_or_acquire.__ojs_kept__ = True  # type: ignore[attr-defined]
    qos.pipe_or_acquire = kept_pipe_or_acquire
    qos.append = kept(append, lambda self, args: args[0] if args else None)
    qos.ack = deferred_ack
    qos.reject = kept(reject, delivered)
