"""``OJSTask``: the base class that makes a Celery task an OJS job handler.

Before the handler runs, the attempt is started in the store with the message's dispatch token
(compare-and-set): a duplicate or stale message is acked and dropped with Celery's ``Ignore``, so
the handler does not run, nothing reaches the result backend and no ``link`` fires. Afterwards
the outcome is written fenced on (attempt, worker id), and Celery only learns of it (result,
RETRY, FAILURE) when the store accepted it. Celery's own retry paths (``self.retry()``,
``autoretry_for``) and ``Reject``/``Ignore`` are turned into the same OJS decisions.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, NoReturn

from celery import Task, states
from celery import signals as celery_signals
from celery.exceptions import Ignore, Reject, Retry
from celery.result import AsyncResult
from celery.utils.imports import symbol_by_name
from celery.utils.serialization import raise_with_context

from . import arrival, compat, lifecycle, softlimit
from .callers import check_call_arguments, enqueue_call
from .context import JobContext, _current, maybe_current_job
from .eager import apply_eagerly, in_place_of_a_call, run_eagerly
from .effects import carry_out, publish_owed, report_event
from .envelope import CELERY_KWARGS_FIELD, Job, json_native
from .faults import AtMostEvery
from .identity import current_worker_id
from .lifecycle import Transition
from .lifecycle.rules import celery_semantics
from .outcome import (
    Cancelled,
    Completed,
    Failed,
    JobError,
    Outcome,
    Rejected,
    Retried,
    RetryRequested,
    TimedOut,
    celery_exception,
    error_from_exception,
    pending_retry,
    run_handler,
)
from .producer import call_mismatch, celery_datetime
from .runtime import Runtime, get_runtime
from .store import JobStore, StoreError, StoreTimeout
from .worker.gate import start_gate

logger = logging.getLogger(__name__)

__all__ = ["JobError", "OJSTask", "error_from_exception"]

#: How often an outcome still waiting for the store says so (see ``_write``).
OUTCOME_RETRY_SAY_EVERY = 60.0
#: The least time an outcome the store refuses is retried (see ``_write``).
OUTCOME_RETRY_AT_LEAST = 30.0
#: A start that waited this long for the store is named in a timeout's error: the handler had
#: that much less of its time limit.
START_WAIT_WORTH_SAYING = 1.0
#: Pause before a message goes back to the broker because the store is unreachable, and the
#: first pause between a start's tries while the store is unreachable (doubled up to the most).
STORE_DOWN_PAUSE = 1.0
STORE_DOWN_PAUSE_MAX = 5.0
#: How long a start waits for an unreachable store before its message goes back to the broker,
#: at most (see :func:`store_down_hold`).
STORE_DOWN_HOLD = 30.0
#: Why ``self.replace()`` fails an OJS job (see :meth:`OJSTask.replace`).
REPLACE_REFUSED = (
    "self.replace() is not supported in an OJS task: the replacement would take over this "
    "job's id, which an OJS job cannot hand over. Return the work's result instead, or start "
    "it as its own job (sig.delay()) or as the next link of a chain"
)
#: Where a request keeps what its task's ``before_start`` raised (see
#: :func:`_raised_in_the_attempt`), and the mark of a ``before_start`` so wrapped.
BEFORE_START_RAISED = "ojs_before_start_raised"
#: Set in a request while its task's outermost wrapped ``before_start`` runs.
BEFORE_START_RUNNING = "ojs_before_start_running"
#: Set in a request once its attempt's outcome was written (hooks and signal receivers run
#: after it: a ``self.retry()`` there cannot retry, see :meth:`OJSTask.retry`).
OUTCOME_WRITTEN = "ojs_outcome_written"
#: The reason of the Reject that sends back a job the draining worker will not start.
SHUTTING_DOWN = "the worker is shutting down"
#: The request whose handler OJS is running through the ``__call__`` methods its task's classes
#: put before OJSTask's (see :meth:`OJSTask.__init_subclass__`); None outside them.
_own_calls_of: ContextVar[Any] = ContextVar("ojs_own_calls_of", default=None)
#: The module of Celery's own tasks (``celery.chord_unlock``, ``celery.starmap``, ...), which
#: stay plain Celery tasks when the app's task class is an OJS one (see :meth:`OJSTask.__new__`).
CELERY_BUILTINS = "celery.app.builtins"
#: The attribute that marks the ``__call__`` :func:`_fenced_first` put in place of a class's
#: own, and holds that own one.
OWN_CALL = "_ojs_own_call"


class OJSTask(Task):  # type: ignore[misc]
    """Base class for OJS tasks: ``@app.task(name="email.send", base=OJSTask)``.

    The task name is the OJS ``type`` unless ``ojs_type`` says otherwise. ``self.ojs`` (bound
    tasks) and :func:`ojs_celery.current_job` give the :class:`~ojs_celery.JobContext`.
    """

    __ojs_task__ = True
    abstract = True
    ojs_type: str | None = None
    #: True: jobs from Celery callers follow the OJS retry policy, as envelopes do; None: the
    #: setting ``celery_callers`` decides (README, "Celery callers").
    ojs_semantics: bool | None = None
    #: "worker": the worker's beats keep the job alive; "handler": only ctx.heartbeat()/progress().
    heartbeat: str = "worker"
    acks_late = True
    #: What the task's options or ``task_annotations`` asked for instead of ``acks_late=True``
    #: (overridden when the task is bound; the migration report names it), else None.
    ojs_acks_late_asked: Any = None
    #: The task's ``track_started`` (its option or ``task_track_started``), which OJS applies
    #: itself once the store has started the attempt (see ``on_bound``).
    ojs_track_started: bool = False
    #: A project class's own Request is made a subclass of it (see ``_project_request``).
    Request: Any = "ojs_celery.request:OJSRequest"
    #: Whether a class before OJSTask in the method order has its own ``__call__``, which the
    #: handler runs (set by ``__init_subclass__``).
    ojs_own_calls = False

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Celery makes its own tasks from the app's task class (``task_cls``): when that is an
        OJS task class (Flask's ``FlaskTask(OJSTask)`` as ``task_cls``), they are made plain
        Celery tasks, as without OJS. As OJS tasks, envelopes could reach them, and through
        ``celery.starmap`` or ``celery.chain`` any task of the app."""
        if cls.__module__ == CELERY_BUILTINS:
            own = {key: value for key, value in vars(cls).items()
                   if key not in ("__dict__", "__weakref__")}
            return Task.__new__(type(cls.__name__, (Task,), own))
        return super().__new__(cls)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A ``__call__`` that comes before OJSTask's in a subclass's method order (Flask's
        ``class FlaskTask(OJSTask)`` whose ``__call__`` opens the app context and calls
        ``self.run``) would take the place of the fenced start and the outcome's write: the
        worker would run the job and never record it, and the sweeper would send it again
        and again. Such a ``__call__`` is kept as the project's own, which the handler runs
        inside the fencing, as a base class's after OJSTask is (:meth:`_call_handler`)."""
        super().__init_subclass__(**kwargs)
        found = cls.__call__
        if found is not OJSTask.__call__ and not hasattr(found, OWN_CALL):
            cls.__call__ = _fenced_first(found)  # type: ignore[method-assign]
            cls.ojs_own_calls = True

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Keep ``acks_late`` on whatever a task's options or ``task_annotations`` (applied
        just before this, when Celery binds the task) set: an OJS message is acknowledged
        when its attempt's outcome is written. An early ack would lose the message of a job
        that the drain sends back to the broker unstarted (until the sweeper's redispatch,
        ``redispatch_after`` later)."""
        super().on_bound(app)
        if cls.acks_late is not True:
            cls.ojs_acks_late_asked = cls.acks_late
            cls.acks_late = True
        if cls.track_started:
            # Celery's trace writes STARTED before ``__call__``, so also for a message the store
            # then drops: a cancelled, failed or expired job's result would read STARTED for
            # ever. STARTED is written once the attempt has started (``_call_handler``).
            cls.ojs_track_started, cls.track_started = True, False
        project_request = _project_request(cls)
        if project_request is not None:
            cls.Request = project_request
        before_start = cls.before_start
        if before_start is not Task.before_start and not hasattr(before_start, BEFORE_START_RAISED):
            cls.before_start = _raised_in_the_attempt(before_start)

    @property
    def ojs(self) -> JobContext | None:
        return maybe_current_job()

    # ------------------------------------------------------------------ producing

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> AsyncResult:
        """Existing ``.delay()``/``.apply_async()`` calls become OJS jobs (kwargs travel in
        ``x_celery_kwargs``); the message itself is published by the OJS producer. Celery's
        routing, time limits and ``expires`` become the job's queue, ``timeout``/
        ``grace_period`` and ``expires_at``, and the job keeps Celery's retry semantics
        (README, "Celery callers") unless the task or the settings choose OJS semantics."""
        if options.get("headers", {}) and "ojs" in options["headers"]:
            return super().apply_async(args, kwargs, **options)
        if (compat.REFUSES_SOFT_LIMIT_PAST_HARD and self.soft_time_limit and self.time_limit
                and self.soft_time_limit > self.time_limit):
            raise ValueError("soft_time_limit must be less than or equal to time_limit")  # Celery's
        dump = getattr(self, "_dump_pydantic_arguments", None)  # pydantic=True, Celery 5.7+
        if dump is not None and options.get("serializer") != "pickle":
            args, kwargs = dump(args, kwargs)  # models as the JSON data the task reads back
        mismatch = call_mismatch(self, args, kwargs)  # raised at the call, as Celery does
        if mismatch is not None:
            raise mismatch
        if compat.celery_setting(self.app, "task_always_eager"):
            return apply_eagerly(self, args, kwargs, options)
        if _plain_republish(self, options):  # a plain message's Celery retry stays plain
            return super().apply_async(args, kwargs, **options)
        result: AsyncResult = self.AsyncResult(enqueue_call(self, args, kwargs, options))
        result.ignored = options.get("ignore_result", self.ignore_result)  # as Celery sets it
        return result

    # Celery's Django task class (``celery.contrib.django.task.DjangoTask``), which the Django
    # fixup makes the default base of a project's tasks since Celery 5.4, adds these two;
    # ``base=OJSTask`` takes its place, so they are here, as Celery writes them (a Django
    # project's ``task.delay_on_commit(...)`` raised AttributeError once migrated).

    def delay_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """``delay()`` once Django's current transaction commits (``transaction.on_commit``;
        at once outside a transaction, never after a rollback); returns None, as Celery's."""
        from django.db import transaction

        transaction.on_commit(functools.partial(self.delay, *args, **kwargs))

    def apply_async_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """``apply_async()`` once Django's current transaction commits; returns None."""
        from django.db import transaction

        transaction.on_commit(functools.partial(self.apply_async, *args, **kwargs))

    def replace(self, sig: Any) -> Any:
        """Refused for an OJS job, with a final error that says so: Celery's ``replace`` gives
        the replacement this task's id, and a job's id cannot be handed over (the replacement
        would meet this job as a different one with its id, and this one would end cancelled
        while its result waits for the replacement). Eager mode refuses it too, as a worker
        would. A plain message (published before ``install``) is replaced as in Celery."""
        if self.request.is_eager or arrival.has_header(self.request):
            raise JobError(REPLACE_REFUSED, type="replace_unsupported", retryable=False)
        return super().replace(sig)

    def update_state(self, task_id: str | None = None, state: str | None = None,
                     meta: Any = None, **kwargs: Any) -> None:
        """Celery's; the running attempt remembers the state its handler gave its own job, so
        that an ``Ignore`` after a final one (Celery's way to end with its own FAILURE:
        ``update_state(state=FAILURE, meta=...)`` then ``Ignore``) keeps it."""
        super().update_state(task_id, state, meta, **kwargs)
        ctx = maybe_current_job()
        if ctx is not None and (task_id is None or task_id == ctx.job_id):
            ctx.result_state = state

    # ------------------------------------------------------------------ Celery retry paths

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's signature and argument handling; the attempt then fails the OJS way.

        A job that keeps Celery's semantics retries as in Celery: ``countdown``/``eta`` or
        ``default_retry_delay``, bounded by ``max_retries`` (this call's, else the task's;
        None: unbounded; past it ``exc`` or ``MaxRetriesExceededError`` is raised), with
        ``args``/``kwargs`` replacing the job's for the next attempts. For a job with OJS
        semantics the retry policy decides, and an explicit delay replaces the backoff.
        ``throw=False`` returns the ``Retry`` and fails the attempt when the handler returns.
        A :class:`JobError` that is not retryable is final, whatever retries it (``autoretry_for``
        catching ``Exception`` included): it is raised, not retried.
        """
        if isinstance(exc, JobError) and not exc.retryable:
            raise exc
        ctx = maybe_current_job()
        if self.request.called_directly:  # a task called as a function: not the job running
            ctx = None                     # (if any), whose handler called it
        if ctx is None and getattr(self.request, OUTCOME_WRITTEN, False) \
                and not self.request.called_directly and not self.request.is_eager:
            # This OJS job's attempt has ended: a hook (on_failure, after_return) or a signal
            # receiver (task_failure, as a project's "retry every failed task" receiver does).
            # Celery's retry below sends the same task id again, which is the same job: nothing
            # runs again.
            logger.error(
                "ojs_celery: job %s: self.retry() outside its handler (in a hook such as "
                "on_failure or in a signal receiver such as task_failure) retries nothing: the "
                "attempt's outcome is written and the same task id is the same job; retry "
                "inside the handler (self.retry, autoretry_for)", self.request.id)
        if ctx is None or self.request.is_eager:
            if ctx is not None and (args is not None or kwargs is not None) and \
                    in_place_of_a_call():
                check_call_arguments(self, args, kwargs)  # InvalidJob, as the call would raise
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        kept: dict[str, Any] = {}  # the new arguments as the job keeps them
        if args is not None or kwargs is not None:
            args, kwargs = _celery_retry_arguments(self, args, kwargs)
            kept = check_call_arguments(self, args, kwargs)  # InvalidJob, as the call would raise
        celery = celery_semantics(ctx.job) is not None
        if celery:
            limit = self.max_retries if max_retries is None else max_retries
            if limit is not None and self.request.retries + 1 > limit:
                if exc is not None:
                    raise_with_context(exc)
                # as Celery words it: the arguments the retry would have had, as its
                # signature holds them (a tuple)
                shown_args = tuple(self.request.args if args is None else args)
                shown_kwargs = dict(self.request.kwargs if kwargs is None else kwargs)
                raise self.MaxRetriesExceededError(
                    f"Can't retry {self.name}[{self.request.id}] args:{shown_args} "
                    f"kwargs:{shown_kwargs}", task_args=shown_args, task_kwargs=shown_kwargs)
            if not eta and countdown is None:
                countdown = self.default_retry_delay
        delay = None if countdown is None else float(countdown)
        when: Any = _celery_when(delay)
        if eta and not countdown:  # Celery's retry message: a countdown wins over an eta
            # (a datetime or ISO 8601 text, as Celery's retry passes it to apply_async)
            when = celery_datetime(eta, "eta")
            delay = max(when.timestamp() - time.time(), 0.0)
        requested = RetryRequested(
            exc, delay,
            None if args is None else kept.get("args", json_native(list(args))),
            None if kwargs is None else kept.get(CELERY_KWARGS_FIELD, json_native(dict(kwargs))),
            when,
        )
        if throw:
            raise requested
        pending_retry.set(requested)
        return Retry(exc=exc, when=when)

    # ------------------------------------------------------------------ running

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        marked = _own_calls_of.get()
        if marked is not None and marked is self.request:  # an own __call__'s super().__call__
            return self._after_own_calls(args, kwargs, self.request.called_directly)
        if self.request.is_eager:
            return run_eagerly(self, lambda: self._call_handler(args, kwargs))
        if self.request.called_directly:  # as Celery: the request and current_task are set
            return self._call_handler(args, kwargs, direct=True)
        running = maybe_current_job()
        if running is not None and running.job_id == str(self.request.id):
            # The handler calls its own task as a function (recursion): a direct call, as in
            # Celery, under a request of its own; not the message's attempt started again
            # (which the store refused as not the job's: Ignore, the job cancelled) nor, on
            # gevent, its soft limit's timer and hold replaced by the call's and dropped.
            self.push_request(args=args, kwargs=kwargs)
            try:
                return self._call_handler(args, kwargs, direct=True)
            finally:
                self.pop_request()
        if not arrival.has_header(self.request):
            # A message without an ``ojs`` header (published before ``install()``, or by a
            # plain Celery producer): it runs as the plain Celery task it was sent as, and its
            # ``self.retry()`` publishes a plain message again (:func:`_plain_republish`),
            # bounded by Celery's ``max_retries``.
            return self._call_handler(args, kwargs)
        runtime = get_runtime(self.app)
        # held until the handler's first line, and again after its last
        softlimit.begin(str(self.request.id), self.request.timelimit)
        try:
            entered = time.monotonic()
            ctx = self._start(runtime, str(self.request.id), current_worker_id(), args, kwargs)
            ctx.start_waited = ctx.started - entered
            if ctx.job.expires_at is not None and self.request.expires is None:
                # as Celery's worker shows a call's ``expires``, which OJS keeps in the job
                # (never in the message: see ojs_celery.producer)
                self.request.expires = ctx.job.expires_at.isoformat()
            reset = _current.set(ctx)
            try:
                outcome = run_handler(lambda: self._run_released(args, kwargs))
            finally:
                _current.reset(reset)
            if isinstance(outcome, TimedOut):
                ctx.cancelled = True
            try:
                return self._record_outcome(runtime, ctx, outcome)
            finally:
                setattr(self.request, OUTCOME_WRITTEN, True)  # for a late self.retry()
        finally:
            softlimit.forget()

    def _run_released(self, args: Any, kwargs: Any) -> Any:
        """The handler, with the soft limit no longer held: one that fired during the start
        times the attempt out before the handler's first line."""
        softlimit.release()
        try:
            return self._call_handler(args, kwargs)
        finally:
            softlimit.hold()

    def _call_handler(self, args: Any, kwargs: Any, direct: bool = False) -> Any:
        """The task's body as Celery's worker calls it: through the project's own ``__call__``
        of a class before OJSTask in the task's classes (Flask's ``FlaskTask``), then through
        that of a base class after it (one that opens a database session, say), else
        ``run``. The same in eager mode and in a direct call, as Celery runs them."""
        raised = getattr(self.request, BEFORE_START_RAISED, None)
        if raised is not None:  # the task's before_start refused it (_raised_in_the_attempt)
            raise raised
        if self.ojs_track_started and not _ignores_result(self) and not (
                self.request.is_eager or self.request.called_directly):
            # as Celery's trace writes it (Task.track_started), in the attempt the store started
            # (Celery's eager mode and a direct call write none)
            self.backend.store_result(self.request.id, {"pid": os.getpid(),
                                                        "hostname": self.request.hostname},
                                      states.STARTED, request=self.request)
        if self.ojs_own_calls:
            reset = _own_calls_of.set(self.request)
            try:
                return type(self).__call__(self, *args, **kwargs)
            finally:
                _own_calls_of.reset(reset)
        return self._after_own_calls(args, kwargs, direct)

    def _after_own_calls(self, args: Any, kwargs: Any, direct: bool) -> Any:
        """What follows OJSTask's ``__call__`` in the method order: a base class's own
        ``__call__`` (and for a ``direct`` call Celery's, which sets the request), else
        ``run``."""
        if _own_calls_of.get() is not None:  # a call the handler makes is a call of its own
            reset = _own_calls_of.set(None)
            try:
                return self._after_own_calls(args, kwargs, direct)
            finally:
                _own_calls_of.reset(reset)
        if direct or _project_call(type(self)):
            return super().__call__(*args, **kwargs)
        return self.run(*args, **kwargs)

    def _start(
        self, runtime: Runtime, job_id: str, worker_id: str, args: Any, kwargs: Any
    ) -> JobContext:
        """Start the attempt this message asks for, or raise ``Ignore`` (the message is
        dropped: nothing to start, or it is not the job's: another task, other ``args`` and
        ``kwargs``) or ``Reject`` with requeue (it goes back to the broker: whether it may
        start could not be decided, or its job's record may still come)."""
        self._unless_too_late(runtime, job_id)
        arrived = arrival.read(self.request, job_id)
        if arrived.token is None:
            logger.error("ojs_celery: job %s: message dropped, its ojs header is unusable (%s); "
                         "the sweeper publishes the job again (its redispatch_after backstop)",
                         job_id, arrived.problem)
            raise Ignore()

        def carries(job: Job) -> bool:
            return runtime.runs(self, job.type) and arrival.carries_call(args, kwargs, job)

        try:
            started = self._start_in_store(runtime, job_id, arrived, worker_id, carries)
        except Reject:
            raise
        except Exception as exc:  # any other error: undecided, the broker keeps the message
            logger.error("ojs_celery: cannot start job %s, its message goes back to the broker: "
                         "%r", job_id, exc, exc_info=True)
            time.sleep(STORE_DOWN_PAUSE)
            raise Reject(f"start undecided: {exc}", requeue=True) from None  # traced above
        if started.reason == "unknown_job":
            if arrived.record_may_come():
                logger.warning("ojs_celery: job %s has no record yet (its insert may be in "
                               "flight): its message goes back to the broker", job_id)
                time.sleep(STORE_DOWN_PAUSE)
                raise Reject("job record not written yet", requeue=True)
            logger.error("ojs_celery: job %s has no record and its message is older than %ss: "
                         "dropped as an orphan (its insert failed, or the job is in another "
                         "job store: the producer's ojs.store_url or store_prefix differs from "
                         "this worker's, %s)", job_id, arrival.ORPHAN_AFTER, runtime.store)
            raise Ignore()
        try:  # a start that ended the job (expired) reports it: the handler never runs
            carry_out(runtime, started, report_result=True, worker_request=self.request)
        except Exception as exc:  # the store decided; its events must not undo that
            logger.error("ojs_celery: job %s: effects of its start failed: %r", job_id, exc)
        if any(name == "job.expired" for name, _ in started.events):
            # Celery's worker announces an expired message so (in its main process, where
            # the expiry is decided before the pool; here the store decides it at the start)
            celery_signals.task_revoked.send(sender=self, request=self.request,
                                             terminated=False, signum=None, expired=True)
        if started.reason == "foreign":
            logger.error("ojs_celery: job %s: message dropped, it is not the job's (another "
                         "task, other arguments or another job's record)", job_id)
            raise Ignore()
        if started.record is None or started.record.job.state != "active":
            why = started.reason if started.record is None else started.record.job.state
            logger.info("ojs_celery: job %s not started (%s): message dropped", job_id, why)
            raise Ignore()
        return JobContext(runtime, started.record, worker_id)

    def _start_in_store(self, runtime: Runtime, job_id: str, arrived: arrival.Arrival,
                        worker_id: str, carries: Callable[[Job], bool]) -> Transition:
        """The start's compare-and-set, tried again while the store cannot be reached (or
        does not answer) for up to :func:`store_down_hold`, and then given up: ``Reject``
        with requeue, the message goes back to the broker. Holding the message spares a
        short outage the redeliveries, which a quorum queue's delivery limit counts. An
        unanswered try that the store ran meanwhile is known as this one's own by the next
        (``JobStore.remembering``): a message sent back would find the job started by nobody."""
        give_up = time.monotonic() + store_down_hold(self.request.timelimit)
        pause = STORE_DOWN_PAUSE
        settled = False  # a try after a timed-out one: it knows a start the store ran as its own
        with runtime.store.remembering("start"):
            while True:
                try:
                    return arrival.start(runtime.store, job_id, arrived, worker_id, carries)
                except StoreError as exc:
                    unsettled = isinstance(exc, StoreTimeout) and not settled
                    settled = settled or isinstance(exc, StoreTimeout)
                    if not unsettled and time.monotonic() + pause >= give_up:
                        logger.error("ojs_celery: store unreachable, job %s goes back to the "
                                     "broker: %s", job_id, exc)
                        time.sleep(STORE_DOWN_PAUSE)
                        # from None: logged in one line; Celery logs the Reject with its trace
                        raise Reject(f"store unreachable: {exc}", requeue=True) from None
                    if pause == STORE_DOWN_PAUSE:
                        logger.warning("ojs_celery: store unreachable, job %s waits for it (up "
                                       "to %.0fs) before its message goes back to the broker: "
                                       "%s", job_id, max(give_up - time.monotonic(), pause),
                                       exc)
                    time.sleep(pause)
                    pause = min(pause * 2, STORE_DOWN_PAUSE_MAX)
                    if not unsettled:  # a try that may have started it is settled first
                        self._unless_too_late(runtime, job_id)

    def _unless_too_late(self, runtime: Runtime, job_id: str) -> None:
        """Send the message back (``Reject`` with requeue) when the worker's drain has begun
        and the job would reach its cancellation point at once: it would spend an attempt on
        a ``shutdown``. Checked before the start, and before each try of a start that waits
        for the store."""
        if start_gate.draining() and start_gate.too_late(self.request.timelimit,
                                                         runtime.settings.cancel_window):
            logger.info("ojs_celery: job %s not started, the worker is shutting down: its "
                        "message goes back to the broker", job_id)
            raise Reject(SHUTTING_DOWN, requeue=True)

    def _record_outcome(self, runtime: Runtime, ctx: JobContext, outcome: Outcome) -> Any:
        """Write the attempt's outcome to the store (fenced on attempt and worker), then tell
        Celery only what the store accepted: the one mapping from outcome to effects."""
        job = ctx.job
        store = runtime.store
        now = time.time()
        if isinstance(outcome, Completed):
            done = _write(store, lambda: store.complete(job.id, ctx.attempt, ctx.worker_id,
                                                 outcome.result, hint=ctx.record), ctx)
            return self._tell_celery(runtime, ctx, done, outcome)
        if isinstance(outcome, Cancelled):
            done = _write(store, lambda: store.apply(job.id, lambda r: lifecycle.cancel_by_owner(
                r, ctx.attempt, ctx.worker_id, now)), ctx)
            if done is not None and done.record is not None:
                carry_out(runtime, done)
                if ctx.result_state not in states.READY_STATES:  # else the handler's own end
                    self.backend.mark_as_revoked(job.id, reason="ignored", request=self.request)
                    report_event(runtime, done.record.job)  # Celery's trace sends none
            raise Ignore()
        delay: float | None = None
        retryable = True
        if isinstance(outcome, TimedOut) and _worker_is_draining(runtime, ctx.worker_id, job.id):
            error = lifecycle.make_error(
                "shutdown", "cancelled because the worker shut down before the job finished")
        elif isinstance(outcome, TimedOut):
            elapsed = time.monotonic() - ctx.started
            said = f"execution timeout of {job.timeout}s exceeded"
            if ctx.start_waited >= START_WAIT_WORTH_SAYING:
                said += (f" (Celery's time limit counts from the message's arrival: the start "
                         f"waited {ctx.start_waited:.1f}s for the job store)")
            error = lifecycle.timeout_error("timeout", job.timeout, elapsed, said)
        elif isinstance(outcome, Retried):
            error = (error_from_exception(outcome.cause) if outcome.cause is not None
                     else lifecycle.make_error("Retry", "retry requested by the handler"))
            delay = outcome.delay
            if outcome.args is not None or outcome.kwargs is not None:
                done = _write(store, lambda: store.apply(job.id, lambda r: _with_arguments(
                    lifecycle.fail(r, ctx.attempt, ctx.worker_id, error, now, delay=delay,
                                   policy=store.policy), outcome), ctx.record), ctx)
                return self._tell_celery(runtime, ctx, done, outcome)
        elif isinstance(outcome, Rejected):
            error = lifecycle.make_error(
                "Reject", str(outcome.exc.reason or "rejected by the handler"))
            retryable = bool(outcome.exc.requeue)
            if retryable and celery_semantics(job) is not None:
                delay = 0.0  # Celery requeues a rejected message at once
        else:
            assert isinstance(outcome, Failed)
            error = error_from_exception(outcome.exc)
            retryable = outcome.retryable
        if celery_semantics(job) is not None and isinstance(outcome, (Failed, TimedOut)):
            # Celery semantics: an exception, or a soft time limit that escaped the handler,
            # ends the job unless autoretry_for or self.retry() asked (then it is Retried).
            retryable = retryable and error.get("type") == "shutdown"
        done = _write(store, lambda: store.fail(job.id, ctx.attempt, ctx.worker_id, error,
                                         delay=delay, retryable=retryable, hint=ctx.record),
                      ctx)
        return self._tell_celery(runtime, ctx, done, outcome)

    def _tell_celery(
        self, runtime: Runtime, ctx: JobContext, done: Transition | None, outcome: Outcome
    ) -> Any:
        """Carry out the accepted transition and report it to Celery: the return value, a
        ``Retry`` (the job runs again) or the exception that ended it; nothing (``Ignore``)
        when the store rejected the outcome or never took it."""
        if done is None or done.record is None:
            reason = "the store never took it" if done is None else done.reason
            logger.warning(
                "ojs_celery: outcome of job %s attempt %s rejected (%s): not reported to Celery",
                ctx.job.id, ctx.attempt, reason,
            )
            raise Ignore()
        record = done.record
        retrying = record.job.state == "retryable"
        carry_out(runtime, done, publish_message=not retrying)
        if record.job.state == "completed" and isinstance(outcome, Completed):
            return outcome.value
        exc = celery_exception(outcome)
        if retrying:  # reported as Celery's own retry reports it
            setattr(self.request, RETRY_OWED, (runtime, done))  # see publish_the_retry
            when = outcome.when if isinstance(outcome, Retried) else None
            raise Retry(exc=exc, when=record.job.next_retry_at if when is None else when)
        if exc is None or isinstance(exc, (Reject, Retry, RetryRequested)):
            raise RuntimeError(str((record.job.error or {}).get("message", "discarded")))
        raise exc


