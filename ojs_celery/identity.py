"""The worker id: one per worker process, inherited by its prefork pool children.

Completing and failing an attempt are fenced on it, so it must be the same in the main process
(hard time limits, lost children) and in the children (handler outcomes). ``install`` assigns a
fresh id when a worker starts (``worker_init``), before the pool forks.

Why process state and not an attribute of a per-worker object: the pool children, where handler
outcomes are written, have no worker object at all (Celery gives a child its app and the task
request, nothing of the ``WorkController`` or consumer that forked it); what a child knows of
its worker is what it inherited at fork. One ``celery worker`` runs per process tree, so a
value set in the main process before the fork is exactly "this worker". The main process's
bootsteps read it once into their :class:`~ojs_celery.worker.node.WorkerNode`.
"""

from __future__ import annotations

from .envelope import new_job_id


class _Identity:
    """What this module keeps (see the module docstring for why it is per process)."""

    worker_id: str | None = None
    #: The worker's node name and whether it sends Celery task events (``-E``,
    #: ``worker_send_task_events``): None in a process that is no worker.
    nodename: str | None = None
    task_events: bool | None = None


_identity = _Identity()


def new_worker_id() -> str:
    return "worker_" + new_job_id()


def assign_worker_id() -> str:
    """Give this process (and the children it will fork) a new worker id."""
    _identity.worker_id = new_worker_id()
    return _identity.worker_id


def note_worker(nodename: str, task_events: bool) -> None:
    """Remember the worker's node name and task-events choice for this process and the pool
    children it forks: ``-E`` sets no setting a child could read, and a child has no consumer
    event dispatcher to ask."""
    _identity.nodename, _identity.task_events = nodename, task_events


def worker_nodename() -> str | None:
    """The node name of the worker this process belongs to; None outside a worker."""
    return _identity.nodename


def worker_task_events() -> bool | None:
    """Whether the worker this process belongs to sends task events; None outside a worker."""
    return _identity.task_events


def current_worker_id() -> str:
    """This worker's id; a process that is no worker (a producer, a test) gets its own."""
    if _identity.worker_id is None:
        return assign_worker_id()
    return _identity.worker_id
