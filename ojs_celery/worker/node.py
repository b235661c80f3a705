"""What the OJS bootsteps of one worker process share: :class:`WorkerNode`.

The registration step creates it and hangs it on Celery's consumer as ``consumer.ojs`` (Celery's
own consumer steps share their parts the same way: ``c.task_consumer``, ``c.heart``); every
later step finds it there and adds its own part (``beat``, ``directives``, ``drain``,
``children``). Nothing of it is module state, so two workers in one process stay apart.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from celery.worker import state as worker_state

from ..header import token_of
from ..identity import current_worker_id
from ..runtime import Runtime
from ..store import WorkerInfo
from .pools import enforces_time_limits
from .registry import Registry

if TYPE_CHECKING:
    from .beat import Beater
    from .children import PoolChildren
    from .directives import Directives
    from .shutdown import Drain

logger = logging.getLogger(__name__)


def _snapshot(requests: Any) -> list[Any]:
    """A copy of one of Celery's request sets, which the main thread changes as we read."""
    for _ in range(5):
        try:
            return list(requests)
        except RuntimeError:
            continue
    return []


def ojs_requests(active: bool = True, consumer: Any = None) -> list[Any]:
    """The OJS requests this worker runs (``active``), or holds without running: prefetched,
    and, when ``consumer`` is given, held for an ETA (a retry's backoff, a job due in a few
    seconds) or in a rate limit's bucket."""
    running = _snapshot(worker_state.active_requests)
    if active:
        return [r for r in running if token_of(r) is not None]
    seen = {r.id for r in running}
    held = []
    for request in [*_snapshot(worker_state.reserved_requests),
                    *eta_held(getattr(consumer, "timer", None)), *bucket_held(consumer)]:
        if token_of(request) is not None and request.id not in seen:
            seen.add(request.id)
            held.append(request)
    return held


def eta_held(timer: Any) -> list[Any]:
    """The requests waiting for their ETA in this worker.

    Celery keeps them in ``celery.worker.state.scheduled_requests`` (5.7; a request that has
    left the timer for a rate-limit bucket stays there too) and, in every version, as the first
    argument of their entry on the consumer's timer (which is what ``celery inspect scheduled``
    reads: ``consumer.timer.schedule.queue``, a snapshot of kombu's heap).
    """
    requests = {r.id: r for r in _snapshot(getattr(worker_state, "scheduled_requests", ()))}
    schedule = getattr(timer, "schedule", None)
    for waiting in _snapshot(getattr(schedule, "queue", ())):
        entry = getattr(waiting, "entry", None)
        args = getattr(entry, "args", None)
        if args and not getattr(entry, "canceled", False) and hasattr(args[0], "id"):
            requests.setdefault(args[0].id, args[0])
    return list(requests.values())


def bucket_held(consumer: Any) -> list[Any]:
    """The requests waiting in a rate limit's bucket (a task's ``rate_limit``): Celery's
    consumer keeps them as ``(request, tokens)`` in ``task_buckets[name].contents`` until
    a token frees them, in no other set of requests."""
    buckets = getattr(consumer, "task_buckets", None) or {}
    held = []
    for bucket in _snapshot(buckets.values()):
        for item in _snapshot(getattr(bucket, "contents", ())):
            request = item[0] if isinstance(item, tuple) and item else None
            if hasattr(request, "id"):
                held.append(request)
    return held


def anything_running() -> bool:
    """Any request (OJS or not) still running in this worker, or handed to its pool and
    waiting there for a free process (Celery's ``execute_using_pool`` set its
    ``_apply_result``): the drain waits for those too, which start, or which the start gate
    sends back, while the worker still reads its pool's results. Left to Celery's warm
    shutdown instead, a message sent back while the pool closes could hold the worker up."""
    if worker_state.active_requests:
        return True
    return any(getattr(request, "_apply_result", None) is not None
               for request in _snapshot(worker_state.reserved_requests))


class WorkerNode:
    """One worker process as the OJS worker protocol sees it (see the module docstring)."""

    beat: Beater
    directives: Directives
    drain: Drain
    children: PoolChildren

    def __init__(self, runtime: Runtime, consumer: Any) -> None:
        self.runtime = runtime
        self.consumer = consumer
        self.settings = runtime.settings
        self.worker_id = current_worker_id()
        self.registry = Registry(runtime, self.worker_id)
        self.started_at = time.time()
        #: The queues the task consumer listened on when last seen (see consumed_queues).
        self._consumed: list[str] = [q.name for q in consumer.task_consumer.queues]
        self.time_limits = enforces_time_limits(getattr(consumer.controller, "pool_cls", ""))
        #: What the beats report: "running", "quiet" or "terminate".
        self.state = "running"
        self.state_lock = threading.Lock()
        self.left = False  # deregistered: set once, under state_lock
        #: The store took this worker's record at start (else its first beat registers it).
        self.registered = False
        #: The OJS requests it held without running them at the last :meth:`info` (a beat):
        #: what a failed broker connection may have dropped (:mod:`.reconnect`).
        self.last_held: list[Any] = []

    def consumed_queues(self) -> list[str]:
        """The names of the queues the worker's task consumer listens on now (``add_consumer``
        adds to them, ``cancel_consumer`` drops from them). Not Celery's ``consume_from``:
        without ``-Q``, before Celery 5.7, that is every queue the app knows, one this process
        only published to included. While the consumer restarts (no task consumer), the last
        ones seen. Read from the beat's thread too: ``list`` copies the consumer's dict at once
        under the GIL."""
        task_consumer = getattr(self.consumer, "task_consumer", None)
        if task_consumer is not None:
            try:
                self._consumed = list(dict.fromkeys(
                    str(queue.name) for queue in list(task_consumer.queues)))
            except Exception as exc:
                logger.debug("ojs_celery: the worker's queues: %r", exc)
        return list(self._consumed)

    def serving_queues(self) -> list[str]:
        """The queues the registry lists for this worker: those it consumes now and those a
        quiet stopped (a resume consumes them again)."""
        directives = getattr(self, "directives", None)
        stopped = directives.stopped if directives is not None else []
        return list(dict.fromkeys([*self.consumed_queues(), *stopped]))

    def info(self) -> WorkerInfo:
        """The registry record of this worker as of now."""
        consumer = self.consumer
        pool = getattr(consumer, "pool", None)
        concurrency = getattr(consumer.controller, "concurrency", None) or getattr(
            pool, "limit", None) or 1
        self.last_held = ojs_requests(active=False, consumer=consumer)
        return WorkerInfo(
            worker_id=self.worker_id,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            nodename=str(getattr(consumer, "hostname", "")),
            queues=self.serving_queues(),
            concurrency=int(concurrency),
            labels=list(self.settings.labels),
            time_limits=self.time_limits,
            heartbeat_timeout=self.settings.worker_heartbeat_timeout,
            started_at=self.started_at,
            state=self.state,
            last_beat=time.time(),
            active_job_ids=[r.id for r in ojs_requests()],
            reserved_job_ids=[r.id for r in self.last_held],
        )


def node_of(consumer: Any) -> WorkerNode:
    """The node the registration step created for ``consumer``."""
    node: WorkerNode = consumer.ojs
    return node