#: The request's attribute that holds a retry's transition until Celery has stored RETRY.
RETRY_OWED = "_ojs_retry_owed"


def publish_the_retry(sender: Any = None, request: Any = None, **_: Any) -> None:
    """``task_retry``: publish the next attempt's message once Celery's trace has stored this
    attempt's RETRY (it sends the signal after that write). Published before it, the next
    attempt could run in another pool process and store its SUCCESS between the result
    backend's read and write of the RETRY, which then overwrote it: the result read RETRY for
    ever (plain Celery's ``self.retry`` has that order; docs/celery-notes.md). Should the
    signal not come (the RETRY's write or the task's ``on_retry`` raised), it is published
    at the trace's ``task_postrun`` (:func:`publish_a_retry_left_owed`); a process lost before
    either leaves it in the outbox, which the sweeper publishes after ``dispatch_grace``."""
    owed = vars(request).pop(RETRY_OWED, None) if request is not None else None
    if owed is not None:
        publish_owed(*owed)


def publish_a_retry_left_owed(sender: Any = None, **_: Any) -> None:
    """``task_postrun``, which Celery's trace sends whatever its RETRY handling raised, with
    the attempt's request still the task's: a retry whose ``task_retry`` never came (the
    task's ``on_retry`` raised, or the result backend's write of RETRY) is published here, at
    once as in Celery, not by the sweeper after ``dispatch_grace`` (nor never, with no sweeper
    running)."""
    publish_the_retry(request=getattr(sender, "request", None))


