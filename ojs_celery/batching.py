"""A per-process background thread that does queued work in batches, off the caller's path.

The event bus and the outbox acknowledgements use it: both are work a caller must not wait for,
and both cost one round trip per batch instead of one per item. After taking the first item the
thread lingers (up to ``linger`` seconds, or until ``max_batch`` items) so that a burst becomes
one batch; :meth:`Batcher.flush` ends the linger at once. Items are handled in the order they
were put. Each process has its own thread and queue: a forked child starts them on first use
(the parent's thread does not exist there), and every process flushes at exit. A fork waits
for the batch being handled (see :meth:`Batcher.before_fork`).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Generic, TypeVar

from .forking import forget_in_children, hold_forks

logger = logging.getLogger(__name__)

T = TypeVar("T")
Handler = Callable[[list[T]], None]
#: How long a fork waits for a batch being handled (one round trip, unless a server hangs:
#: then the fork goes on, as it did before it waited).
FORK_WAIT = 1.0


class _Flush:
    """A flush request in the queue: set once everything queued before it is handled."""

    def __init__(self) -> None:
        self.done = threading.Event()


class Batcher(ABC, Generic[T]):
    """Hand items to :meth:`put`; a daemon thread passes them to a handler in batches.

    Subclasses implement :meth:`_open`, called in each new thread, which returns the handler
    for that thread (so a handler's connections are never shared with a forked parent).
    """

    #: Thread name (shown by py-spy and in logs).
    thread_name = "ojs-batcher"

    def __init__(self, linger: float, max_batch: int) -> None:
        self.linger = linger
        self.max_batch = max_batch
        self._pid = -1
        #: A SimpleQueue: its put (every job's events) costs a fraction of a queue.Queue's.
        self._queue: queue.SimpleQueue[T | _Flush] = queue.SimpleQueue()
        self._wake = threading.Event()  # ends a linger early: a flush, or a full batch
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: Held while a batch is handled, and by a fork (see :meth:`before_fork`).
        self._handling = threading.Lock()
        self._held_for_fork = False
        forget_in_children(self)
        hold_forks(self)

    def forget_parent(self) -> None:
        """A forked child has no thread yet: forget the parent's at the fork itself, so that
        put() need not compare pids (a system call) every time."""
        self._thread = None
        self._lock = threading.Lock()
        self._handling = threading.Lock()
        self._held_for_fork = False

    def before_fork(self) -> None:
        """A fork waits (at most :data:`FORK_WAIT`) until no batch is being handled: the thread
        would otherwise be inside a client library at the fork, maybe holding a connection
        pool's lock, which the child then finds held for ever (see :mod:`ojs_celery.forking`).
        Celery's prefork pool forks a replacement child while this process's thread runs."""
        self._held_for_fork = self._handling.acquire(timeout=FORK_WAIT)

    def after_fork_in_parent(self) -> None:
        if self._held_for_fork:
            self._held_for_fork = False
            self._handling.release()

    @abstractmethod
    def _open(self) -> Handler[T]:
        """The handler of batches for a new thread."""

    def _started(self) -> None:
        """Hook: a thread was started for this process (after a fork, the first use)."""

    def put(self, item: T) -> None:
        self._ensure_thread()
        self._queue.put(item)
        if self._queue.qsize() >= self.max_batch:
            self._wake.set()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything put so far in this process is handled (at exit, in tests);
        False if that took longer than ``timeout`` (the items stay queued)."""
        if self._thread is None or self._pid != os.getpid():
            return True
        marker = _Flush()
        self._wake.set()  # before the marker: the thread that takes it first clears the wake
        self._queue.put(marker)
        return marker.done.wait(timeout)

    def _ensure_thread(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._pid == os.getpid() and self._thread is not None:
                return
            self._pid = os.getpid()
            self._queue = queue.SimpleQueue()
            self._wake = threading.Event()
            self._started()
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()
            atexit.register(self.flush)

    def _run(self) -> None:
        handle = self._open()
        while True:
            batch, flushes = self._take_batch()
            if batch:
                with self._handling:
                    try:
                        handle(batch)
                    except Exception:  # a handler logs its own failures; the thread lives on
                        logger.exception("ojs_celery: %s failed on %d item(s)", self.thread_name,
                                         len(batch))
            for marker in flushes:
                marker.done.set()

    def _take_batch(self) -> tuple[list[T], list[_Flush]]:
        """Block for one item, linger, then take what is waiting (up to ``max_batch``, and
        only up to a flush request). The linger is a plain wait, not a wait on the queue, so
        the callers' puts meanwhile do not wake this thread one by one. A full batch already
        waiting (a backlog: a burst, or a slow handler) goes at once, without a linger."""
        batch: list[T] = []
        flushes: list[_Flush] = []
        item = self._queue.get()
        if isinstance(item, _Flush):
            self._wake.clear()  # a flush of an idle thread: the next batch lingers as usual
        elif self._queue.qsize() + 1 < self.max_batch:
            self._wake.wait(self.linger)
            self._wake.clear()
        while True:
            if isinstance(item, _Flush):
                flushes.append(item)
                break
            batch.append(item)
            if len(batch) >= self.max_batch:
                break
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
        return batch, flushes
