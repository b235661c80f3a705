"""Every state transition, as pure functions (no I/O), and the retry decision.

A transition takes the stored :class:`Record` and the facts of the moment (``now``, a token, a
worker id, an outcome) and returns a :class:`Transition`: the new record (or why nothing changes),
the OJS events to emit and the message to publish, if any. The store applies it with one
compare-and-set, so the same rules hold in the worker, the sweeper and the producer. When a
deadline passes, :mod:`.clocks` says which of these rules applies.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, get_args

from ..envelope import (
    CELERY_SEMANTICS_FIELD,
    ERRORS_DROPPED_FIELD,
    Job,
    JsonValue,
    RetryPolicy,
    State,
    format_epoch,
    format_timestamp,
    from_epoch,
)

STATES: tuple[str, ...] = get_args(State)
TERMINAL = frozenset({"completed", "cancelled", "discarded"})
NEVER_STARTED = frozenset({"scheduled", "available", "pending"})
STARTABLE = frozenset({"scheduled", "available", "retryable"})

#: Error types of a sweep that could not carry out a job's due transition.
DISPATCH_ERROR = "dispatch_error"
DISPATCH_FAILED = "dispatch_failed"
#: Error types produced by the system itself (the rest are exception class names).
TIMEOUT_KINDS = {
    "timeout": "execution",
    "total_timeout": "total",
    "enqueue_ttl_expired": "enqueue_ttl",
    "stalled": "stalled",
}
TIMEOUT_EVENTS = {
    "timeout": "job.timeout",
    "total_timeout": "job.total_timeout",
    "enqueue_ttl_expired": "job.ttl_expired",
    "stalled": "job.stalled",
}

DAY = 86400.0


@dataclass(frozen=True)
class Policy:
    """Deployment knobs that shape deadlines (from settings)."""

    dispatch_grace: float = 10.0
    schedule_horizon: float = 60.0
    #: A job waiting this long for its published message gets it once more (the backstop
    #: for a message that is gone); long, since a job may wait in a long queue.
    redispatch_after: float = 3600.0
    #: How long past an execution deadline the sweeper waits, so the worker's hard limit wins.
    execution_tolerance: float = 1.5
    worker_heartbeat_timeout: float = 30.0
    #: Sweeps in a row that may fail to carry out a job's due transition before it is
    #: discarded with ``dispatch_failed``.
    dispatch_failure_limit: int = 5
    retention_completed: float = 7 * DAY
    retention_cancelled: float = 30 * DAY
    retention_discarded: float = 30 * DAY
    retention_dead_letter: float = 180 * DAY


@dataclass
class Record:
    """What the store keeps for one job besides the OJS fields of :class:`Job`.

    ``token`` is the dispatch token a message must carry to start the job; ``version`` is the
    compare-and-set counter; ``heartbeat_at`` drives stall detection; ``extended_at`` is when the
    job's hold was last renewed: the running attempt's reservation (the visibility timeout),
    or, for a job waiting for its message, when that message was last published (the
    redispatch backstop); ``dispatch_due`` is the outbox entry (a message is owed; the sweeper
    republishes it once this time has passed); ``promote_at`` is when a job held in the store
    (scheduled, or retrying after a long backoff) must be published.

    Fencing (set by the store, never by a rule): ``nonce`` is the random nonce of the write
    that made this version; a compare-and-set replaces the record only if it still carries the
    version *and* nonce it was computed from, and a write whose reply was lost recognises its
    own success by its nonce. ``origin`` is the nonce of the insert, kept for the job's life:
    a message proves with it that it was published for this record, not for another job that
    tried to take the same id.
    """

    job: Job
    token: int = 1
    version: int = 0
    worker_id: str | None = None
    heartbeat_at: float | None = None
    extended_at: float | None = None
    dispatch_due: float | None = None
    promote_at: float | None = None
    dead_letter: bool = False
    nonce: str = ""
    origin: str = ""
    #: The job's JSON as the store encoded it for this record's write (set by the store,
    #: never read by it): the message's snapshot reuses it instead of encoding the job again.
    written_json: str | None = field(default=None, repr=False, compare=False)

    def copy(self) -> Record:
        """A record to build the next version in: the job is copied shallowly, because the
        rules only ever assign attributes and build new containers (``[*j.errors, entry]``,
        ``{**j.progress, ...}``), never change a list or dict of the record they read."""
        new = object.__new__(type(self))  # every field as it is: a fifth of the cost of
        new.__dict__.update(self.__dict__)  # dataclasses.replace, which runs __init__ again
        new.job = self.job.model_copy()
        new.written_json = None
        return new


@dataclass(frozen=True)
class Publish:
    """A message the caller must publish after the write: the job's token and when it is due."""

    job_id: str
    token: int
    eta: float | None = None


@dataclass
class Transition:
    """The result of applying a rule; ``record`` is None when nothing may change (``reason``)."""

    record: Record | None
    reason: str = "ok"
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    publish: Publish | None = None
    #: The record the rule was applied to (set by the store).
    previous: Record | None = None

    @property
    def applied(self) -> bool:
        return self.record is not None