def _ignores_result(task: Task) -> bool:
    """Whether the attempt's result is not stored, as Celery's trace reads it: the call's own
    ``ignore_result``, else the task's (a message without one, Celery 5.7's ``send_task``,
    sends None)."""
    asked = vars(task.request).get("ignore_result")
    return bool(task.ignore_result if asked is None else asked)


def _raised_in_the_attempt(before_start: Callable[..., None]) -> Callable[..., None]:
    """A task class's ``before_start`` (Celery 5.2+ calls it in the worker just before the
    task's ``__call__``), whose exception fails the attempt as the handler's would: Celery fails
    the task on it without calling ``__call__``, where the job is started and its outcome
    written, so the job would stay waiting in the store for ever (and its message be sent again
    by the sweeper's redispatch) while Celery's result says FAILURE. The exception is kept in
    the request and raised in place of the handler once the attempt has started (a duplicate
    message is dropped as any is); eager mode, which keeps no record, raises it at once."""

    @functools.wraps(before_start)
    def kept_for_the_attempt(self: Task, task_id: str, args: Any, kwargs: Any) -> None:
        request = self.request
        if request.is_eager or getattr(request, BEFORE_START_RUNNING, False):
            before_start(self, task_id, args, kwargs)  # eager, or a subclass's super() call:
            return                                     # raised as written, to the outermost
        setattr(request, BEFORE_START_RUNNING, True)
        try:
            before_start(self, task_id, args, kwargs)
        except Exception as exc:
            setattr(request, BEFORE_START_RAISED, exc)
        finally:
            setattr(request, BEFORE_START_RUNNING, False)

    setattr(kept_for_the_attempt, BEFORE_START_RAISED, True)
    return kept_for_the_attempt


