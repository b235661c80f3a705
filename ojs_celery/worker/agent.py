"""The OJS worker protocol for one Celery worker process: registration, BEAT, directives.

The agent registers the worker in the store, then beats every ``heartbeat_interval`` from a
thread of its own (a solo-pool worker running a long job still beats): each beat reports the
worker's state and the OJS jobs it runs and holds, extends the reservation of the jobs this
worker owns, and returns the state the worker must adopt: a pending one-shot directive, or the
state it reported. Quiet stops consuming (what is running or reserved finishes); running resumes.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from celery.worker import state as worker_state

from ..header import token_of
from ..identity import current_worker_id
from ..runtime import Runtime
from ..store import StoreError, WorkerInfo

logger = logging.getLogger(__name__)

STATES = ("running", "quiet", "terminate")
DIRECTIVES = ("quiet", "resume", "terminate")
#: One ``worker.heartbeat`` event every this many beats (the bus is not a metrics pipe).
HEARTBEAT_EVENT_EVERY = 12


def _snapshot(requests: Any) -> list[Any]:
    """A copy of one of Celery's request sets, which the main thread changes as we read."""
    for _ in range(5):
        try:
            return list(requests)
        except RuntimeError:
            continue
    return []


def ojs_requests(active: bool = True) -> list[Any]:
    """The OJS requests this worker runs (``active``) or holds without running."""
    running = _snapshot(worker_state.active_requests)
    if active:
        return [r for r in running if token_of(r) is not None]
    running_ids = {r.id for r in running}
    return [r for r in _snapshot(worker_state.reserved_requests)
            if token_of(r) is not None and r.id not in running_ids]


