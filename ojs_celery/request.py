"""The worker main process's side of an OJS attempt: hard time limits and lost children.

When billiard kills a child at the hard time limit, or a child dies, the child cannot report.
The main process fails the attempt in the store instead, once per attempt although Celery 5.7
reports a hard timeout up to three times (the compare-and-set on the attempt rejects the
repeats), and tells Celery's result backend only what the store accepted: RETRY when the job
will run again (no errbacks), FAILURE when it was discarded, nothing for a stale attempt;
SUCCESS when the store shows the job completed by this very attempt (the limit struck after the
store took its outcome, before Celery's trace could report it), which no one else would write.
A retry's next attempt is published only once that RETRY is stored (``ojs_carry_out``), as
for a retry decided in the pool process (``task.publish_the_retry``).

A pool process that OJS stopped itself (the shutdown drain, ``ojs_terminate``) was stopped
after the store transition that ended its attempt, whose maker reports it to the result
backend: Celery's REVOKED for the stopped process is not written over it.

A message whose child died, or hit a time limit, before its attempt started (the store still
shows the job waiting for this very token; or the store cannot say) goes back to the broker
instead of being acked: it is dispatched again, where an ack would leave the job waiting for the
sweeper's redispatch backstop.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import (
    SoftTimeLimitExceeded,
    Terminated,
    TimeLimitExceeded,
    WorkerLostError,
)
from celery import states
from celery.worker.request import Request
from celery.worker.state import task_ready
from kombu.transport.pyamqp import Channel as AMQPChannel

from . import arrival, lifecycle
from .effects import carry_out, event_repr, publish_owed, report_outcome
from .header import ABSENT, of_request, of_task_request, token_of
from .identity import current_worker_id
from .lifecycle import Transition
from .runtime import Runtime, get_runtime
from .store import StoreError

logger = logging.getLogger(__name__)


#: What a lost pool process's job became, as its log line says it.
_LOST_OUTCOMES = {"retried": "retried per its retry policy",
                  "stale": "its attempt had ended already, nothing to do"}


#: The request's attribute that holds a retry's transition, whose message waits for RETRY.
RETRY_OWED = "_ojs_retry_owed"


#: How early before the job's total deadline a hard kill still counts as the total's: the
#: pool's timer and this process's clock differ by a little.
TOTAL_DEADLINE_SLACK = 0.5


class OJSRequest(Request):  # type: ignore[misc]
    """Celery ``Request`` for OJS tasks (``OJSTask.Request``)."""

    #: What the main process wrote for this message's attempt ("retried", "discarded",
    #: "stale", "plain", "unstarted": the message goes back to the broker), so that Celery's
    #: repeated reports of one hard timeout write once.
    _ojs_failure_recorded: str | None = None
    #: Celery's (hard, soft) limits of the message, which its pool is given.
    time_limits: Any
    #: An OJS message with a hard limit and no soft one (a job without a grace period).
    _ojs_hard_only = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        hard, soft = self.time_limits
        self._ojs_hard_only = bool(hard and not soft and self._ojs_token() is not None)

    @property
    def _apply_result(self) -> Any:
        """Celery's weak reference to the pool's result of this request (its attribute)."""
        return self.__dict__.get("_ojs_apply_result")

    @_apply_result.setter
    def _apply_result(self, value: Any) -> None:
        """Set by Celery's ``execute_using_pool`` as soon as the pool took the message, before
        the pool process accepts it and its timers are armed. A job's own limits are its only
        ones: without a grace period it has no soft limit, where Celery and billiard fall back
        to the task's ``soft_time_limit`` or the app's ``task_soft_time_limit``, which would
        cancel it before its timeout. Only billiard's result says which soft limit it arms
        (``_soft_timeout``): 0 is none, both for the prefork pool's event loop and for
        billiard's timeout thread (which would take None for its own default). A soft limit
        equal to the hard one is no answer: the event loop sends it, then arms the hard one.
        The other pools (gevent, eventlet) enforce no soft limit of Celery's."""
        self.__dict__["_ojs_apply_result"] = value
        if value is None or not self._ojs_hard_only:
            return
        result = value()
        if result is not None and getattr(result, "_soft_timeout", None):
            result._soft_timeout = 0

    def _ojs_token(self) -> int | None:
        return token_of(self)

    def _ojs_attempt_running(self) -> bool:
        """An OJS message (not a plain one of an OJS task) that a pool process has taken."""
        return bool(self.time_start) and self._ojs_token() is not None

    def terminate(self, pool: Any, signal: Any = None) -> None:
        """``revoke(terminate=True)``: the job is cancelled in the store before a running
        attempt gets the signal: one that lets the handler go on (SIGUSR1 raises
        ``SoftTimeLimitExceeded`` in it, as the soft limit does) then ends a cancelled attempt,
        whose outcome is rejected, instead of reading as its timeout. (SIGTERM, Celery's
        default, reaches the pool process as SIGKILL: see ``worker.children``.)"""
        if self._ojs_attempt_running():
            cancel_in_store(self.task, self.id)
        super().terminate(pool, signal)

    def cancel(self, pool: Any, signal: Any = None, **options: Any) -> None:
        """Celery cancels a running ``acks_late`` task when the broker connection is lost
        (``worker_cancel_long_running_tasks_on_connection_loss``, Celery 6's default), so that
        its redelivered message runs it again; it would also stop listing it as running. An
        OJS attempt runs on instead, listed in the worker's beats: fencing drops the
        redelivered message, and the attempt records its own outcome in the job store. (Celery's
        cancel would kill the pool process: its SIGTERM reaches it as SIGKILL. A cold shutdown
        kills those itself.)"""
        if self._ojs_attempt_running():
            logger.warning("ojs_celery: job %s runs on although Celery cancels it (after a "
                           "lost broker connection, or in a cold shutdown): its attempt records "
                           "its own outcome, and its redelivered message will not run it again",
                           self.id)
            return
        super().cancel(pool, signal, **options)

    def acknowledge(self) -> None:
        """Celery's ack, unless the message's broker channel has closed since its delivery
        (a lost connection, a broker restart, RabbitMQ's ``consumer_timeout``): the broker has
        put the message back already and no ack can reach it, so Celery's attempt would only
        log a CRITICAL ``Couldn't ack`` with a traceback at the end of every such attempt. The
        attempt's outcome is in the store, and fencing drops the message's next delivery."""
        if not getattr(self, "acknowledged", False) and self._ojs_channel_gone(
                "acknowledge", "that copy is dropped (the job store has this attempt's outcome)"):
            self.acknowledged = True
            return
        super().acknowledge()

    def reject(self, requeue: bool = False) -> None:
        """Celery's reject, unless the message's channel has closed (see :meth:`acknowledge`):
        the broker has put the message back already."""
        if not getattr(self, "acknowledged", False) and self._ojs_channel_gone(
                "reject", "and fencing drops that copy where the store has the attempt's end"):
            self.acknowledged = True
            self.send_event("task-rejected", requeue=requeue)
            return
        super().reject(requeue)

    def _ojs_channel_gone(self, what: str, then: str) -> bool:
        """Whether this OJS message's AMQP channel (py-amqp's: RabbitMQ) was closed since its
        delivery (it has no connection then), logged when it was. Other transports keep
        their own ways (kombu's Redis channel restores what it held when it closes)."""
        channel = getattr(self._message, "channel", None)
        if (not isinstance(channel, AMQPChannel) or channel.connection is not None
                or self._ojs_token() is None):
            return False
        logger.warning("ojs_celery: job %s: cannot %s its message, whose broker channel has "
                       "closed since its delivery (a lost connection, a broker restart, "
                       "RabbitMQ's consumer_timeout); the broker delivers it again, %s",
                       self.id, what, then)
        return True

    def ojs_settled(self, runtime: Runtime, done: Transition) -> None:
        """Another party of this worker (the shutdown drain) failed this attempt in the store
        (``done``), and is about to stop its pool process: carried out here, reported to the
        result backend, so that the stop is not reported again (see :meth:`ojs_carry_out`)."""
        self.ojs_carry_out(runtime, done, report_result=True, worker_request=self)

    def ojs_carry_out(self, runtime: Runtime, done: Transition, **options: Any) -> str:
        """Carry out the transition that ended this message's attempt in the worker's main
        process (``carry_out``'s ``options``), and record its outcome, "retried" or
        "discarded", which is returned. A retry's message is held on the request, not
        published: :meth:`_ack_without_failure` publishes it right after it stores Celery's
        RETRY. Published before, the next attempt could run elsewhere and store its SUCCESS
        between the result backend's read and write of that RETRY, which then overwrote it
        (``task.publish_the_retry`` keeps the same order for a retry of the pool process).
        Whoever calls this and may not see the request report (the drain) publishes what it
        still owes with :meth:`ojs_publish_owed`."""
        retried = done.record is not None and done.record.job.state == "retryable"
        if retried:
            self.__dict__[RETRY_OWED] = (runtime, done)
        self._ojs_failure_recorded = "retried" if retried else "discarded"
        carry_out(runtime, done, publish_message=not retried, **options)
        return self._ojs_failure_recorded

    def ojs_publish_owed(self) -> bool:
        """Publish the next attempt's message that this request still holds (at most once,
        whoever of the main process and the drain thread calls it first); returns whether
        one was published. One that cannot be sent stays in the outbox, for the sweeper."""
        owed = self.__dict__.pop(RETRY_OWED, None)
        return owed is not None and publish_owed(*owed)

    def ojs_owes(self) -> bool:
        """Does this request still hold a retry's message (see :meth:`ojs_carry_out`)?"""
        return RETRY_OWED in self.__dict__

    def _ojs_fail(self, error: dict[str, Any]) -> str:
        """Fail this message's attempt in the store; returns 'retried', 'discarded', 'stale',
        or 'unstarted' (the attempt never started, or the store cannot say: requeue)."""
        if self._ojs_failure_recorded is not None:
            return "stale"
        token = self._ojs_token()
        if token is None:
            self._ojs_failure_recorded = "plain"
            return "plain"
        runtime = get_runtime(self.task.app)
        try:
            done: Transition = runtime.store.fail_token(self.id, token, current_worker_id(), error)
        except Exception as exc:  # StoreError or any other: undecided, the broker keeps it
            logger.error("ojs_celery: cannot record the failure of job %s, its message goes back "
                         "to the broker: %s", self.id, exc)
            self._ojs_failure_recorded = "unstarted"
            return "unstarted"
        if done.record is None:
            if self._ojs_unstarted(done, token):
                logger.warning("ojs_celery: job %s ended before its attempt started (%s): its "
                               "message goes back to the broker", self.id, error.get("type"))
                self._ojs_failure_recorded = "unstarted"
                return "unstarted"
            logger.info("ojs_celery: late failure of job %s ignored (%s)", self.id, done.reason)
            self._ojs_report_own_completion(done, token)
            self._ojs_failure_recorded = "stale"
            return "stale"
        return self.ojs_carry_out(runtime, done)

    def _ojs_report_own_completion(self, done: Transition, token: int) -> None:
        """The store completed this message's attempt, yet its pool process failed (a hard
        time limit that struck after the store accepted the outcome: gevent's at the first
        switch, which may be inside the outcome's own write; a child killed or lost just
        after it), so Celery's trace never reported it: report it here, where it would
        otherwise stay PENDING. Only the attempt's owner can complete a job, so a completed
        record with this message's token is this attempt's own outcome, which no one else
        reports. (A discarded or cancelled record may be the sweeper's or a cancel's, which
        their makers reported: left alone.) Its ``link`` callbacks and the chain's next step
        are not sent: Celery's trace sends them before it stores the result, so an
        interrupted trace may have sent them already, and the store cannot tell."""
        record = done.previous
        if record is None or record.token != token or record.job.state != "completed":
            return
        try:  # the trace may have stored it just before the stop: a chord counts it once
            if self.task.backend.get_state(self.id) in states.READY_STATES:
                return
        except Exception as exc:  # the backend cannot say: report, as the store says
            logger.debug("ojs_celery: state of job %s in the result backend: %r", self.id, exc)
        logger.warning("ojs_celery: job %s completed in the store before its attempt was "
                       "stopped: reported as completed", self.id)
        report_outcome(get_runtime(self.task.app), record.job, send_event=self.send_event,
                       worker_request=self)

    def _ojs_unstarted(self, done: Transition, token: int) -> bool:
        """Did this message never start its attempt (the job still waits for its token, or
        has no record yet while one may still come)?"""
        record = done.previous
        if record is None:
            header = of_request(self)
            return header is not None and arrival.parse(header, self.id).record_may_come()
        return record.token == token and record.job.state in lifecycle.STARTABLE

    def _ojs_requeue(self) -> None:
        """Send the message back to the broker: its job was not started by it."""
        task_ready(self)
        self.reject(requeue=True)

    def _elapsed(self) -> float:
        started = self.time_start or time.time()
        return max(time.time() - started, 0.0)

    def _ack_without_failure(self, outcome: str, exc: BaseException) -> None:
        """Close the message for an outcome Celery must not report as a failure (a retry is
        written as Celery's RETRY, with its ``task-retried`` event, as Celery's own retry);
        then publish the next attempt's message it holds (:meth:`ojs_carry_out`), whatever
        the result backend's write raised."""
        owed = self.__dict__.pop(RETRY_OWED, None)  # before task_ready: the drain waits for that
        try:
            task_ready(self)
            if outcome == "retried":
                self.task.backend.mark_as_retry(self.id, exc, request=self._context)
                self.send_event("task-retried", exception=event_repr(exc), traceback="")
        finally:
            if owed is not None:
                publish_owed(*owed)
        self.acknowledge()

    def _hard_timeout(self, timeout: float) -> None:
        error = self._total_timeout_error()
        if error is None:
            timeout_limit = self._ojs_limit()
            error = lifecycle.timeout_error(
                "timeout", timeout_limit, self._elapsed(),
                f"execution timeout of {timeout_limit}s exceeded; the attempt was killed at "
                "the end of its grace period",
            )
        first = self._ojs_failure_recorded is None
        outcome = self._ojs_fail(error)
        if outcome == "unstarted" and first:
            self._ojs_requeue()
        elif outcome in ("discarded", "plain") and first:
            super().on_timeout(False, timeout)
        else:
            self._ack_without_failure(outcome, TimeLimitExceeded(timeout))

    def _total_timeout_error(self) -> dict[str, Any] | None:
        """The ``total_timeout`` error when the job's total deadline (in its header) has come:
        the hard limit was clamped to it (``producer.time_limits``), so the attempt was cut
        short by the job's total time, not its execution timeout. None otherwise."""
        found = of_request(self) or {}
        deadline, created = found.get("total_deadline"), found.get("created_at")
        if not isinstance(deadline, (int, float)) or not isinstance(created, (int, float)):
            return None
        now = time.time()
        if now < deadline - TOTAL_DEADLINE_SLACK:
            return None
        limit = round(deadline - created)
        return lifecycle.timeout_error(
            "total_timeout", limit, now - created,
            f"job did not finish within its total_timeout of {limit}s; the attempt was "
            "killed at the job's total deadline")

    def _ojs_limit(self) -> int:
        hard, soft = self.time_limits
        return round(soft or hard or 0)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        if soft or self._ojs_token() is None:
            return super().on_timeout(soft, timeout)  # type: ignore[no-any-return]
        self._hard_timeout(timeout)

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> None:
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if self._ojs_token() is not None:
            if isinstance(exc, Terminated) and not (
                    getattr(self, "_already_revoked", False)
                    or getattr(self, "_already_cancelled", False)):  # not Celery's revoke
                # Stopped by OJS (the drain, ``ojs_terminate``) after the store transition,
                # whose maker reported it: Celery would mark the task REVOKED over it.
                self._ack_without_failure(self._ojs_failure_recorded or "stale", exc)
                return
            if isinstance(exc, TimeLimitExceeded):
                self._hard_timeout(exc.args[0] if exc.args else 0.0)  # as billiard has it
                return
            if isinstance(exc, SoftTimeLimitExceeded) and self._ojs_soft_limit_before_start():
                return
            if isinstance(exc, WorkerLostError):
                error = lifecycle.make_error("WorkerLostError", str(exc))
                outcome = self._ojs_fail(error)
                if outcome == "unstarted":
                    self._ojs_requeue()
                    return
                if outcome != "discarded":
                    if not getattr(self, "_already_revoked", False):  # else Celery said why
                        # Celery logs its own line only for a failure: name the job here
                        logger.warning("ojs_celery: job %s (%s) lost its pool process (%s): %s",
                                       self.id, self.task.name, exc,
                                       _LOST_OUTCOMES.get(outcome, outcome))
                    self._ack_without_failure(outcome, exc)
                    return
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def _ojs_soft_limit_before_start(self) -> bool:
        """The soft limit escaped the task in Celery's own code before ``OJSTask`` could hold
        it (the pool had started its clock): if the job still waits for this message's token,
        the message goes back to the broker (True); else Celery reports it as usual."""
        token = self._ojs_token()
        if token is None:
            return False
        try:
            record = get_runtime(self.task.app).store.get_record(self.id)
        except Exception as exc:
            logger.error("ojs_celery: cannot read job %s: %s", self.id, exc)
            record = None
        if record is None or record.token != token or record.job.state not in lifecycle.STARTABLE:
            return False
        logger.warning("ojs_celery: the soft time limit of job %s fired before its attempt "
                       "started: its message goes back to the broker", self.id)
        self._ojs_failure_recorded = "unstarted"
        self._ojs_requeue()
        return True