def _project_request(cls: type) -> type | None:
    """The worker ``Request`` class of a task whose project class (or options) gives one of its
    own (Celery's "custom requests": ``on_timeout``, ``on_failure`` in the worker's main
    process), made a subclass of OJS's: whichever of OJSTask and the project class comes first,
    one of the two was silently dropped (the project's hooks, or the main process's handling
    of an OJS attempt's hard time limit and lost child, which left the job active until the
    sweeper). The project's methods come first and reach OJS's through ``super()``, as they
    reach Celery's (a project's subclass of OJS's is taken as it is, and Celery's own, named
    by a project class, is OJS's). None: no project class gives one."""
    for klass in cls.__mro__:
        given = vars(klass).get("Request")
        if given is None or klass is OJSTask or issubclass(Task, klass):
            continue  # OJS's and Celery's own
        from .request import OJSRequest  # the worker's (not imported by producers)

        project: type = symbol_by_name(given)
        if issubclass(OJSRequest, project):  # Celery's own Request, named by a project class:
            return OJSRequest                # OJS's extends it
        if issubclass(project, OJSRequest):  # the project's subclass of OJS's, wherever its
            return project                   # class stands in the order
        return type(f"OJS{project.__name__}", (project, OJSRequest), {})
    return None


def _fenced_first(own: Callable[..., Any]) -> Callable[..., Any]:
    """The ``__call__`` that takes the place of ``own`` (a class's own, before OJSTask's in
    its method order): OJSTask's, whose handler then runs ``own`` (see
    :meth:`OJSTask._call_handler`); ``own`` itself while that handler runs it, so that its
    ``super().__call__`` reaches the next one in the order, and OJSTask's last."""

    @functools.wraps(own)
    def __call__(self: OJSTask, *args: Any, **kwargs: Any) -> Any:
        marked = _own_calls_of.get()
        if marked is not None and marked is self.request:
            return own(self, *args, **kwargs)
        return OJSTask.__call__(self, *args, **kwargs)

    setattr(__call__, OWN_CALL, own)
    return __call__


