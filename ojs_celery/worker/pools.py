"""Which Celery pools enforce Celery's time limits: one home for the rule that the worker's
start warning, the migration report and the worker's registration (read by the sweeper) share.
"""

from __future__ import annotations

from typing import Any

from celery.concurrency import prefork

#: Pools whose time limits Celery does not enforce, and what is missing there.
WEAK_POOLS = {
    "solo": "soft and hard time limits",
    "threads": "soft and hard time limits",
    "thread": "soft and hard time limits",
    "gevent": "time limits in code that does not yield (OJS raises the soft limit and gevent "
              "the hard one at the handler's next switch)",
    "eventlet": "soft and hard time limits",
}


def pool_name(pool_cls: Any) -> str:
    """``"prefork"`` for ``celery.concurrency.prefork:TaskPool``, its class or ``"prefork"``."""
    text = pool_cls if isinstance(pool_cls, str) else getattr(pool_cls, "__module__", "")
    return str(text).rsplit(".", 1)[-1].rsplit(":", 1)[0]


def enforces_time_limits(pool_cls: Any) -> bool:
    """Whether a worker on this pool ends an attempt at its hard time limit by itself: the
    prefork pool and its subclasses (the main process kills the pool process; the handler's
    own thread cannot delay that). Another pool, or one named but not loaded, is not known to."""
    if isinstance(pool_cls, type):
        return issubclass(pool_cls, prefork.TaskPool)
    return pool_name(pool_cls) == "prefork"