#: Why a rule refused a job that its clock's index holds as due: by the record, it is not (the
#: entry was written under other settings or by an older version; the sweeper reads past it
#: and moves it to the deadline the record gives).
NOT_DUE = "not_due"


def rejected(reason: str) -> Transition:
    return Transition(record=None, reason=reason)


# --------------------------------------------------------------------------- errors and backoff


def error_code(type_: str) -> str:
    """The OJS error catalogue's code for an error ``type``: ``HANDLER_TIMEOUT`` for the
    timeouts, ``DISPATCH_ERROR`` for a job the sweeper could not dispatch, ``HANDLER_ERROR``
    for the rest (a handler's exception, a recovery such as ``stalled`` or ``shutdown``)."""
    if type_ in TIMEOUT_KINDS:
        return "HANDLER_TIMEOUT"
    if type_ in (DISPATCH_ERROR, DISPATCH_FAILED):
        return "DISPATCH_ERROR"
    return "HANDLER_ERROR"


def make_error(type_: str, message: str, **extra: JsonValue) -> dict[str, JsonValue]:
    """An OJS error object: ``type`` and ``message``, the catalogue ``code`` (the same in the
    stored error, its history entry and every event that reports it), and ``extra``."""
    error: dict[str, JsonValue] = {"type": type_, "code": error_code(type_), "message": message}
    error.update({k: v for k, v in extra.items() if v is not None})
    return error


def timeout_error(type_: str, limit: float, elapsed: float, message: str) -> dict[str, JsonValue]:
    """The timeouts extension's error object (``timeout_kind``, ``limit_seconds``, ...)."""
    return make_error(
        type_,
        message,
        timeout_kind=TIMEOUT_KINDS[type_],
        limit_seconds=limit,
        elapsed_seconds=round(elapsed, 3),
    )


def matches_non_retryable(error_type: str, patterns: list[str]) -> bool:
    """Exact match, or ``prefix.*`` matching ``prefix.anything`` (not ``prefix`` itself)."""
    for pattern in patterns:
        if pattern == error_type:
            return True
        if pattern.endswith(".*") and error_type.startswith(pattern[:-1]):
            return True
    return False


def backoff_delay(
    policy: RetryPolicy, retry_number: int, rand: Callable[[], float] = random.random
) -> float:
    """Exponential backoff ``I·C^(n−1)``, capped, jittered in [0.5, 1.5), capped again (a
    growth beyond a float, far into a long policy, is the cap)."""
    try:
        growth = policy.backoff_coefficient ** max(retry_number - 1, 0)
    except OverflowError:
        growth = math.inf
    delay = min(policy.initial_seconds * growth, policy.max_seconds)
    if policy.jitter:
        delay = min(delay * (0.5 + rand()), policy.max_seconds)
    return delay


@dataclass(frozen=True)
class Decision:
    retry: bool
    delay: float = 0.0
    total_timeout_error: dict[str, JsonValue] | None = None


#: Failures OJS adds to Celery's (a lost worker or child, a stall, an expired reservation, a
#: shutdown drain): a Celery caller's job retries them per its OJS retry policy, on a budget of
#: their own, and they do not count as Celery retries (``self.request.retries``).
RECOVERIES = frozenset(
    {"worker_death", "stalled", "visibility_timeout", "shutdown", "WorkerLostError"}
)
#: A handler's ``Reject(requeue=True)``: Celery redelivers the message at once, which is no
#: Celery retry. A Celery caller's job retries it at once on the recoveries' budget (so a
#: handler that always rejects ends, where Celery would redeliver it for ever); it is not
#: counted in ``self.request.retries`` nor against ``max_retries``. (A ``Reject`` without
#: requeue ends the job: its entry is the last.)
REDELIVERY = "Reject"
#: Failed attempts of a Celery caller's job that are no Celery retry.
NOT_CELERY_RETRIES = RECOVERIES | {REDELIVERY}
#: Error history entries that are no attempt's failure.
_NOT_ATTEMPTS = frozenset({"dispatch_error", "dispatch_failed"})


def celery_semantics(job: Job) -> dict[str, Any] | None:
    """The Celery semantics a Celery caller's job keeps (``max_retries``,
    ``default_retry_delay``), written at enqueue; None: the job follows the OJS policy."""
    stored = (job.model_extra or {}).get(CELERY_SEMANTICS_FIELD)
    return stored if isinstance(stored, dict) else None


#: The error history keeps this many entries, the most recent (the spec asks for at least
#: 10). A job retried for ever (Celery's ``max_retries=None``, a long OJS retry policy) would
#: otherwise grow its record, and with it every write and message of the job, without bound.
#: What the dropped entries counted is kept in ``ERRORS_DROPPED_FIELD``.
ERRORS_KEPT = 100


def _counted_as(entry: dict[str, JsonValue]) -> str:
    """Which count an error history entry adds to: a Celery retry, a recovery (or
    redelivery), or neither (a sweep's dispatch error)."""
    kind = entry.get("type")
    if kind in NOT_CELERY_RETRIES:
        return "recoveries"
    return "dispatch" if kind in _NOT_ATTEMPTS else "retries"


