"""The start gate: whether this worker's pool processes may still start jobs.

The shutdown drain closes it when its cancellation window begins (D − window): a job started
after that would get its cancellation signal at once, and fail with ``shutdown``, burning an
attempt (discarding a job on its last one) without having done any work. Those are the jobs
Celery had handed to the pool but no process had taken yet (prefetched): once the gate is
closed, each one's start sends its message back to the broker instead, unstarted, and another
worker runs it as the attempt it was published for.

The gate is one byte of shared memory, made in the worker's main process before the pool forks
(``worker_init``), so that every pool process, replacements included, reads the main process's
write without a system call. In a process that never prepared it (a producer, eager mode, a
test) it stays open.
"""

from __future__ import annotations

import mmap

_CLOSED = 1


class StartGate:
    """One per process; see the module docstring."""

    def __init__(self) -> None:
        self._page: mmap.mmap | None = None

    def prepare(self) -> None:
        """In the worker's main process, before the pool forks: open, and shared."""
        if self._page is None:
            self._page = mmap.mmap(-1, 1)

    def close(self) -> None:
        """The drain's cancellation window began: start no more jobs."""
        if self._page is not None:
            self._page[0] = _CLOSED

    def is_open(self) -> bool:
        return self._page is None or self._page[0] != _CLOSED


start_gate = StartGate()
