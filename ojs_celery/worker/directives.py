"""The directives bootstep: the worker's state (running, quiet, terminate) and its changes.

A change comes from a one-shot directive picked up by a beat (``ojs-celery workers quiet``) or
from a signal (SIGTSTP, SIGCONT, SIGTERM, SIGINT). Quiet stops consuming (what is running or
reserved finishes); resume consumes again; terminate hands over to the drain, for good.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from celery import bootsteps

from .. import compat
from ..faults import OncePerKind
from .node import WorkerNode, node_of, ojs_requests
from .registration import RegistrationStep

logger = logging.getLogger(__name__)


def _nothing() -> None:
    """A callback that only makes :func:`ojs_celery.compat.call_soon` prepare its waker."""


class Directives:
    """Applies state changes to one worker."""

    def __init__(self, node: WorkerNode) -> None:
        self.node = node
        self._faults = OncePerKind(logger, f"a state change of worker {node.worker_id}")
        #: The queues the last quiet (or the drain) cancelled: what a resume consumes again.
        self.stopped: list[str] = []
        #: The changes :meth:`apply_soon` hands to the thread that applies them, in order.
        self._wanted: queue.SimpleQueue[tuple[str, str] | None] = queue.SimpleQueue()
        threading.Thread(target=self._apply_wanted, name="ojs-directive", daemon=True).start()

    def apply_soon(self, wanted: str, source: str) -> None:
        """:meth:`apply` in the directives' own thread: signal handlers and beats must not
        block. The thread runs from the start, so this only queues: starting a thread here
        would wait for it to begin, which gevent forbids inside its event loop, where a
        monkey-patched worker's signal handlers may run."""
        self._wanted.put((wanted, source))

    def _apply_wanted(self) -> None:
        while (wanted := self._wanted.get()) is not None:
            self._apply_logged(*wanted)

    def close(self) -> None:
        """End the directives' thread (the worker stops: a worker started again in the same
        process, as tests do, gets its own)."""
        self._wanted.put(None)

    def _apply_logged(self, wanted: str, source: str) -> None:
        try:
            self.apply(wanted, source)
        except Exception as exc:
            self._faults.failed(exc)

    def apply(self, wanted: str, source: str) -> None:
        """Adopt ``wanted`` (quiet, resume/running, terminate) if the transition is valid."""
        node = self.node
        with node.state_lock:
            current = node.state
            if current == "terminate":
                return  # no way back from terminate
            if wanted == "quiet" and current == "running":
                node.state = "quiet"
                self.stop_consuming()
                logger.warning("ojs_celery: worker %s is quiet (%s): no new jobs",
                               node.worker_id, source)
                node.runtime.bus.emit("worker.quiet", {
                    "worker_id": node.worker_id, "active_jobs": len(ojs_requests()),
                }, subject=node.worker_id)
            elif wanted in ("resume", "running") and current == "quiet":
                node.state = "running"
                compat.call_soon(node.consumer, self._resume_consuming)
                logger.warning("ojs_celery: worker %s is running again (%s)", node.worker_id,
                               source)
            elif wanted == "terminate":
                node.state = "terminate"
            else:
                return
        if node.state == "terminate":
            node.drain.begin(source)
        else:
            node.beat.soon()

    def stop_consuming(self) -> None:
        compat.call_soon(self.node.consumer, self._stop_consuming)

    def _stop_consuming(self) -> None:
        """Cancel every queue the worker consumes now: those it started with and those
        ``celery control add_consumer`` added since (a queue it was told to drop,
        ``cancel_consumer``, is not consumed and stays dropped); remembered for a resume."""
        names = self.node.consumed_queues()
        self.stopped = list(dict.fromkeys([*self.stopped, *names]))
        self._each_queue(self.node.consumer.cancel_task_queue, names)

    def _resume_consuming(self) -> None:
        """Consume again what the quiet cancelled, and nothing else (forgotten once consumed
        again, so that a beat in between still lists them)."""
        names = list(self.stopped)
        self._each_queue(self.node.consumer.add_task_queue, names)
        self.stopped = [name for name in self.stopped if name not in names]

    def _each_queue(self, change: Callable[[str], Any], names: list[str]) -> None:
        """Cancel or re-add each of ``names`` (in the consumer's thread, via ``call_soon``); a
        queue already in that state is not an error."""
        for name in names:
            try:
                change(name)
            except Exception as exc:
                logger.debug("ojs_celery: %s(%s): %r", getattr(change, "__name__", change),
                             name, exc)


class DirectivesStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Gives the worker its :class:`Directives`."""

    requires = (RegistrationStep,)
    label = "OJS directives"

    def start(self, parent: Any) -> None:
        node = node_of(parent)
        if getattr(node, "directives", None) is None:
            node.directives = Directives(node)
            compat.call_soon(parent, _nothing)  # kombu < 5.7: sets up the hub's waker now

    def shutdown(self, parent: Any) -> None:
        directives = getattr(getattr(parent, "ojs", None), "directives", None)
        if directives is not None:
            directives.close()
