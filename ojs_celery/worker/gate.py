"""The start gate: whether a job reaching a pool process now may still start.

The shutdown drain cancels a running job when what is left of the drain reaches the job's
cancellation point (``min(its grace period, shutdown_cancel_window)``, :func:`cancel_point`). A
job that starts after that point would get its cancellation signal at once and fail with
``shutdown``, an attempt spent (a job discarded on its last one) on work it never did. Those are
the jobs Celery had handed to the pool that no process had taken yet (prefetched): such a job's
start sends its message back to the broker instead, unstarted, and another worker runs it as the
attempt it was published for. A job whose point is not reached yet starts, as it would have.

The gate holds the drain's end (a ``time.monotonic`` instant, the same clock in every process
of the machine) in eight bytes of shared memory, made in the worker's main process before the
pool forks (``worker_init``), so that every pool process, replacements included, reads the main
process's write without a system call. In a process that never prepared it (a producer, eager
mode, a test) every start may go ahead.
"""

from __future__ import annotations

import mmap
import struct
import time
from typing import Any

_INSTANT = struct.Struct("d")
_OPEN = 0.0


def cancel_point(time_limits: Any, window: float) -> float:
    """Seconds before the drain's end at which a job with Celery's ``time_limits`` (hard,
    soft) gets its cancellation signal: its grace period (hard − soft), at most ``window``."""
    hard, soft = time_limits or (None, None)
    grace = float(hard) - float(soft) if hard and soft else 0.0
    return min(grace, window)


class StartGate:
    """One per process; see the module docstring."""

    def __init__(self) -> None:
        self._page: mmap.mmap | None = None

    def prepare(self) -> None:
        """In the worker's main process, before the pool forks: shared, and open (a second
        worker in the same process starts with it open again)."""
        if self._page is None:
            self._page = mmap.mmap(-1, _INSTANT.size)
        _INSTANT.pack_into(self._page, 0, _OPEN)

    def drain_until(self, end: float) -> None:
        """The drain began and ends at ``end`` (``time.monotonic``)."""
        if self._page is not None:
            _INSTANT.pack_into(self._page, 0, end)

    def draining(self) -> bool:
        """Has the drain begun? (What every start asks first: it costs no more than a read.)"""
        return self._page is not None and _INSTANT.unpack_from(self._page, 0)[0] != _OPEN

    def too_late(self, time_limits: Any, window: float) -> bool:
        """Would a job with these ``time_limits`` starting now be cancelled at once?"""
        if self._page is None:
            return False
        end = float(_INSTANT.unpack_from(self._page, 0)[0])
        return end != _OPEN and end - time.monotonic() <= cancel_point(time_limits, window)


start_gate = StartGate()