#: :func:`_project_call`'s answers, by task class.
_project_calls: dict[type, bool] = {}


def _project_call(cls: type) -> bool:
    """Whether a class after OJSTask in ``cls``'s method order defines its own ``__call__``
    (Celery's own Task, whose ``__call__`` only sets up a direct call, does not count)."""
    found = _project_calls.get(cls)
    if found is None:
        later = cls.__mro__[cls.__mro__.index(OJSTask) + 1:]
        owner = next((klass for klass in later if "__call__" in vars(klass)), None)
        found = _project_calls[cls] = owner is not None and not issubclass(Task, owner)
    return found


def store_down_hold(timelimit: Any) -> float:
    """How long a start may wait for the store: :data:`STORE_DOWN_HOLD`, and no more than a
    quarter of the message's time limits (``request.timelimit``: hard, soft), which count the
    wait (a start that waited a long while leaves its handler less time, and one past its hard
    limit would be killed before it began)."""
    limits = [float(limit) for limit in (timelimit or ()) if limit]
    return min([STORE_DOWN_HOLD, *(limit / 4 for limit in limits)])


def _plain_republish(task: OJSTask, options: dict[str, Any]) -> bool:
    """Is this publish Celery's retry of the plain (header-less) message the task runs now?
    Celery's ``Task.retry`` sends the request's own task id and its ``retries`` count."""
    request = task.request
    if request.called_directly or request.is_eager or "retries" not in options:
        return False
    if not request.id or options.get("task_id") != request.id:
        return False
    return not arrival.has_header(request)


