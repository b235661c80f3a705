"""The BEAT bootstep: every ``heartbeat_interval``, from a thread of its own (a solo-pool worker
running a long job still beats), the worker reports its state and the OJS jobs it runs and
holds, extends the reservation of the jobs it owns, and picks up a pending directive."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from celery import bootsteps

from ..faults import OncePerKind
from ..header import token_of
from .directives import DirectivesStep
from .node import WorkerNode, node_of, ojs_requests

logger = logging.getLogger(__name__)

#: One ``worker.heartbeat`` event every this many beats (the bus is not a metrics pipe).
HEARTBEAT_EVENT_EVERY = 12


class Beater:
    """The beat thread of one worker."""

    def __init__(self, node: WorkerNode) -> None:
        self.node = node
        self._lock = threading.Lock()  # one beat at a time; none after stop()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beats = 0
        #: ``time.monotonic()`` of the last write of this worker's record the store took (the
        #: registration just before this step started, then each beat); None: none yet (its
        #: registration failed)
        self._last_taken: float | None = time.monotonic() if node.registered else None
        self._faults = OncePerKind(logger, f"beat of worker {node.worker_id}")

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ojs-beat", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """No beat runs after this returns (the record may be deleted safely)."""
        with self._lock:
            self._stop.set()

    def _run(self) -> None:
        """Beat on a fixed schedule: a slow beat does not push the next ones later (worker
        protocol 4.6: a failed beat is retried at the next interval, never slower)."""
        interval = self.node.settings.heartbeat_interval
        due = time.monotonic() + interval
        while not self._stop.wait(max(due - time.monotonic(), 0.0)):
            self.beat()
            due += interval
            now = time.monotonic()
            if due <= now:  # a beat outlasted the interval: beat again now, then on schedule
                due = now

    def soon(self) -> None:
        """Report a state change at once rather than at the next interval."""
        threading.Thread(target=self.beat, name="ojs-beat-now", daemon=True).start()

    def beat(self) -> None:
        """One BEAT; whatever it meets is logged (once per kind) and the next one tries again."""
        with self._lock:
            if self._stop.is_set():
                return
            try:
                self._beat()
            except Exception as exc:
                self._faults.failed(exc)
            else:
                self._faults.succeeded()

    def _beat(self) -> None:
        node = self.node
        info = node.info()
        directive, known = node.registry.beat(info)
        taken, self._last_taken = self._last_taken, time.monotonic()
        if taken is None:  # its registration failed at start: no record to find yet
            logger.warning("ojs_celery: worker %s registered at its first beat that reached "
                           "the store (queues %s)", node.worker_id, info.queues)
        elif not known:
            self._declared_dead(taken)
        for request in ojs_requests():
            self._extend(request, info.last_beat)
        self._beats += 1
        if self._beats % HEARTBEAT_EVENT_EVERY == 1:
            node.runtime.bus.emit("worker.heartbeat", {
                "worker_id": node.worker_id, "state": node.state,
                "active_jobs": len(info.active_job_ids), "queues": info.queues,
            }, subject=node.worker_id)
        if directive is not None:
            node.directives.apply_soon(directive, "directive")

    def _declared_dead(self, taken: float) -> None:
        """A beat found this worker's record gone: a sweeper declared it dead. When its last
        beat reached the store less than ``worker_heartbeat_timeout`` ago (this host's
        monotonic clock), the worker was not silent that long: the sweeper's wall clock is
        ahead of this host's (the beats carry this host's time), and it will be declared dead
        again at every sweep until the clocks agree. Say so, instead of a freeze."""
        node = self.node
        timeout = node.settings.worker_heartbeat_timeout
        silent = time.monotonic() - taken
        if silent < timeout:
            logger.error("ojs_celery: worker %s was declared dead although its last beat "
                         "reached the store %.1fs ago (worker_heartbeat_timeout %.1fs): a "
                         "sweeper's clock is ahead of this host's by about %.0fs or more "
                         "(the beats carry this host's time; keep the hosts' clocks "
                         "synchronised); its running jobs failed with worker_death: "
                         "registering again", node.worker_id, silent, timeout,
                         timeout - silent)
        else:
            logger.warning("ojs_celery: worker %s is not registered (declared dead while "
                           "it was frozen or cut off?): registering again", node.worker_id)

    def _extend(self, request: Any, now: float) -> None:
        token = token_of(request)
        if token is None:
            return
        node = self.node
        stall = getattr(request.task, "heartbeat", "worker") != "handler"
        done = node.runtime.store.extend(request.id, token, node.worker_id, stall=stall, now=now)
        if done.applied:
            # job.heartbeat: at an attempt's first beat, then every HEARTBEAT_EVENT_EVERY
            # beats, as worker.heartbeat (the bus is no place for every beat of every job)
            beats = getattr(request, "_ojs_beats", 0)
            request._ojs_beats = beats + 1
            if beats % HEARTBEAT_EVENT_EVERY == 0:
                node.runtime.emit(done)
        elif done.reason not in ("stale", "not_active", "unknown_job"):
            logger.info("ojs_celery: beat did not extend job %s (%s)", request.id, done.reason)


class BeatStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Starts the worker's beat thread (once; consumer restarts start steps again); stops it
    when the worker leaves the registry (see ``registration.deregister``)."""

    requires = (DirectivesStep,)  # a beat may bring a directive
    label = "OJS beat"

    def start(self, parent: Any) -> None:
        node = node_of(parent)
        if getattr(node, "beat", None) is None:
            node.beat = Beater(node)
            node.beat.start()
