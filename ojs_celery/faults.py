"""Failures of long-lived loops (the worker's beat, directives and drain; the sweep loop and
the sweep task), logged once per kind; and a condition that lasts, said at most so often.

A loop that meets an error keeps going (a Redis error reply, a PostgreSQL read-only
transaction, a bug in one request's data must not end the BEAT thread, or the sweeper declares a
live worker dead). Logging every occurrence would flood the log at every interval during an
outage, so each kind of failure is logged once, until the loop succeeds again; then a line
says so. Repeats are logged in one line at ``again_level``. A store's failure is one line (its
message says it all); any other error, a bug perhaps, comes with its traceback.
"""

from __future__ import annotations

import logging
import threading

from .store.base import StoreError


def kind_of(exc: BaseException) -> str:
    """The exception's class, and its cause's (a ``StoreError`` wraps many different faults)."""
    kind = type(exc).__qualname__
    cause = exc.__cause__
    return f"{kind}({type(cause).__qualname__})" if cause is not None else kind


class OncePerKind:
    """Logs a loop's failures, once per kind until the loop succeeds again."""

    def __init__(self, logger: logging.Logger, what: str, *, level: int = logging.WARNING,
                 again_level: int = logging.DEBUG) -> None:
        self.logger = logger
        self.what = what
        self.level = level
        self.again_level = again_level
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def failed(self, exc: BaseException) -> None:
        kind = kind_of(exc)
        with self._lock:
            first = kind not in self._seen
            self._seen.add(kind)
        if first:
            self.logger.log(self.level, "ojs_celery: %s failed (%s), retrying: %s", self.what,
                            kind, exc, exc_info=None if isinstance(exc, StoreError) else exc)
        else:
            self.logger.log(self.again_level, "ojs_celery: %s failed again (%s): %s", self.what,
                            kind, exc)

    def succeeded(self) -> None:
        with self._lock:
            recovered, self._seen = bool(self._seen), set()
        if recovered:
            self.logger.warning("ojs_celery: %s works again", self.what)


class AtMostEvery:
    """Says whether a lasting condition (an outcome waiting for the store, a clock out of
    step) is due to be logged again: the first time, then once every ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._said: float | None = None

    def due(self, now: float) -> bool:
        """``now`` on a monotonic clock; True: log it now (and count from now)."""
        if self._said is not None and now - self._said < self.seconds:
            return False
        self._said = now
        return True