def _worker_is_draining(runtime: Runtime, worker_id: str, job_id: str) -> bool:
    """Was this job's cancellation sent by its worker's shutdown drain (then it is a
    ``shutdown``)? Its own execution timeout, even during a drain, stays a ``timeout``."""
    try:
        return runtime.store.meta.is_draining(worker_id, job_id)
    except StoreError:
        return False


class _RetryArgumentsTaken(Exception):
    """Carries the arguments Celery's ``Task.retry`` computed out of it (see
    :func:`_celery_retry_arguments`)."""

    def __init__(self, args: Any, kwargs: Any) -> None:
        super().__init__()
        self.args_, self.kwargs_ = args, kwargs


class _RetryArgumentsOf:
    """Stands in for a task in Celery's own ``Task.retry``: what that reads of the task, and a
    ``signature_from_request`` that takes the arguments it is given and stops there (nothing
    is published)."""

    max_retries = None
    default_retry_delay = 0

    def __init__(self, task: Task) -> None:
        self.name, self.request, self.run = task.name, task.request, task.run

    def signature_from_request(self, request: Any, args: Any, kwargs: Any,
                               **_: Any) -> NoReturn:
        raise _RetryArgumentsTaken(request.args if args is None else args,
                                   request.kwargs if kwargs is None else kwargs)


