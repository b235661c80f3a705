"""The worker-side remote-control command that stops one attempt, keyed by job id and token.

Celery's ``revoke(terminate=True)`` is keyed by task id and also adds the id to every worker's
revoked set, which would drop the job's later attempts (same task id). This command kills only
the pool process running the attempt that ``token`` started; the pool then reports the child
lost, and the OJS request sees that the attempt was already settled.

``install`` registers it (:func:`register`); importing this module registers nothing.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from celery.worker import state as worker_state
from celery.worker.control import Panel, control_command

from .effects import TERMINATE_COMMAND
from .header import token_of

logger = logging.getLogger(__name__)


def register() -> None:
    """Add ``ojs_terminate`` to Celery's remote-control commands (idempotent).

    Celery keeps one registry of commands for the whole process (the class-level dict
    ``celery.worker.control.Panel.data``, which every worker's pidbox node reads when a command
    arrives), not one per app: so the command is registered once per process, by the first
    ``install``, and answers for whichever worker of the process receives it.
    """
    if TERMINATE_COMMAND not in Panel.data:
        control_command(name=TERMINATE_COMMAND, args=[("job_id", str), ("token", int)],
                        signature="<job_id> <token>")(ojs_terminate)


def ojs_terminate(state: Any, job_id: str, token: int, **_: Any) -> dict[str, Any]:
    """Kill the pool process running ``job_id``'s attempt started by ``token``, if here."""
    for request in list(worker_state.active_requests):
        if request.id != job_id or token_of(request) != int(token):
            continue
        pool = state.consumer.pool
        if not request.worker_pid or request.worker_pid == os.getpid():
            logger.warning(
                "ojs_celery: job %s (token %s) runs in the worker's own process (solo or "
                "threads pool) and cannot be stopped; its late outcome will be rejected",
                job_id, token,
            )
            return {"ok": "not terminable on this pool"}
        try:
            pool.terminate_job(request.worker_pid, signal.SIGKILL)
        except NotImplementedError:
            logger.warning("ojs_celery: this pool cannot stop job %s; its late outcome will "
                           "be rejected", job_id)
            return {"ok": "not terminable on this pool"}
        logger.warning("ojs_celery: stopped job %s (token %s): the job store ended its attempt "
                       "(cancelled, timed out or recovered)", job_id, token)
        return {"ok": "terminated"}
    return {"ok": "not here"}
