"""OJS events: the spec's envelope, delivered as Celery signals and on Celery's event bus.

Signals fire synchronously in the process where the transition happened. The bus copy goes
through a per-process buffer drained by a background thread, so that publishing never blocks a
task (the bus is best-effort, like Celery's own task events). ``listen`` reads the bus from any
process: that is what ``ojs-celery events`` prints.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from celery import Celery
from kombu.exceptions import OperationalError as KombuOperationalError

from . import signals
from .batching import Batcher
from .envelope import format_epoch, new_job_id

logger = logging.getLogger(__name__)

#: Celery event type that carries OJS events on the bus (routing key ``ojs.event``).
BUS_EVENT_TYPE = "ojs-event"

Event = dict[str, Any]
#: An event the bus thread has yet to build: type, data, subject, when it happened.
Pending = tuple[str, dict[str, Any], "str | None", float]
MAX_BATCH = 200
#: Seconds the bus thread waits after an event for more to batch with it.
LINGER = 0.05
#: Seconds :func:`listen` waits before connecting again after losing the broker, doubled
#: after each failure up to the most.
RECONNECT_FIRST = 1.0
RECONNECT_MAX = 30.0


def make_event(type_: str, data: dict[str, Any], subject: str | None, source: str,
               at: float | None = None) -> Event:
    """An OJS event envelope (``evt_`` + UUIDv7 id, RFC 3339 time ``at``, JSON data)."""
    event: Event = {
        "specversion": "1.0",
        "id": "evt_" + new_job_id(),
        "type": type_,
        "source": source,
        "time": format_epoch(time.time() if at is None else at),
        "datacontenttype": "application/json",
        "data": data,
    }
    if subject is not None:
        event["subject"] = subject
    return event


class EventBus(Batcher["Event | Pending"]):
    """Per-process buffered publisher to Celery's event exchange (restarted after a fork).

    A process's events go out in batches of up to :data:`MAX_BATCH`, one bus message each,
    lingering up to :data:`LINGER` seconds after the first event: a busy worker then pays one
    publish for many transitions instead of one per event.
    """

    thread_name = "ojs-events"

    def __init__(self, app: Celery, enabled: bool = True) -> None:
        super().__init__(linger=LINGER, max_batch=MAX_BATCH)
        self.app = app
        self.enabled = enabled
        self.source = f"ojs://{app.main or 'celery'}/{socket.gethostname()}/{os.getpid()}"

    def emit(self, type_: str, data: dict[str, Any], subject: str | None = None) -> None:
        """Send the event's signals now and queue its bus copy. With no signal receivers
        (a worker, usually) only the queueing happens here: the bus thread builds the
        envelope (id, formatted time), so a task pays for an event no more than an append."""
        specific = signals.BY_TYPE.get(type_)
        if signals.ojs_event.receivers or (specific is not None and specific.receivers):
            event = make_event(type_, data, subject, self.source)
            signals.ojs_event.send(sender=type_, event=event)
            if specific is not None:
                specific.send(sender=type_, event=event)
            if self.enabled:
                self.put(event)
        elif self.enabled:
            self.put((type_, data, subject, time.time()))

    def emit_all(self, events: Iterable[tuple[str, dict[str, Any]]]) -> None:
        for type_, data in events:
            self.emit(type_, data, subject=data.get("job_id") or data.get("worker_id"))

    def _started(self) -> None:
        self.source = f"ojs://{self.app.main or 'celery'}/{socket.gethostname()}/{os.getpid()}"

    def _open(self) -> Callable[[list[Event | Pending]], None]:
        """The publisher of this thread: its own connection, opened on the first batch and
        reopened after a failure."""
        dispatcher: Any = None
        connection: Any = None

        def publish(batch: list[Event | Pending]) -> None:
            nonlocal dispatcher, connection
            events = [_built(item, self.source) for item in batch]
            try:
                if dispatcher is None:
                    connection = self.app.connection_for_write()
                    dispatcher = self.app.events.Dispatcher(
                        connection, enabled=True, buffer_while_offline=False
                    )
                dispatcher.send(BUS_EVENT_TYPE, ojs_events=events, retry=True,
                                retry_policy={"max_retries": 3})
            except Exception as exc:
                logger.warning("ojs_celery: could not publish %d event(s): %r", len(events), exc)
                if connection is not None:
                    connection.release()
                dispatcher = connection = None

        return publish


def _built(item: Event | Pending, source: str) -> Event:
    """A queued event as the bus carries it (built now if it was queued as :data:`Pending`)."""
    if isinstance(item, dict):
        return item
    type_, data, subject, at = item
    return make_event(type_, data, subject, source, at)


def listen(
    app: Celery,
    handler: Callable[[Event], None],
    *,
    limit: int | None = None,
    timeout: float | None = None,
    ready: threading.Event | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Call ``handler`` for every OJS event on the bus until ``limit`` events, until
    ``timeout`` seconds pass without a message, or until ``stop`` is set (seen within about a
    second: a listening thread can be ended before its broker goes away).

    ``ready`` is set once the receiver is bound, so nothing published after it is missed. The
    limit counts events, not bus messages (one message carries a batch of them), and is not
    passed to kombu, whose ``limit`` also counts the idle one-second polls. A lost broker
    connection (a restart) is logged in one line and made again, waiting longer each time up
    to :data:`RECONNECT_MAX`: what was published meanwhile is lost, as the bus is best-effort.
    What ``handler`` raises ends it (raised as it was, an ``OSError`` included).
    """
    counted = _Counted(handler, limit)
    stopping = stop or threading.Event()
    pause = RECONNECT_FIRST
    while True:
        connection = app.connection_for_read()
        # losing the broker, whatever its transport: kombu's own error for a connection that
        # cannot be made, its transport's (the driver's) and a socket's
        lost = (KombuOperationalError, OSError, *connection.connection_errors,
                *connection.channel_errors)
        try:
            with connection:
                receiver = app.events.Receiver(connection,
                                               handlers={BUS_EVENT_TYPE: counted.on_message})
                counted.receiver = receiver
                receiver.on_iteration = counted.stop_when(stopping)
                if ready is not None:
                    receiver.on_consume_ready = lambda *_a, **_k: ready.set()
                receiver.capture(timeout=timeout, wakeup=False)
                return
        except TimeoutError:
            return
        except _HandlerFailed as failed:  # the handler's own error (a full disk): not the broker
            raise failed.error from None
        except lost as exc:  # connecting (a broker still down) or consuming
            if stopping.is_set():  # the broker went away after the caller asked to stop
                return
            if counted.flowed:  # events came since the last loss: start over
                pause, counted.flowed = RECONNECT_FIRST, False
            logger.warning("ojs_celery: event bus: lost the broker (%s: %s); connecting again "
                           "in %gs", type(exc).__name__, str(exc).splitlines()[0] if str(exc)
                           else "", pause)
        if stopping.wait(pause):
            return
        pause = min(pause * 2, RECONNECT_MAX)


