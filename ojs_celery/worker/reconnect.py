"""A worker's broker connection lost while it held messages: on a Redis broker they go back to
their queue once the worker has reconnected, and on Celery 5.7 the worker lives through it.

When the connection fails, Celery drops the requests the worker holds but has not started,
prefetched or waiting for an ETA (such as an OJS retry's backoff): their delivery tags belong to
the failed channel. RabbitMQ then delivers those messages again. kombu's Redis transport puts
them back in their queue as it closes the failed channel, but only if Redis answers at that
moment. After a restart or a failover it does not, and the messages stay in kombu's ``unacked``
record for the broker's ``visibility_timeout`` (an hour by default), while the worker that held
them lives on, beats and no longer lists them (no dead-worker recovery applies): their jobs
waited for the redispatch backstop.

:class:`ReconnectStep` notes the OJS messages the worker held when Celery learns that the
connection failed and, once the consumer is connected again, puts each one still in ``unacked``
back in its queue (:func:`ojs_celery.handback.put_back`). Only OJS messages: a copy of one is
harmless (fencing drops it at its start), while a plain task's message that the pool took just
before the loss could run twice.

It also keeps Celery 5.7 from ending the worker there. Celery 5.7 closes the failed connection
after collecting it (5.6 let it go), and on Redis that close undoes what the collection left:
kombu's Redis channel drops its connection pool, then raises an ``AttributeError`` from the
transport the collection let go of, which Celery does not ignore ("Unrecoverable error": a worker
holding a message stopped at every Redis restart, plain Celery 5.7 workers too); and without the
pool, the acknowledgement of a job that ran on through the loss raised the same error when the
job ended. The close is skipped, as before 5.7: the collection already let the connection go.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import bootsteps

from .. import handback
from ..runtime import get_runtime
from .node import node_of, ojs_requests
from .registration import RegistrationStep

logger = logging.getLogger(__name__)


class ReconnectStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Hooks the consumer's reaction to a failed broker connection at its first start, and
    hands the noted messages back at each start after a reconnection (see the module
    docstring). One instance per consumer: its steps outlive the consumer's restarts."""

    requires = (RegistrationStep,)
    label = "OJS broker reconnect"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        #: Delivery tags of the OJS messages held when the connection failed, with job ids.
        self.held: dict[str, str] = {}
        self.hooked = False

    def start(self, parent: Any) -> None:
        if not self.hooked:
            self.hooked = True
            parent.on_connection_error_after_connected = self._on_connection_error(
                parent, parent.on_connection_error_after_connected)
        elif self.held:
            self._hand_back(parent)

    def _on_connection_error(self, parent: Any,
                             celery_reaction: Callable[[Any], Any]) -> Callable[[Any], Any]:
        redis_broker = get_runtime(parent.app).broker_driver == "redis"

        def on_connection_error_after_connected(exc: Any) -> Any:
            connection = parent.connection
            if connection is not None and redis_broker:
                self.held.update(_held_tags(parent))
                connection.close = _left_to_the_collection
            return celery_reaction(exc)

        return on_connection_error_after_connected

    def _hand_back(self, parent: Any) -> None:
        held, self.held = self.held, {}
        try:
            restored = [held[tag] for tag in
                        handback.put_back(parent.connection.default_channel, held)]
        except Exception as exc:  # the broker failed again: tried again at the next reconnect
            self.held.update(held)
            logger.warning(
                "ojs_celery: could not put back %d held OJS message(s) after the broker "
                "connection was lost (%r); trying again when the worker reconnects (kombu "
                "restores them after the broker's visibility_timeout)", len(held), exc)
            return
        if restored:
            logger.warning(
                "ojs_celery: put back in their queue %d OJS message(s) this worker held when "
                "the broker connection was lost (kombu could not while Redis was away): jobs %s",
                len(restored), handback.named(restored))


def _held_tags(parent: Any) -> dict[str, str]:
    """The delivery tags of the OJS messages this worker holds without running them, which
    Celery drops at a failed connection: those it holds now, and those the last beat saw that
    have neither started nor been acknowledged since (when this runs, Celery 5.6's event loop
    has already cleared the timer that held the ones waiting for an ETA)."""
    running = {request.id for request in ojs_requests()}
    held = {}
    for request in [*ojs_requests(active=False, consumer=parent), *node_of(parent).last_held]:
        tag = getattr(getattr(request, "message", None), "delivery_tag", None)
        if (isinstance(tag, str) and request.id not in running
                and not getattr(request, "acknowledged", False)):
            held[tag] = request.id
    return held


def _left_to_the_collection() -> None:
    """Celery 5.7's close of the failed connection, skipped (see the module docstring)."""
