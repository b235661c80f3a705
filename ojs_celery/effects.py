"""What follows a transition the store accepted: the one hook every caller uses.

A transition (see :mod:`ojs_celery.lifecycle`) says what changed; once the store has written it,
:func:`carry_out` makes it visible and effective, always in the same order: emit its events,
stop the attempt it took the job from (when the caller is not that attempt's owner: the
sweeper, a cancel), publish the message it owes. The worker, the sweeper, the producer and the
API all go through here, so a new caller (the HTTP binding) cannot forget a step.
"""

from __future__ import annotations

import logging

from .lifecycle import Transition
from .producer import publish
from .runtime import Runtime

logger = logging.getLogger(__name__)

#: The remote-control command that stops one attempt (see :mod:`ojs_celery.control`).
TERMINATE_COMMAND = "ojs_terminate"


def carry_out(
    runtime: Runtime,
    done: Transition,
    *,
    stop_attempt: bool = False,
    publish_message: bool = True,
    raise_unpublished: bool = False,
) -> bool:
    """Emit ``done``'s events, stop the attempt it ended (``stop_attempt``), publish what it
    owes (``publish_message``); returns whether a message was published.

    A message that cannot be published stays in the outbox (the sweeper publishes it later):
    logged, whatever the error; with ``raise_unpublished`` a broker that is down is raised
    as :class:`~ojs_celery.BrokerUnavailable` (and any other error as it is), for the sweeper
    to tell an outage from a job's own fault.
    """
    if done.record is None:
        return False
    runtime.emit(done)
    before = done.previous
    if stop_attempt and before is not None and before.job.state == "active":
        stop_running_attempt(runtime, before.job.id, before.token)
    if not publish_message or done.publish is None:
        return False
    try:
        publish(runtime, done.record.job, done.publish, record=done.record)
    except Exception as exc:
        if raise_unpublished:
            raise
        log_unpublished(done.record.job.id, exc)
        return False
    return True


def log_unpublished(job_id: str, exc: BaseException) -> None:
    """The job is stored and owes a message that could not be sent: the sweeper sends it."""
    logger.error("ojs_celery: job %s is stored but its message could not be published (%s); "
                 "the sweeper publishes it later", job_id, exc)


def stop_running_attempt(runtime: Runtime, job_id: str, token: int) -> None:
    """Ask every worker to kill the attempt that ``token`` started (never revoke-by-id, which
    would make Celery drop the job's later messages too)."""
    try:
        runtime.app.control.broadcast(
            TERMINATE_COMMAND, arguments={"job_id": job_id, "token": token}, reply=False
        )
    except Exception as exc:
        logger.warning("ojs_celery: could not ask workers to stop job %s: %r", job_id, exc)
