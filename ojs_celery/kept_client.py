"""One kombu Redis client per channel for what kombu does with OJS messages.

kombu's Redis transport builds a new ``redis.Redis`` client for every command it sends outside
its consumer loop: each publish (``Channel._put``) and, in a worker, each message's bookkeeping
(``QoS.append`` when it is delivered, ``QoS.ack`` or ``QoS.reject`` when it is done). With
redis-py's table of reply callbacks a client costs about 50 µs to build, so a worker's main
process pays two per message, as much as a fifth of its work per job.

For OJS messages (those with an ``ojs`` header) the client kombu would build is built once per
channel and kept: :func:`client_of` here, used by the ``_put`` of :mod:`ojs_celery.joint` and
by the QoS hooks that :func:`install_qos` adds. The commands, their keys and the client's class
(so its ``global_keyprefix``) stay kombu's; only the client object is reused. The ack of an OJS
message that this process runs as an OJS task goes further: its removal from kombu's record is
sent later, in a batch (:mod:`ojs_celery.unacked`), which only fencing makes safe (a message
restored after a lost removal is dropped at its start). A reject with requeue (kombu's restore,
a transaction of its own), the ack of an OJS message that a plain task ran (a ``type_map``
entry naming one, a worker deployed before the task became an OJS task, or a message without a
``task`` header: Celery's message protocol 1) and every other message keep kombu's path.
"""

from __future__ import annotations

import weakref
from contextvars import ContextVar
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from . import header, unacked

__all__ = ["client_of", "install_qos"]

#: kombu's Redis client of each channel, made once (see the module docstring).
_clients: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
#: The apps whose workers' QoS was hooked (:func:`install_qos`): a message's task is fenced when
#: one of them registers it as an OJS task. Weak references in a list (a worker has one app):
#: a ``WeakSet``'s iteration costs four times as much, once per acknowledgement.
_apps: list[weakref.ref[Any]] = []
#: Set while kombu's QoS handles an OJS message: its pipelines come from the kept client.
_keeping: ContextVar[bool] = ContextVar("ojs_celery_kept_client", default=False)


def client_of(channel: Any) -> Any:
    """The client kombu would make for ``channel``, made once per channel and its connection
    pool (kombu makes a new pool after a reconnect)."""
    client = _clients.get(channel)
    if client is None or client.connection_pool is not channel.pool:
        client = _clients[channel] = channel._create_client()
    return client


def _is_ojs(message: Any) -> bool:
    headers = getattr(message, "headers", None)
    return isinstance(headers, dict) and header.NAME in headers


def _runs_fenced(message: Any) -> bool:
    """Whether ``message`` is an OJS message whose task an app of this process runs as an OJS
    task: its start is then fenced, so a restore after a lost removal cannot run it again."""
    if not _is_ojs(message):
        return False
    name = message.headers.get("task")
    for ref in _apps:
        app = ref()
        # the registry itself: ``app.tasks`` would take a lock, or finalize an app, inside
        # kombu's ack; a task not registered yet is not fenced here (kombu's ack: safe)
        if app is not None and getattr(app._tasks.get(name), "__ojs_task__", False):
            return True
    return False


def install_qos(app: Any) -> None:
    """Let kombu's Redis QoS record and reject OJS messages with the channel's kept client,
    and send the removals of acknowledged ones that ``app`` runs as OJS tasks in batches
    (:mod:`ojs_celery.unacked`) (idempotent; process-wide, a no-op for every other message)."""
    if all(ref() is not app for ref in _apps):
        _apps[:] = [ref for ref in _apps if ref() is not None] + [weakref.ref(app)]
    qos: Any = kombu_redis.QoS
    if getattr(qos.pipe_or_acquire, "__ojs_kept__", False):
        return
    pipe_or_acquire, append, ack, reject = qos.pipe_or_acquire, qos.append, qos.ack, qos.reject
    quick_ack: Any = virtual.QoS.ack  # kombu's in-process part of an ack

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

    kept_ack = kept(ack, delivered)  # an unfenced ack: kombu's, on the kept client if OJS

    def removed_later(self: Any, delivery_tag: str) -> None:
        """kombu's in-process bookkeeping now, the entry's removal in the next batch."""
        if not _runs_fenced(self._delivered.get(delivery_tag)):
            kept_ack(self, delivery_tag)
            return
        unacked.remove_later(client_of(self.channel), self.unacked_index_key, self.unacked_key,
                             delivery_tag)
        quick_ack(self, delivery_tag)

    kept_pipe_or_acquire.__ojs_kept__ = True  # type: ignore[attr-defined]
    qos.pipe_or_acquire = kept_pipe_or_acquire
    qos.append = kept(append, lambda self, args: args[0] if args else None)
    qos.ack = removed_later
    qos.reject = kept(reject, delivered)