def _dropped(job: Job, kind: str) -> int:
    counts = (job.model_extra or {}).get(ERRORS_DROPPED_FIELD)
    value = counts.get(kind) if isinstance(counts, dict) else None
    return value if isinstance(value, int) else 0


def _add_error(job: Job, entry: dict[str, JsonValue]) -> None:
    """Append ``entry`` to the error history, dropping the oldest beyond :data:`ERRORS_KEPT`
    and counting what they counted."""
    errors = [*job.errors, entry]
    if len(errors) > ERRORS_KEPT:
        counts = {kind: _dropped(job, kind) for kind in ("retries", "recoveries", "dispatch")}
        for old in errors[:-ERRORS_KEPT]:
            counts[_counted_as(old)] += 1
        setattr(job, ERRORS_DROPPED_FIELD, counts)
        errors = errors[-ERRORS_KEPT:]
    job.errors = errors


def celery_retries(job: Job) -> int:
    """Celery retries so far (``self.request.retries``): failed attempts that were neither a
    recovery OJS adds nor the last one (which ended the job). Counted from the error history
    (and what its dropped entries counted), so the count survives every writer."""
    return _dropped(job, "retries") + sum(
        1 for entry in job.errors if _counted_as(entry) == "retries")


def recoveries(job: Job) -> int:
    """Failed attempts of a Celery caller's job that were recoveries OJS adds, or
    redeliveries (:data:`REDELIVERY`): the budget they share."""
    return _dropped(job, "recoveries") + sum(
        1 for entry in job.errors if _counted_as(entry) == "recoveries")


def decide(
    job: Job,
    error_type: str,
    now: float,
    rand: Callable[[], float] = random.random,
    delay: float | None = None,
) -> Decision:
    """Retry or discard after a failed attempt (``job.attempt`` = attempts started so far).

    A job that keeps Celery's semantics (:func:`celery_semantics`) reaches this only when the
    handler asked for a retry (``self.retry()``, ``autoretry_for``: bounded by ``max_retries``
    in :meth:`~ojs_celery.OJSTask.retry`, as in Celery) or for a failure of the system: an
    execution timeout then ends it, as in Celery, and a recovery (:data:`RECOVERIES`) or a
    redelivery (:data:`REDELIVERY`, at once) retries per the OJS policy on their own budget.
    """
    policy = job.retry
    if error_type in ("total_timeout", "enqueue_ttl_expired"):
        return Decision(retry=False)
    celery = celery_semantics(job)
    if celery is not None and error_type in NOT_CELERY_RETRIES:
        used = recoveries(job) + 1
        if used >= policy.max_attempts:
            return Decision(retry=False)
        wait = backoff_delay(policy, used, rand) if delay is None else max(delay, 0.0)
    elif celery is not None:
        if error_type == "timeout":
            return Decision(retry=False)
        default = celery.get("default_retry_delay")
        fallback = float(default) if isinstance(default, (int, float)) else 0.0
        wait = max(fallback if delay is None else delay, 0.0)
    else:
        if matches_non_retryable(error_type, policy.non_retryable_errors):
            return Decision(retry=False)
        if job.attempt >= policy.max_attempts:
            return Decision(retry=False)
        wait = backoff_delay(policy, job.attempt, rand) if delay is None else max(delay, 0.0)
    if job.total_timeout is not None and job.created_at is not None:
        deadline = job.created_at.timestamp() + job.total_timeout
        if deadline < now + wait + job.timeout:
            error = timeout_error(
                "total_timeout",
                job.total_timeout,
                now - job.created_at.timestamp(),
                f"a retry could not finish before the total timeout of {job.total_timeout}s",
            )
            return Decision(retry=False, total_timeout_error=error)
    return Decision(retry=True, delay=wait)


# --------------------------------------------------------------------------- events


def _base(job: Job, **data: Any) -> dict[str, Any]:
    base = {"job_id": job.id, "job_type": job.type, "queue": job.queue, "state": job.state,
            **data}
    return with_trace(base, job)