def _celery_retry_arguments(task: Task, args: Any, kwargs: Any) -> tuple[list[Any],
                                                                        dict[str, Any]]:
    """The next attempt's arguments of ``self.retry(args=..., kwargs=...)`` as the installed
    Celery's own retry makes them: since Celery 5.7 (celery/celery#6494) new positional
    arguments keep the call's keyword arguments that they do not replace, and new keyword
    arguments take the place of positional ones of the same name (``retry(args=[5, 6])`` of
    ``f(a, b=0)`` called ``f.delay(1, b=2)`` runs ``f(5, 6)``); before, the one not given
    is the call's. Taken from Celery's ``Task.retry`` itself, so that each Celery version
    keeps its own rule."""
    try:
        Task.retry(_RetryArgumentsOf(task), args, kwargs, countdown=0)
    except _RetryArgumentsTaken as taken:
        return list(taken.args_ or ()), dict(taken.kwargs_ or {})
    raise AssertionError("Celery's Task.retry did not build the retry's signature")


def _with_arguments(done: Transition, outcome: Retried) -> Transition:
    """``self.retry(args=..., kwargs=...)``: the retried job runs with the new arguments, as
    Celery's retry message would (written with the failure, in the same compare-and-set)."""
    if done.record is None or done.record.job.state != "retryable":
        return done
    job = done.record.job
    if outcome.args is not None:
        job.args = outcome.args
    if outcome.kwargs is not None:
        setattr(job, CELERY_KWARGS_FIELD, outcome.kwargs)  # an extension field
    return done