class _HandlerFailed(Exception):
    """What :func:`listen`'s handler raised, carried past the errors taken for a lost broker
    (an ``OSError`` writing the event out is not one) and raised again as it was."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


class _Counted:
    """:func:`listen`'s handler of bus messages: each OJS event to ``handler``, up to
    ``limit``, across connections."""

    def __init__(self, handler: Callable[[Event], None], limit: int | None) -> None:
        self.handler = handler
        self.limit = limit
        self.seen = 0
        self.flowed = False
        self.receiver: Any = None

    def on_message(self, raw: dict[str, Any]) -> None:
        self.flowed = True
        for event in raw.get("ojs_events") or ():
            if self.limit is not None and self.seen >= self.limit:
                break
            if isinstance(event, dict):
                self.seen += 1
                try:
                    self.handler(event)
                except Exception as exc:  # an OSError of its own is no lost broker
                    raise _HandlerFailed(exc) from exc
        if self.limit is not None and self.seen >= self.limit:
            self.receiver.should_stop = True

    def stop_when(self, stop: threading.Event) -> Callable[[], None]:
        """The receiver's ``on_iteration`` hook (kombu calls it before each poll): it stops
        consuming once ``stop`` is set."""

        def check() -> None:
            if stop.is_set():
                self.receiver.should_stop = True

        return check
