"""OJS events: the spec's envelope, delivered as Celery signals and on Celery's event bus.

Signals fire synchronously in the process where the transition happened. The bus copy goes
through a per-process buffer drained by a background thread, so that publishing never blocks a
task (the bus is best-effort, like Celery's own task events). ``listen`` reads the bus from any
process: that is what ``ojs-celery events`` prints.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

from celery import Celery

from . import signals
from .envelope import format_timestamp, new_job_id, utcnow

logger = logging.getLogger(__name__)

#: Celery event type that carries OJS events on the bus (routing key ``ojs.event``).
BUS_EVENT_TYPE = "ojs-event"

Event = dict[str, Any]
MAX_BATCH = 200


def make_event(type_: str, data: dict[str, Any], subject: str | None, source: str) -> Event:
    """An OJS event envelope (``evt_`` + UUIDv7 id, RFC 3339 time, JSON data)."""
    event: Event = {
        "specversion": "1.0",
        "id": "evt_" + new_job_id(),
        "type": type_,
        "source": source,
        "time": format_timestamp(utcnow()),
        "datacontenttype": "application/json",
        "data": data,
    }
    if subject is not None:
        event["subject"] = subject
    return event


class EventBus:
    """Per-process buffered publisher to Celery's event exchange (restarted after a fork)."""

    def __init__(self, app: Celery, enabled: bool = True) -> None:
        self.app = app
        self.enabled = enabled
        self.source = f"ojs://{app.main or 'celery'}/{socket.gethostname()}/{os.getpid()}"
        self._pid = -1
        self._queue: queue.Queue[Event | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def emit(self, type_: str, data: dict[str, Any], subject: str | None = None) -> Event:
        """Send the event's signals now and queue its bus copy."""
        event = make_event(type_, data, subject, self.source)
        signals.ojs_event.send(sender=type_, event=event)
        specific = signals.BY_TYPE.get(type_)
        if specific is not None:
            specific.send(sender=type_, event=event)
        if self.enabled:
            self._ensure_thread()
            self._queue.put(event)
        return event

    def emit_all(self, events: Iterable[tuple[str, dict[str, Any]]]) -> None:
        for type_, data in events:
            self.emit(type_, data, subject=data.get("job_id") or data.get("worker_id"))

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until the buffer is published (at exit, and in tests)."""
        if self._thread is None or self._pid != os.getpid():
            return
        done = threading.Event()
        self._queue.put({"__flush__": done})
        done.wait(timeout)

    def _ensure_thread(self) -> None:
        if self._pid == os.getpid() and self._thread is not None:
            return
        with self._lock:
            if self._pid == os.getpid() and self._thread is not None:
                return
            self._pid = os.getpid()
            self.source = f"ojs://{self.app.main or 'celery'}/{socket.gethostname()}/{self._pid}"
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._run, name="ojs-events", daemon=True)
            self._thread.start()
            atexit.register(self.flush)

    def _run(self) -> None:
        dispatcher = None
        connection = None
        while True:
            batch, flushes = self._take_batch()
            if batch:
                try:
                    if dispatcher is None:
                        connection = self.app.connection_for_write()
                        dispatcher = self.app.events.Dispatcher(
                            connection, enabled=True, buffer_while_offline=False
                        )
                    dispatcher.send(BUS_EVENT_TYPE, ojs_events=batch, retry=True,
                                    retry_policy={"max_retries": 3})
                except Exception as exc:
                    logger.warning("ojs_celery: could not publish %d event(s): %r",
                                   len(batch), exc)
                    if connection is not None:
                        connection.release()
                    dispatcher = connection = None
            for done in flushes:
                done.set()

    def _take_batch(self) -> tuple[list[Event], list[threading.Event]]:
        """Block for one event, then take what else is waiting: one bus message per batch
        keeps a process's events in order and costs one publish for many transitions."""
        batch: list[Event] = []
        flushes: list[threading.Event] = []
        item: Event | None = self._queue.get()
        while item is not None:
            if "__flush__" in item:
                flushes.append(item["__flush__"])
            else:
                batch.append(item)
            if len(batch) >= MAX_BATCH:
                break
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                item = None
        return batch, flushes


def listen(
    app: Celery,
    handler: Callable[[Event], None],
    *,
    limit: int | None = None,
    timeout: float | None = None,
    ready: threading.Event | None = None,
) -> None:
    """Call ``handler`` for every OJS event on the bus until ``limit`` events or ``timeout``.

    ``ready`` is set once the receiver is bound, so nothing published after it is missed.
    """
    with app.connection_for_read() as connection:

        def on_event(raw: dict[str, Any]) -> None:
            for event in raw.get("ojs_events") or ():
                if isinstance(event, dict):
                    handler(event)

        receiver = app.events.Receiver(connection, handlers={BUS_EVENT_TYPE: on_event})
        if ready is not None:
            receiver.on_consume_ready = lambda *_a, **_k: ready.set()
        try:
            receiver.capture(limit=limit, timeout=timeout, wakeup=False)
        except TimeoutError:
            return