#: A W3C ``traceparent``: version, trace id, parent span id, flags.
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-(?P<trace>[0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")
#: The all-zero trace id W3C calls invalid.
_NO_TRACE = "0" * 32


def with_trace(data: dict[str, Any], job: Job) -> dict[str, Any]:
    """An event's ``data`` with the job's ``trace_id`` when it has trace context (OJS: every
    event of such a job carries it): ``meta.trace_id``, else the trace of
    ``meta.traceparent``."""
    meta = job.meta
    if not meta:
        return data
    trace = meta.get("trace_id")
    if not isinstance(trace, str) or not trace:
        parent = meta.get("traceparent")
        found = _TRACEPARENT.fullmatch(parent) if isinstance(parent, str) else None
        trace = found["trace"] if found is not None and found["trace"] != _NO_TRACE else None
    if trace:
        data["trace_id"] = trace
    return data


def _timeout_event(job: Job, error: dict[str, JsonValue]) -> tuple[str, dict[str, Any]]:
    return TIMEOUT_EVENTS[str(error["type"])], _base(
        job,
        timeout_kind=error.get("timeout_kind"),
        limit_seconds=error.get("limit_seconds"),
        elapsed_seconds=error.get("elapsed_seconds"),
        attempt=job.attempt,
    )


def _history_entry(error: dict[str, JsonValue], attempt: int, now: float) -> dict[str, JsonValue]:
    """The error history's entry: the error with its code, the attempt it ended (0 for a job
    that never started: it had no attempt, and ``attempt`` counts starts), and when."""
    code = error.get("code") or error_code(str(error.get("type")))
    entry: dict[str, JsonValue] = {**error, "code": code}
    entry["attempt"] = attempt
    entry["occurred_at"] = format_epoch(now)
    return entry


# --------------------------------------------------------------------------- transitions


def create(job: Job, now: float, policy: Policy) -> Transition:
    """A new job: ``scheduled`` (held in the store beyond the horizon) or ``available``."""
    new = Record(job=job.model_copy(), token=1)  # the caller's job is left as it was
    j = new.job
    j.created_at = from_epoch(now)
    j.attempt = 0
    eta = j.scheduled_at.timestamp() if j.scheduled_at else None
    if eta is not None and eta > now:
        j.state = "scheduled"
        events = [_enqueued(j), _scheduled(j)]
        if eta - now > policy.schedule_horizon:
            new.promote_at = eta
            return Transition(new, events=events)
        return Transition(new, events=events, publish=_owe(new, eta, now, policy))
    j.state = "available"
    j.enqueued_at = j.created_at
    return Transition(new, events=[_enqueued(j)], publish=_owe(new, None, now, policy))


def dispatch_deadline(eta: float | None, now: float, policy: Policy) -> float:
    """The outbox deadline of a message owed from ``now`` for ``eta`` (None: at once): if its
    publish is not acknowledged by then, the sweeper publishes it again."""
    return max(now if eta is None else eta, now) + policy.dispatch_grace


def _owe(record: Record, eta: float | None, now: float, policy: Policy) -> Publish:
    """The record owes a message for its current token, due at ``eta`` (None or past: at
    once): the outbox entry is written with the change, and the message counts as published
    now for the redispatch backstop."""
    record.promote_at = None
    record.dispatch_due = dispatch_deadline(eta, now, policy)
    record.extended_at = now
    return Publish(record.job.id, record.token, eta if eta is not None and eta > now else None)


def message_eta(job: Job) -> float | None:
    """When the job's message is meant to start it (a scheduled job's ``scheduled_at``, a
    retry's ``next_retry_at``); None: as soon as it arrives."""
    if job.state == "scheduled" and job.scheduled_at is not None:
        return job.scheduled_at.timestamp()
    if job.state == "retryable" and job.next_retry_at is not None:
        return job.next_retry_at.timestamp()
    return None


def _enqueued(job: Job) -> tuple[str, dict[str, Any]]:
    data = _base(job, priority=job.priority)
    if job.scheduled_at is not None:
        data["scheduled_at"] = format_timestamp(job.scheduled_at)
    return "job.enqueued", data


def _scheduled(job: Job) -> tuple[str, dict[str, Any]]:
    """``job.scheduled``: the job waits for its ``scheduled_at`` (after ``job.enqueued``)."""
    assert job.scheduled_at is not None
    return "job.scheduled", _base(job, scheduled_at=format_timestamp(job.scheduled_at))


def ack_dispatch(record: Record, token: int) -> Transition:
    """The owed message for ``token`` was published: clear the outbox entry."""
    if record.token != token or record.dispatch_due is None:
        return rejected("stale")
    new = record.copy()
    new.dispatch_due = None
    return Transition(new)


def start(
    record: Record, token: int, worker_id: str, now: float, policy: Policy,
    origin: str | None = None, carries: Callable[[Job], bool] | None = None,
) -> Transition:
    """A message with ``token`` arrived at ``worker_id``: may it start an attempt?

    ``origin`` (when the message names one) is the origin of the record it was published for:
    a record with another origin is another job with the same id (a producer tried to take an
    existing id), and the message is ``foreign``: it changes nothing. So is a message that
    ``carries`` says is not this job's (another task, other arguments: written by hand with
    the job's id and token).
    """
    if origin is not None and record.origin != origin:
        return rejected("foreign")
    if carries is not None and not carries(record.job):
        return rejected("foreign")
    job = record.job
    if job.state in TERMINAL:
        return rejected("cancelled" if job.state == "cancelled" else "terminal")
    if token < record.token:
        return rejected("stale")
    if token > record.token:
        return rejected("unknown_token")
    if job.state == "active":
        return rejected("duplicate")
    if job.state not in STARTABLE:
        return rejected(f"not_startable:{job.state}")
    created = job.created_at.timestamp() if job.created_at else now
    if job.total_timeout is not None and now >= created + job.total_timeout:
        return expire_total(record, now, policy)
    if job.enqueue_ttl is not None and job.attempt == 0 and now >= created + job.enqueue_ttl:
        return expire_ttl(record, now, policy)
    if job.expires_at is not None and now >= job.expires_at.timestamp():
        return expire_at(record, now)
    new = record.copy()
    j = new.job
    j.state = "active"
    j.attempt += 1
    j.started_at = from_epoch(now)
    if j.enqueued_at is None:
        j.enqueued_at = j.started_at
    j.next_retry_at = None
    j.progress = None
    new.worker_id = worker_id
    new.heartbeat_at = now
    new.extended_at = now
    new.dispatch_due = None
    new.promote_at = None
    started = _base(j, worker_id=worker_id, attempt=j.attempt)
    return Transition(new, events=[("job.started", started)])


def _owns(record: Record, attempt: int, worker_id: str) -> str | None:
    job = record.job
    if job.state != "active":
        return "not_active"
    if job.attempt != attempt:
        return "stale_attempt"
    if record.worker_id != worker_id:
        return "not_owner"
    return None


def heartbeat(
    record: Record,
    attempt: int,
    worker_id: str,
    now: float,
    *,
    stall: bool = True,
    progress: float | None = None,
    data: JsonValue = None,
    checkpoint: JsonValue = None,
) -> Transition:
    """The owner of ``attempt`` is alive: extend the reservation (and the stall clock)."""
    why = _owns(record, attempt, worker_id)
    if why:
        return rejected(why)
    new = record.copy()
    new.extended_at = now
    if stall:
        new.heartbeat_at = now
    j = new.job
    if progress is not None or data is not None:
        current = dict(j.progress or {})
        if progress is not None:
            value = min(max(float(progress), 0.0), 1.0)
            current["progress"] = max(value, float(current.get("progress", 0.0)))  # type: ignore[arg-type]
        if data is not None:
            current["data"] = data
        current["updated_at"] = format_epoch(now)
        j.progress = current
    if checkpoint is not None:
        j.last_checkpoint = checkpoint
    return Transition(new)


def complete(
    record: Record, attempt: int, worker_id: str, result: JsonValue, now: float
) -> Transition:
    """The owner of ``attempt`` succeeded."""
    why = _owns(record, attempt, worker_id)
    if why:
        return rejected(why)
    new = record.copy()
    j = new.job
    j.state = "completed"
    j.completed_at = from_epoch(now)
    j.result = result
    j.error = None
    if j.progress is not None:
        j.progress = {**j.progress, "progress": 1.0}
    new.worker_id = None
    started = j.started_at.timestamp() if j.started_at else now
    data = _base(j, duration_ms=round((now - started) * 1000), attempt=j.attempt)
    return Transition(new, events=[("job.completed", data)])


def fail(
    record: Record,
    attempt: int,
    worker_id: str | None,
    error: dict[str, JsonValue],
    now: float,
    *,
    rand: Callable[[], float] = random.random,
    delay: float | None = None,
    retryable: bool = True,
    policy: Policy = Policy(),
) -> Transition:
    """``attempt`` failed with ``error``: retry (new token, backoff) or discard, per policy.

    ``worker_id`` None means the sweeper acts for a lost or late owner; otherwise only the owner
    of the attempt may fail it.
    """
    if worker_id is None:
        if record.job.state != "active" or record.job.attempt != attempt:
            return rejected("stale_attempt")
    else:
        why = _owns(record, attempt, worker_id)
        if why:
            return rejected(why)
    new = record.copy()
    j = new.job
    events: list[tuple[str, dict[str, Any]]] = []
    error_type = str(error.get("type", "error"))
    if error_type in TIMEOUT_EVENTS:
        events.append(_timeout_event(j, error))
    decision = (
        decide(j, error_type, now, rand, delay) if retryable else Decision(retry=False)
    )
    j.error = dict(error)
    _add_error(j, _history_entry(error, j.attempt, now))
    new.worker_id = None
    new.heartbeat_at = None
    new.extended_at = None
    failed = _base(
        j,
        attempt=j.attempt,
        error={**_reported(error), "retryable": decision.retry},
    )
    if decision.retry:
        j.state = "retryable"
        eta = now + decision.delay
        j.next_retry_at = from_epoch(eta)
        new.token += 1
        failed["state"] = "retryable"
        events.append(("job.failed", failed))
        events.append(
            (
                "job.retrying",
                _base(
                    j,
                    attempt=j.attempt,
                    max_attempts=j.retry.max_attempts,
                    next_retry_at=format_timestamp(j.next_retry_at),
                    delay_seconds=round(decision.delay, 3),
                    error=_reported(error),
                ),
            )
        )
        return Transition(new, events=events, publish=_schedule(new, eta, now, policy))
    failed["state"] = "discarded"
    events.append(("job.failed", failed))
    if decision.total_timeout_error is not None:
        j.error = decision.total_timeout_error
        _add_error(j, _history_entry(decision.total_timeout_error, j.attempt, now))
        events.append(_timeout_event(j, decision.total_timeout_error))
    _discard(new, now)
    events.append(_discarded_event(new.job))
    return Transition(new, events=events)


def _schedule(record: Record, eta: float, now: float, policy: Policy) -> Publish | None:
    """Owe a message for ``eta``: published now with an ETA, or held in the store if far off."""
    if eta - now > policy.schedule_horizon:
        record.promote_at = eta
        record.dispatch_due = None
        return None
    return _owe(record, eta, now, policy)


def _discard(record: Record, now: float) -> None:
    j = record.job
    j.state = "discarded"
    j.completed_at = from_epoch(now)
    j.discarded_at = j.completed_at
    j.next_retry_at = None
    record.dead_letter = j.retry.on_exhaustion == "dead_letter"
    record.worker_id = None
    record.dispatch_due = None
    record.promote_at = None


def _discarded_event(job: Job) -> tuple[str, dict[str, Any]]:
    last = job.error or {}
    return "job.discarded", _base(
        job,
        total_attempts=job.attempt,
        last_error=_reported(last),
    )


def _reported(error: dict[str, JsonValue]) -> dict[str, JsonValue]:
    """An error as events report it: the stored error's code, type and message."""
    type_ = str(error.get("type") or "error")
    return {"code": error.get("code") or error_code(type_), "type": type_,
            "message": error.get("message")}


def _expire(record: Record, now: float, error: dict[str, JsonValue]) -> Transition:
    new = record.copy()
    j = new.job
    j.error = error
    _add_error(j, _history_entry(error, j.attempt, now))
    _discard(new, now)
    return Transition(new, events=[_timeout_event(j, error), _discarded_event(j)])


def expire_ttl(record: Record, now: float, policy: Policy) -> Transition:
    """Never started within ``enqueue_ttl`` of ``created_at``: discard."""
    job = record.job
    if job.state not in NEVER_STARTED or job.attempt != 0 or job.enqueue_ttl is None:
        return rejected("not_applicable")
    assert job.created_at is not None
    elapsed = now - job.created_at.timestamp()
    if elapsed < job.enqueue_ttl:
        return rejected(NOT_DUE)
    error = timeout_error(
        "enqueue_ttl_expired",
        job.enqueue_ttl,
        elapsed,
        f"job did not start within its enqueue_ttl of {job.enqueue_ttl}s",
    )
    return _expire(record, now, error)


def expire_total(record: Record, now: float, policy: Policy) -> Transition:
    """``created_at + total_timeout`` has passed, whatever the state: discard."""
    job = record.job
    if job.state in TERMINAL or job.total_timeout is None:
        return rejected("not_applicable")
    assert job.created_at is not None
    elapsed = now - job.created_at.timestamp()
    if elapsed < job.total_timeout:
        return rejected(NOT_DUE)
    error = timeout_error(
        "total_timeout",
        job.total_timeout,
        elapsed,
        f"job did not finish within its total_timeout of {job.total_timeout}s",
    )
    return _expire(record, now, error)


def expire_at(record: Record, now: float) -> Transition:
    """``expires_at`` (OJS core) passed before the job could run: discard, never execute."""
    job = record.job
    if job.state in TERMINAL or job.state == "active" or job.expires_at is None:
        return rejected("not_applicable")
    new = record.copy()
    j = new.job
    error = make_error("expired", f"job expired at {format_timestamp(job.expires_at)}")
    j.error = error
    _add_error(j, _history_entry(error, j.attempt, now))
    _discard(new, now)
    expired = _base(
        j,
        created_at=format_timestamp(j.created_at) if j.created_at else None,
        expired_at=format_timestamp(job.expires_at),
        # the time it was given to start: from its creation to its expires_at
        ttl_ms=(round((job.expires_at - j.created_at).total_seconds() * 1000)
                if j.created_at else None),
    )
    return Transition(new, events=[("job.expired", expired), _discarded_event(j)])


def cancel(record: Record, now: float, reason: str | None = None) -> Transition:
    """Cancel a job that is not terminal yet (an active attempt's outcome will be rejected)."""
    job = record.job
    if job.state in TERMINAL:
        return rejected(f"terminal:{job.state}")
    new = record.copy()
    j = new.job
    previous = j.state
    j.state = "cancelled"
    j.cancelled_at = from_epoch(now)
    j.next_retry_at = None
    new.worker_id = None
    new.dispatch_due = None
    new.promote_at = None
    data = _base(j, previous_state=previous)
    if reason:
        data["reason"] = reason
    return Transition(new, events=[("job.cancelled", data)])


def purge(record: Record, now: float, queues: frozenset[str] | None) -> Transition:
    """Cancel a job that waits to run (scheduled, available, retryable) in one of ``queues``
    (record queue names; None: any). A running attempt is left to finish, as Celery's purge
    leaves the tasks that a worker took."""
    job = record.job
    if job.state not in STARTABLE:
        return rejected(f"not_waiting:{job.state}")
    if queues is not None and job.queue not in queues:
        return rejected("other_queue")
    return cancel(record, now, reason="purged")


def cancel_by_owner(record: Record, attempt: int, worker_id: str, now: float) -> Transition:
    """The handler of ``attempt`` raised Celery's ``Ignore``: the job is cancelled."""
    job = record.job
    if job.state != "active" or job.attempt != attempt:
        return rejected("stale_attempt")
    if record.worker_id != worker_id:
        return rejected("not_owner")
    return cancel(record, now, reason="ignored by the handler")


# --------------------------------------------------------------------------- by dispatch token
# The worker's main process knows the message (its token), not the attempt number.


def extend(record: Record, token: int, worker_id: str, now: float, *, stall: bool) -> Transition:
    """A worker beat lists the attempt that ``token`` started: extend its reservation, and its
    stall clock unless ``stall`` is off or the job asked for handler heartbeats only
    (extension ``x_heartbeat: "handler"``)."""
    if record.token != token:
        return rejected("stale")
    worker_beats = stall and record.job.extensions.get("x_heartbeat") != "handler"
    done = heartbeat(record, record.job.attempt, worker_id, now, stall=worker_beats)
    if worker_beats and done.record is not None:  # the beat is the job's heartbeat
        j = done.record.job
        done.events.append(("job.heartbeat", _base(
            j, worker_id=worker_id, attempt=j.attempt,
            visible_until=format_epoch(now + j.visibility_timeout))))
    return done


def fail_token(
    record: Record,
    token: int,
    worker_id: str,
    error: dict[str, JsonValue],
    now: float,
    policy: Policy,
) -> Transition:
    """The attempt that ``token`` started on ``worker_id`` failed (see :func:`fail`)."""
    if record.token != token:
        return rejected("stale")
    return fail(record, record.job.attempt, worker_id, error, now, policy=policy)


# --------------------------------------------------------------------------- when a clock is due
# The sweeper's rules: each re-checks its deadline on the record it reads (an index may lag a
# write), and acts for the lost or late owner (``worker_id`` None in :func:`fail`).


def overdue(record: Record, now: float, policy: Policy) -> Transition:
    """Still active after ``timeout + grace_period`` (plus the sweeper's tolerance): error
    ``timeout``, retried per policy."""
    job = record.job
    if job.state != "active" or job.started_at is None:
        return rejected("not_active")
    elapsed = now - job.started_at.timestamp()
    if elapsed < job.timeout + job.grace_period + policy.execution_tolerance:
        return rejected(NOT_DUE)
    error = timeout_error(
        "timeout", job.timeout, elapsed,
        f"execution timeout of {job.timeout}s exceeded (enforced by the sweeper: the "
        "attempt was still active after its grace period)",
    )
    return fail(record, job.attempt, None, error, now, policy=policy)


def stalled(record: Record, now: float, policy: Policy) -> Transition:
    """No heartbeat for ``heartbeat_timeout``: error ``stalled``, retried per policy."""
    job = record.job
    if job.state != "active" or record.heartbeat_at is None:
        return rejected("not_active")
    silent = now - record.heartbeat_at
    if silent < job.heartbeat_timeout:
        return rejected(NOT_DUE)
    error = timeout_error(
        "stalled", job.heartbeat_timeout, silent,
        f"no heartbeat for {round(silent, 1)}s (heartbeat_timeout {job.heartbeat_timeout}s)",
    )
    return fail(record, job.attempt, None, error, now, policy=policy)


def invisible(record: Record, now: float, policy: Policy) -> Transition:
    """The reservation was not extended for ``visibility_timeout``: error
    ``visibility_timeout``, retried per policy."""
    job = record.job
    if job.state != "active" or record.extended_at is None:
        return rejected("not_active")
    if now - record.extended_at < job.visibility_timeout:
        return rejected(NOT_DUE)
    error = make_error(
        "visibility_timeout",
        f"reservation not extended for {job.visibility_timeout}s (visibility_timeout)",
    )
    return fail(record, job.attempt, None, error, now, policy=policy)


def orphaned(record: Record, worker_id: str, now: float, policy: Policy) -> Transition:
    """An attempt of a worker declared dead at ``now``: error ``worker_death``, retried per
    policy. An attempt started after ``now`` is left alone: the worker came back (it was
    frozen) and registered again under its id. So the rule applied again, when a burial is
    resumed with the same ``now``, changes nothing: the attempt it failed is over, the next
    one started later."""
    if record.job.state != "active" or record.worker_id != worker_id:
        return rejected("not_owned")
    started = record.job.started_at
    if started is not None and started.timestamp() > now:
        return rejected("started_since")
    error = make_error("worker_death", f"worker {worker_id} stopped sending heartbeats")
    return fail(record, record.job.attempt, None, error, now, policy=policy)


def redispatch(record: Record, now: float, policy: Policy) -> Transition:
    """A job a dead worker held but never started: the same message again (same token, no
    error, no attempt used), so that it need not wait for the broker's redelivery. Not if
    its message was published at or after ``now``, when the worker was declared dead (by
    this very rule, applied again when a burial is resumed with the same ``now``; by a
    producer or another clock): that message is not the one the worker held."""
    if record.job.state not in STARTABLE:
        return rejected("not_startable")
    if record.extended_at is not None and record.extended_at >= now:
        return rejected("sent_since")
    return _claim(record, now, policy)  # a message held for its ETA keeps it


def republish(record: Record, now: float, policy: Policy) -> Transition:
    """The outbox entry is past due (the publish failed or was not confirmed): claim it, so
    that one sweeper publishes the message again."""
    if _owes_nothing(record):
        return rejected("not_owed")
    if record.dispatch_due is None or record.dispatch_due > now:
        return rejected(NOT_DUE)
    return _claim(record, now, policy)


def promote(record: Record, now: float, policy: Policy) -> Transition:
    """A job held in the store (scheduled, or a retry after a long backoff) is due: claim its
    message, so that one sweeper publishes it."""
    if _owes_nothing(record):
        return rejected("not_owed")
    if record.promote_at is None or record.promote_at > now:
        return rejected(NOT_DUE)
    return _claim(record, now, policy)


def _owes_nothing(record: Record) -> bool:
    return record.job.state in TERMINAL or record.job.state == "active"


def _claim(record: Record, now: float, policy: Policy) -> Transition:
    """Publish the job's current token again, for its ETA if that is still ahead (a scheduled
    job, a retry's backoff); the outbox deadline moves one grace past it."""
    new = record.copy()
    return Transition(new, publish=_owe(new, message_eta(record.job), now, policy))


def waiting_deadline(record: Record, policy: Policy) -> float | None:
    """When a job waiting for a message it was sent (no outbox entry needed, nothing held in
    the store) is owed that message once more: past the later of its last publish and the time
    the message is meant for, by ``redispatch_after`` or by as long as the job has waited
    since its message was first meant to run, whichever is longer. None: not waiting for a
    sent message.

    The wait doubles with each copy (``redispatch_after``, then 2, 4, 8 times it after the
    first): a job behind a backlog (no worker for hours) would otherwise get one more message
    every ``redispatch_after`` and the queue grow by its whole backlog each time, while the
    copies that wait in it are its messages, not lost ones."""
    job = record.job
    if job.state not in STARTABLE or record.promote_at is not None:
        return None
    published = record.extended_at
    if published is None:  # written before the backstop existed
        return None
    eta = message_eta(job)
    sent_for = max(published, eta or published)
    first = eta if eta is not None else job.created_at.timestamp() if job.created_at else None
    waited = sent_for - first if first is not None else 0.0
    return sent_for + max(policy.redispatch_after, waited)


def resend(record: Record, now: float, policy: Policy) -> Transition:
    """A job has waited ``redispatch_after`` for a message that may be gone (a broker that
    lost it, a worker that acked it without starting): publish it once more with the same
    token; if the first one still comes, fencing drops whichever arrives second."""
    deadline = waiting_deadline(record, policy)
    if deadline is None:
        return rejected("not_waiting")
    if deadline > now:
        return rejected(NOT_DUE)
    return _claim(record, now, policy)


def resend_lost(record: Record, now: float, policy: Policy, lost_before: float) -> Transition:
    """The broker lost its data (see ``ojs_celery.sweeper``): a job waiting for a message last
    published before ``lost_before`` gets it once more now, with the same token, instead of
    after ``redispatch_after``. A job published since is left alone (its message is in the
    broker as it is now); a copy that meets a message that survived, or one sent just after
    the loss (``lost_before`` allows for the publishers' clocks running ahead of the
    sweeper's), is dropped by fencing."""
    if waiting_deadline(record, policy) is None:
        return rejected("not_waiting")
    assert record.extended_at is not None  # a waiting job has been published
    if record.extended_at >= lost_before:
        return rejected("sent_since")
    return _claim(record, now, policy)


# --------------------------------------------------------------------------- a job that stays stuck



def dispatch_failures(job: Job) -> int:
    """Sweeps in a row that failed on this job: the ``dispatch_error`` entries that end its
    error history (any other entry, such as an attempt's error, ends the run)."""
    count = 0
    for entry in reversed(job.errors):
        if entry.get("type") != DISPATCH_ERROR:
            break
        count += 1
    return count


def dispatch_failed(record: Record, reason: str, now: float, policy: Policy) -> Transition:
    """A sweep could not carry out a due transition of this job for a reason of its own (the
    broker refuses its queue or options, its transition raised): the failure is recorded in
    its error history, where the next sweeps count it, and after
    ``policy.dispatch_failure_limit`` sweeps in a row the job is discarded with
    ``dispatch_failed``. Recording the count in the record keeps it right across sweepers and
    restarts, and needs no field of its own."""
    job = record.job
    if job.state in TERMINAL:
        return rejected(f"terminal:{job.state}")
    failures = dispatch_failures(job) + 1
    new = record.copy()
    j = new.job
    if failures < policy.dispatch_failure_limit:
        entry = _history_entry(make_error(DISPATCH_ERROR, reason), j.attempt, now)
        _add_error(j, entry)
        return Transition(new)
    error = make_error(
        DISPATCH_FAILED, f"the sweeper failed {failures} times in a row to dispatch the job; "
        f"last: {reason}",
    )
    entry = _history_entry(error, j.attempt, now)
    j.error = error
    _add_error(j, entry)
    _discard(new, now)
    new.heartbeat_at = None
    new.extended_at = None
    return Transition(new, events=[_discarded_event(j)])
