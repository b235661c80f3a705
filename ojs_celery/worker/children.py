"""The pool-children bootstep: prefork children ignore SIGTSTP and SIGTERM, so that a signal sent
to the whole process group (Ctrl-Z, or systemd's SIGTERM) lets the main process drain instead of
killing running jobs.

``SIG_IGN`` is the one disposition billiard keeps when it resets a child's signals after
``worker_process_init`` (``install`` connects :func:`protect_child` to it). Billiard still stops
a child at a hard time limit (it follows SIGTERM with SIGKILL after 0.1 s), and on a cold
shutdown the main process kills its children itself (:meth:`PoolChildren.kill_all`), since they
no longer obey the SIGTERM that Celery would send them. A pool that shrinks (``--autoscale``,
``pool_shrink``) follows its SIGTERM to an idle child with SIGQUIT, which billiard's children
obey with the same clean exit (:func:`_stop_shrunk`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from billiard.common import TERM_SIGNAL
from billiard.process import current_process
from celery import bootsteps
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.platforms import signals

from .node import node_of
from .registration import RegistrationStep

logger = logging.getLogger(__name__)

#: billiard's name for a worker's main process (pool children are ``ForkPoolWorker-N``).
MAIN_PROCESS = "MainProcess"


def protect_child() -> None:
    """In each pool child (``worker_process_init``; the solo pool sends it in the main process,
    which keeps its handlers)."""
    if current_process().name == MAIN_PROCESS:
        return
    signal.signal(signal.SIGTSTP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class PoolChildren:
    """The pool processes of one worker, as the main process can reach them."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        _stop_shrunk(pool)
        _terminate_with_kill(pool)

    def holds(self, pid: int | None) -> bool:
        """Is ``pid`` one of this worker's pool processes? A request's ``worker_pid`` is one
        on the prefork pool; on the solo and threads pools it is this process, on gevent and
        eventlet a greenlet's id, which no signal reaches."""
        inner = getattr(self.pool, "_pool", None)
        return bool(pid) and pid != os.getpid() and any(
            getattr(process, "pid", None) == pid for process in getattr(inner, "_pool", None) or [])

    def kill(self, pid: int | None) -> bool:
        """Stop the child ``pid`` now (SIGKILL through the pool); False if it cannot be."""
        if not pid or pid == os.getpid():
            return False  # solo/threads pools run jobs in this process
        try:
            self.pool.terminate_job(pid, signal.SIGKILL)
        except (NotImplementedError, OSError) as exc:
            logger.warning("ojs_celery: could not stop pool process %s: %r", pid, exc)
            return False
        return True

    def kill_all(self) -> None:
        """Cold shutdown: stop every pool process now (they ignore SIGTERM).

        The pool first stops replacing dead processes (billiard's own first step of a
        terminate). A process killed while it held a lock of the pool's shared queues (an idle
        one waits for its next task holding the read lock of the task queue) never releases
        it, and billiard's exit-time finalizer, which takes that lock, would then wait forever
        (the non-async pool of transports without an event loop, e.g. the filesystem one):
        once the processes are gone, :func:`_free_shared_locks` frees what they held.
        """
        inner = getattr(self.pool, "_pool", None)
        handler = getattr(inner, "_worker_handler", None)
        if handler is not None and callable(getattr(handler, "terminate", None)):
            handler.terminate()
        killed = []
        for process in list(getattr(inner, "_pool", None) or []):
            pid = getattr(process, "pid", None)
            if pid and pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(process)
                except OSError as exc:
                    logger.debug("ojs_celery: kill child %s: %r", pid, exc)
        if killed and _gone(killed, KILLED_GONE):
            _free_shared_locks(inner)


#: How long a cold shutdown waits for SIGKILLed pool processes to be gone.
KILLED_GONE = 2.0


def _gone(processes: list[Any], timeout: float) -> bool:
    """Wait (bounded) until every one of ``processes`` has exited; False if one has not."""
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                return False
        except (AssertionError, OSError, ValueError) as exc:
            logger.debug("ojs_celery: join child %s: %r", getattr(process, "pid", None), exc)
            return False
    return True


def _stop_shrunk(pool: Any) -> None:
    """Make a prefork pool's ``shrink`` (the autoscaler's, the ``pool_shrink`` command's) take
    effect. Billiard shrinks by sending SIGTERM to idle processes, which ignore it here: each
    process it chose is then sent SIGQUIT, to which billiard's children answer with the clean
    exit that SIGTERM would have given them (its own handler, which releases the pool's locks).
    Billiard with ``REMAP_SIGTERM`` sends such a signal itself."""
    inner = getattr(pool, "_pool", None)
    shrink = getattr(pool, "shrink", None)
    if inner is None or not callable(shrink) or TERM_SIGNAL != signal.SIGTERM:
        return

    def chosen() -> set[Any]:
        return {process for process in list(getattr(inner, "_pool", None) or [])
                if getattr(process, "_controlled_termination", False)}

    def shrink_and_stop(n: int = 1) -> None:
        before = chosen()
        try:
            shrink(n)  # raises when fewer than n are idle, after choosing those that are
        finally:
            for process in chosen() - before:
                try:
                    os.kill(process.pid, signal.SIGQUIT)
                except OSError as exc:  # gone already
                    logger.debug("ojs_celery: stop shrunk child %s: %r", process.pid, exc)

    pool.shrink = shrink_and_stop


def _terminate_with_kill(pool: Any) -> None:
    """Make a terminate that asks for SIGTERM stop the job: ``revoke(terminate=True)``,
    ``celery control terminate``, Flower's terminate, of any task, OJS or not. Its pool process
    ignores SIGTERM here, so Celery would report the task revoked while it ran on to its end
    (and wrote SUCCESS over REVOKED); SIGKILL stops it, as SIGTERM does under plain Celery.
    Other signals (SIGUSR1, to raise ``SoftTimeLimitExceeded`` in the handler) go as asked."""
    terminate_job = getattr(pool, "terminate_job", None)
    if not isinstance(pool, PreforkPool) or not callable(terminate_job):
        return  # no pool processes that ignore SIGTERM

    def terminate_with_kill(pid: int, signum: Any = None) -> Any:
        wanted = signals.signum(signum or "SIGTERM")
        return terminate_job(pid, signal.SIGKILL if wanted == signal.SIGTERM else wanted)

    pool.terminate_job = terminate_with_kill


def _free_shared_locks(inner: Any) -> None:
    """Release the locks of the pool's shared queues that dead processes still hold: the task
    queue's read lock and the result queue's write lock (the pool's own threads never hold
    them before its finalizer, so a held one belongs to a killed process). Pools with one
    queue per process (the async pool of Redis and AMQP) have none."""
    for queue, name in ((getattr(inner, "_inqueue", None), "_rlock"),
                        (getattr(inner, "_outqueue", None), "_wlock")):
        lock = getattr(queue, name, None)
        if lock is None:
            continue
        try:
            lock.acquire(False)  # free or held by a killed process: taken by us either way
            lock.release()
        except (OSError, ValueError) as exc:
            logger.debug("ojs_celery: free pool lock %s: %r", name, exc)


class PoolChildrenStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Gives the worker its :class:`PoolChildren`."""

    requires = (RegistrationStep,)
    label = "OJS pool children"

    def start(self, parent: Any) -> None:
        node = node_of(parent)
        if getattr(node, "children", None) is None:
            node.children = PoolChildren(parent.pool)