class WorkerAgent:
    """What one worker process does for the OJS worker protocol (see the module docstring)."""

    def __init__(self, runtime: Runtime, consumer: Any) -> None:
        self.runtime = runtime
        self.consumer = consumer
        self.settings = runtime.settings
        self.worker_id = current_worker_id()
        self.state = "running"
        self.started_at = time.time()
        self._queues: list[str] = []
        self._lock = threading.Lock()
        self._beat_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beats = 0
        self.on_terminate: Callable[[str], None] = lambda reason: None

    # ------------------------------------------------------------------ registration

    def info(self) -> WorkerInfo:
        consumer = self.consumer
        pool = getattr(consumer, "pool", None)
        concurrency = getattr(consumer.controller, "concurrency", None) or getattr(
            pool, "limit", None) or 1
        return WorkerInfo(
            worker_id=self.worker_id,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            nodename=str(getattr(consumer, "hostname", "")),
            queues=list(self._queues),
            concurrency=int(concurrency),
            labels=list(self.settings.labels),
            started_at=self.started_at,
            state=self.state,
            last_beat=time.time(),
            active_job_ids=[r.id for r in ojs_requests()],
            reserved_job_ids=[r.id for r in ojs_requests(active=False)],
        )

    def start(self) -> None:
        """Register and start beating (once per process; consumer restarts call it again)."""
        if self._thread is not None:
            return
        self._queues = [q.name for q in self.consumer.task_consumer.queues]
        info = self.info()
        try:
            self.runtime.store.workers.save(info)
        except StoreError as exc:
            logger.warning("ojs_celery: could not register worker %s (will retry with the "
                           "next beat): %s", self.worker_id, exc)
        self.runtime.bus.emit("worker.started", {
            "worker_id": self.worker_id, "queues": info.queues,
            "concurrency": info.concurrency, "hostname": info.hostname, "pid": info.pid,
        }, subject=self.worker_id)
        logger.info("ojs_celery: worker %s registered (queues %s)", self.worker_id, info.queues)
        self._thread = threading.Thread(target=self._run, name="ojs-beat", daemon=True)
        self._thread.start()

    def deregister(self, reason: str) -> None:
        with self._beat_lock:  # no beat may write the record back after this
            self._stop.set()
            try:
                self.runtime.store.workers.remove(self.worker_id)
            except StoreError as exc:
                logger.warning("ojs_celery: could not deregister worker %s: %s",
                               self.worker_id, exc)
        self.runtime.bus.emit("worker.stopped", {
            "worker_id": self.worker_id, "reason": reason,
            "uptime_ms": round((time.time() - self.started_at) * 1000),
        }, subject=self.worker_id)
        self.runtime.bus.flush()

    # ------------------------------------------------------------------ beats

    def _run(self) -> None:
        interval = self.settings.heartbeat_interval
        while not self._stop.wait(interval):
            self.beat()

    def beat(self) -> str:
        """One BEAT; returns the state the worker was told to adopt."""
        with self._beat_lock:
            if self._stop.is_set():
                return self.state
            return self._beat()

    def _beat(self) -> str:
        store = self.runtime.store
        info = self.info()
        try:
            directive = store.meta.take_directive(self.worker_id)
            if store.workers.get(self.worker_id) is None:
                logger.warning("ojs_celery: worker %s is not registered (declared dead while "
                               "it was frozen or cut off?): registering again", self.worker_id)
            store.workers.save(info)
            for request in ojs_requests():
                self._extend(request, info.last_beat)
        except StoreError as exc:
            logger.warning("ojs_celery: beat of worker %s failed, retrying at the next "
                           "interval: %s", self.worker_id, exc)
            return self.state
        self._beats += 1
        if self._beats % HEARTBEAT_EVENT_EVERY == 1:
            self.runtime.bus.emit("worker.heartbeat", {
                "worker_id": self.worker_id, "state": self.state,
                "active_jobs": len(info.active_job_ids), "queues": info.queues,
            }, subject=self.worker_id)
        if directive is not None:
            threading.Thread(target=self.apply, args=(directive, "directive"),
                             daemon=True).start()
        return self.state

    def _extend(self, request: Any, now: float) -> None:
        token = token_of(request)
        if token is None:
            return
        stall = getattr(request.task, "heartbeat", "worker") != "handler"
        done = self.runtime.store.extend(request.id, token, self.worker_id, stall=stall, now=now)
        if not done.applied and done.reason not in ("stale", "not_active", "unknown_job"):
            logger.info("ojs_celery: beat did not extend job %s (%s)", request.id, done.reason)

    # ------------------------------------------------------------------ state changes

    def apply(self, wanted: str, source: str) -> None:
        """Adopt ``wanted`` (quiet, resume/running, terminate) if the transition is valid."""
        with self._lock:
            current = self.state
            if current == "terminate":
                return  # no way back from terminate
            if wanted == "quiet" and current == "running":
                self.state = "quiet"
                self.consumer.call_soon(self._stop_consuming)
                logger.warning("ojs_celery: worker %s is quiet (%s): no new jobs", self.worker_id,
                               source)
                self.runtime.bus.emit("worker.quiet", {
                    "worker_id": self.worker_id, "active_jobs": len(ojs_requests()),
                }, subject=self.worker_id)
            elif wanted in ("resume", "running") and current == "quiet":
                self.state = "running"
                self.consumer.call_soon(self._resume_consuming)
                logger.warning("ojs_celery: worker %s is running again (%s)", self.worker_id,
                               source)
            elif wanted == "terminate":
                self.state = "terminate"
            else:
                return
        if self.state == "terminate":
            self.on_terminate(source)
        else:
            self.beat_soon()

    def beat_soon(self) -> None:
        """Report a state change at once rather than at the next interval."""
        threading.Thread(target=self.beat, name="ojs-beat-now", daemon=True).start()

    def stop_consuming(self) -> None:
        self.consumer.call_soon(self._stop_consuming)

    def _stop_consuming(self) -> None:
        self._each_queue(self.consumer.cancel_task_queue)

    def _resume_consuming(self) -> None:
        self._each_queue(self.consumer.add_task_queue)

    def _each_queue(self, change: Callable[[str], Any]) -> None:
        """Cancel or re-add every queue this worker consumed at start (in the consumer's
        thread, via ``call_soon``); a queue already in that state is not an error."""
        for name in self._queues:
            try:
                change(name)
            except Exception as exc:
                logger.debug("ojs_celery: %s(%s): %r", getattr(change, "__name__", change),
                             name, exc)