def _write(
    store: JobStore, operation: Callable[[], Transition], ctx: JobContext
) -> Transition | None:
    """Run an outcome's store write, retrying while the store refuses it; None: gave up. A try
    that got no answer in time is known as this outcome's own by a later try if the store ran
    it meanwhile (``JobStore.remembering``).

    Giving up loses a finished attempt (its message acknowledged, its job active until a clock
    runs it again), so the write is retried up to the attempt's own end (its timeout and grace
    period from its start, where a prefork pool's hard time limit stops it anyway; other pools
    have none) and at least :data:`OUTCOME_RETRY_AT_LEAST`: a failover that refuses writes for
    minutes does not make a finished job run again. While this process retries, the request
    stays active and the worker's beats keep the attempt alive. Said once, then once a
    minute."""
    began = time.monotonic()
    job = ctx.job
    give_up = max(ctx.started + job.timeout + job.grace_period, began + OUTCOME_RETRY_AT_LEAST)
    waiting = AtMostEvery(OUTCOME_RETRY_SAY_EVERY)
    pause = 0.2
    while True:
        try:
            with store.remembering("outcome"):
                return operation()
        except StoreError as exc:
            now = time.monotonic()
            if now >= give_up:
                logger.error("ojs_celery: giving up writing an outcome after %.0fs: %s",
                             now - began, exc)
                return None
            if waiting.due(now):
                logger.warning("ojs_celery: store write of an outcome failed, retrying (for "
                               "%.0fs now): %s", now - began, exc)
            time.sleep(min(pause, give_up - now))
            pause = min(pause * 2, 5.0)


def _celery_when(delay: float | None) -> float | int | None:
    """A retry's delay as Celery's ``Retry`` carries the countdown it was given (``when``: the
    worker logs ``Retry in 1s: ValueError(...)``, the ``task_retry`` signal's ``reason``)."""
    if delay is not None and float(delay).is_integer():
        return int(delay)
    return delay
