"""A worker whose ``ojsfs://`` broker folder is removed while it runs stops, with one line.

The folder held every message. A worker that made it again would consume an empty queue that
no producer's exchange routes to any more (the exchange tables went with the control folder),
so it stops instead, and exits with status 1 for its supervisor or its user to start it again
(its app's ``embedded_settings()`` makes the folders at the start). It stops as for SIGTERM:
the drain lets the running jobs finish within the grace period, fails what is left and
deregisters. Celery showed an "Unrecoverable error" with the transport's traceback, and then
waited for the running jobs without a bound.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from celery import bootsteps
from celery.exceptions import WorkerShutdown
from celery.worker import state as worker_state

from ..ojsfs import BrokerFolderMissing
from .node import node_of
from .shutdown import POLL, DrainStep

logger = logging.getLogger(__name__)

#: Seconds, beyond the grace period, that the stopping worker waits for its drain to end.
DRAIN_MARGIN = 30.0


class BrokerFolderStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Wraps the consumer's event loop (this consumer's only, once): a
    :class:`~ojs_celery.ojsfs.BrokerFolderMissing` from it is logged in one ERROR line and
    ends the worker through the drain, with exit status 1."""

    requires = (DrainStep,)
    label = "OJS broker folder"

    def start(self, parent: Any) -> None:
        loop = parent.loop
        if getattr(loop, "__ojs_broker_folder__", False):
            return  # consumer restarts (broker reconnects) start steps again

        @functools.wraps(loop)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return loop(*args, **kwargs)
            except BrokerFolderMissing as exc:
                logger.error("ojs_celery: the worker stops (exit status 1): %s", exc)
                _drain(parent)
                raise WorkerShutdown(1) from None

        guarded.__ojs_broker_folder__ = True  # type: ignore[attr-defined]
        parent.loop = guarded


def _drain(parent: Any) -> None:
    """Run the worker's drain, as SIGTERM does, and wait (bounded) until it has handed over to
    Celery's warm shutdown, which then finds nothing running."""
    node = node_of(parent)
    node.directives.apply("terminate", "its broker folder is missing")
    deadline = time.monotonic() + node.drain.grace + DRAIN_MARGIN
    while not _stopping() and time.monotonic() < deadline:
        time.sleep(POLL)


def _stopping() -> bool:
    """Whether Celery's shutdown was asked for (its handler sets the exit code, 0 included)."""
    return any(flag is not None and flag is not False
               for flag in (worker_state.should_stop, worker_state.should_terminate))
