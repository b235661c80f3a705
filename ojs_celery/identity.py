"""The worker id: one per worker process, inherited by its prefork pool children.

Completing and failing an attempt are fenced on it, so it must be the same in the main process
(hard time limits, lost children) and in the children (handler outcomes). ``install`` assigns a
fresh id when a worker starts, before the pool forks.
"""

from __future__ import annotations

import os

from .envelope import new_job_id

_worker_id: str | None = None
_pid: int | None = None


def new_worker_id() -> str:
    return "worker_" + new_job_id()


def assign_worker_id() -> str:
    """Give this process (and the children it will fork) a new worker id."""
    global _worker_id, _pid
    _worker_id = new_worker_id()
    _pid = os.getpid()
    return _worker_id


def current_worker_id() -> str:
    """This worker's id; a process that is no worker (a producer, a test) gets its own."""
    if _worker_id is None:
        return assign_worker_id()
    return _worker_id
