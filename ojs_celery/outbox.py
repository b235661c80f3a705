"""Outbox acknowledgements, off the caller's path.

A store write that needs a message records an outbox entry; once the message is published the
entry is cleared (``ack_dispatch``). Nothing waits for that clearing: until it happens the only
consequence is that the sweeper may publish the message again after ``dispatch_grace``, and
fencing drops such a duplicate. So :class:`DispatchAcker` queues the acknowledgements and a
background thread clears them in batches (one pipelined round trip on Redis), which takes one
store round trip off every ``enqueue``. The sweeper flushes it before and after a pass, so a
process never republishes what it has just published itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .batching import Batcher
from .store import JobStore

logger = logging.getLogger(__name__)

#: Seconds the acker waits after an acknowledgement for more to batch with it (far below any
#: ``dispatch_grace``).
LINGER = 0.05
MAX_BATCH = 500


class DispatchAcker(Batcher[tuple[str, int]]):
    """Per-process batched ``ack_dispatch`` (restarted after a fork, flushed at exit)."""

    thread_name = "ojs-outbox"

    def __init__(self, store: Callable[[], JobStore]) -> None:
        super().__init__(linger=LINGER, max_batch=MAX_BATCH)
        self._store = store

    def ack(self, job_id: str, token: int) -> None:
        """The message for ``token`` was published: clear the job's outbox entry soon."""
        self.put((job_id, token))

    def _open(self) -> Callable[[list[tuple[str, int]]], None]:
        return self._ack_batch

    def _ack_batch(self, batch: list[tuple[str, int]]) -> None:
        try:
            self._store().ack_dispatch_many(batch)
        except Exception as exc:  # the entries stay: the sweeper republishes, fencing dedups
            logger.warning("ojs_celery: could not clear %d outbox entr(ies): %r", len(batch), exc)