def cancel_revoked(sender: Any = None, request: Any = None, expired: bool = False,
                   **_: Any) -> None:
    """Celery's ``revoke`` of an OJS message (``task_revoked``) cancels its job in the store,
    as :func:`ojs_celery.cancel` does. Otherwise the record would wait on, and once the
    worker's revoked set is gone (a restart) the sweeper's redispatch backstop would run the
    job (``revoke(terminate=True)`` stops the attempt: :meth:`OJSRequest.terminate`). Celery
    has written REVOKED already. An ``expires`` of Celery's own is none of OJS's, which never
    sets it."""
    if expired or request is None or not getattr(sender, "__ojs_task__", False):
        return
    if of_task_request(request) is ABSENT:
        return  # a plain message of a task that became an OJS task: Celery's revoke is all
    cancel_in_store(sender, str(request.id))


def cancel_in_store(task: Any, job_id: str) -> None:
    """Cancel a revoked job in the store (once: a job cancelled already is left as it is)."""
    runtime = get_runtime(task.app)
    try:
        done = runtime.store.cancel(job_id)
    except StoreError as exc:
        logger.warning("ojs_celery: revoked job %s could not be cancelled in the store: %s",
                       job_id, exc)
        return
    if done.record is not None:
        carry_out(runtime, done)
