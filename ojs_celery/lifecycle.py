"""Job states, the retry decision and every state transition, as pure functions (no I/O).

A transition takes the stored :class:`Record` and the facts of the moment (``now``, a token, a
worker id, an outcome) and returns a :class:`Transition`: the new record (or why nothing changes),
the OJS events to emit and the message to publish, if any. The store applies it with one
compare-and-set, so the same rules hold in the worker, the sweeper and the producer.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from .envelope import Job, JsonValue, RetryPolicy, State, format_timestamp, from_epoch

STATES: tuple[str, ...] = get_args(State)
TERMINAL = frozenset({"completed", "cancelled", "discarded"})
NEVER_STARTED = frozenset({"scheduled", "available", "pending"})
STARTABLE = frozenset({"scheduled", "available", "retryable"})

#: The deadline indexes, in the order that breaks ties when several are due at once.
CLOCKS = (
    "total",
    "enqueue_ttl",
    "execution",
    "stall",
    "visibility",
    "dispatch",
    "promote",
    "retention",
)
Clock = Literal[
    "total", "enqueue_ttl", "execution", "stall", "visibility", "dispatch", "promote", "retention"
]

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
    retention_completed: float = 7 * DAY
    retention_cancelled: float = 30 * DAY
    retention_discarded: float = 30 * DAY
    retention_dead_letter: float = 180 * DAY


@dataclass
class Record:
    """What the store keeps for one job besides the OJS fields of :class:`Job`.

    ``token`` is the dispatch token a message must carry to start the job; ``version`` is the
    compare-and-set counter; ``heartbeat_at`` drives stall detection and ``extended_at`` the
    visibility timeout; ``dispatch_due`` is the outbox entry (a message is owed; the sweeper
    republishes it once this time has passed); ``promote_at`` is when a job held in the store
    (scheduled, or retrying after a long backoff) must be published.
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

    def copy(self) -> Record:
        """A record to build the next version in: the job is copied shallowly, because the
        rules only ever assign attributes and build new containers (``[*j.errors, entry]``,
        ``{**j.progress, ...}``), never change a list or dict of the record they read."""
        return replace(self, job=self.job.model_copy())


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


def rejected(reason: str) -> Transition:
    return Transition(record=None, reason=reason)


# --------------------------------------------------------------------------- errors and backoff


def make_error(type_: str, message: str, **extra: JsonValue) -> dict[str, JsonValue]:
    error: dict[str, JsonValue] = {"type": type_, "message": message}
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
    """Exponential backoff ``I·C^(n−1)``, capped, jittered in [0.5, 1.5), capped again."""
    delay = policy.initial_seconds * policy.backoff_coefficient ** max(retry_number - 1, 0)
    delay = min(delay, policy.max_seconds)
    if policy.jitter:
        delay = min(delay * (0.5 + rand()), policy.max_seconds)
    return delay


@dataclass(frozen=True)
class Decision:
    retry: bool
    delay: float = 0.0
    total_timeout_error: dict[str, JsonValue] | None = None


def decide(
    job: Job,
    error_type: str,
    now: float,
    rand: Callable[[], float] = random.random,
    delay: float | None = None,
) -> Decision:
    """Retry or discard after a failed attempt (``job.attempt`` = attempts started so far)."""
    policy = job.retry
    if matches_non_retryable(error_type, policy.non_retryable_errors):
        return Decision(retry=False)
    if error_type in ("total_timeout", "enqueue_ttl_expired"):
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


# --------------------------------------------------------------------------- deadlines


def deadlines(record: Record, policy: Policy) -> dict[str, float | None]:
    """Every clock's deadline for this record (None: the clock does not run in this state)."""
    job = record.job
    state = job.state
    created = job.created_at.timestamp() if job.created_at else None
    active = state == "active"
    started = job.started_at.timestamp() if job.started_at else None
    result: dict[str, float | None] = dict.fromkeys(CLOCKS)
    if created is not None and job.enqueue_ttl and state in NEVER_STARTED and job.attempt == 0:
        result["enqueue_ttl"] = created + job.enqueue_ttl
    if created is not None and job.total_timeout and state not in TERMINAL:
        result["total"] = created + job.total_timeout
    if active and started is not None:
        result["execution"] = started + job.timeout + job.grace_period
        if record.heartbeat_at is not None:
            result["stall"] = record.heartbeat_at + job.heartbeat_timeout
        if record.extended_at is not None:
            result["visibility"] = record.extended_at + job.visibility_timeout
    if state not in TERMINAL:
        result["dispatch"] = record.dispatch_due
        result["promote"] = record.promote_at
    else:
        ended = job.completed_at or job.cancelled_at or job.discarded_at
        if ended is not None:
            keep = {
                "completed": policy.retention_completed,
                "cancelled": policy.retention_cancelled,
                "discarded": policy.retention_discarded,
            }[state]
            if state == "discarded" and record.dead_letter:
                keep = policy.retention_dead_letter
            result["retention"] = ended.timestamp() + keep
    return result


# --------------------------------------------------------------------------- events


def _base(job: Job, **data: Any) -> dict[str, Any]:
    return {"job_id": job.id, "job_type": job.type, "queue": job.queue, "state": job.state, **data}


def _timeout_event(job: Job, error: dict[str, JsonValue]) -> tuple[str, dict[str, Any]]:
    return TIMEOUT_EVENTS[str(error["type"])], _base(
        job,
        timeout_kind=error.get("timeout_kind"),
        limit_seconds=error.get("limit_seconds"),
        elapsed_seconds=error.get("elapsed_seconds"),
        attempt=job.attempt,
    )


def _history_entry(error: dict[str, JsonValue], attempt: int, now: float) -> dict[str, JsonValue]:
    code = "HANDLER_TIMEOUT" if error.get("type") in TIMEOUT_KINDS else "HANDLER_ERROR"
    entry: dict[str, JsonValue] = {"code": code, **error}
    entry["attempt"] = attempt
    entry["occurred_at"] = format_timestamp(from_epoch(now))
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
        if eta - now > policy.schedule_horizon:
            new.promote_at = eta
            return Transition(new, events=[_enqueued(j)])
    else:
        j.state = "available"
        j.enqueued_at = j.created_at
        eta = None
    new.dispatch_due = now + policy.dispatch_grace + max((eta or now) - now, 0.0)
    return Transition(new, events=[_enqueued(j)], publish=Publish(j.id, new.token, eta))


def _enqueued(job: Job) -> tuple[str, dict[str, Any]]:
    data = _base(job, priority=job.priority)
    if job.scheduled_at is not None:
        data["scheduled_at"] = format_timestamp(job.scheduled_at)
    return "job.enqueued", data


def ack_dispatch(record: Record, token: int) -> Transition:
    """The owed message for ``token`` was published: clear the outbox entry."""
    if record.token != token or record.dispatch_due is None:
        return rejected("stale")
    new = record.copy()
    new.dispatch_due = None
    return Transition(new)


def start(record: Record, token: int, worker_id: str, now: float, policy: Policy) -> Transition:
    """A message with ``token`` arrived at ``worker_id``: may it start an attempt?"""
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
        current["updated_at"] = format_timestamp(from_epoch(now))
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
    j.errors = [*j.errors, _history_entry(error, j.attempt, now)]
    new.worker_id = None
    new.heartbeat_at = None
    new.extended_at = None
    failed = _base(
        j,
        attempt=j.attempt,
        error={"code": error_type, "type": error_type, "message": error.get("message"),
               "retryable": decision.retry},
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
                    error={"code": error_type, "message": error.get("message")},
                ),
            )
        )
        return Transition(new, events=events, publish=_schedule(new, eta, now, policy))
    failed["state"] = "discarded"
    events.append(("job.failed", failed))
    if decision.total_timeout_error is not None:
        j.error = decision.total_timeout_error
        j.errors = [*j.errors, _history_entry(decision.total_timeout_error, j.attempt, now)]
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
    record.promote_at = None
    record.dispatch_due = max(eta, now) + policy.dispatch_grace
    return Publish(record.job.id, record.token, eta if eta > now else None)


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
        last_error={"code": last.get("type"), "message": last.get("message")},
    )


def _expire(record: Record, now: float, error: dict[str, JsonValue]) -> Transition:
    new = record.copy()
    j = new.job
    j.error = error
    j.errors = [*j.errors, _history_entry(error, max(j.attempt, 1), now)]
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
        return rejected("not_due")
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
        return rejected("not_due")
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
    j.errors = [*j.errors, _history_entry(error, max(j.attempt, 1), now)]
    _discard(new, now)
    expired = _base(
        j,
        created_at=format_timestamp(j.created_at) if j.created_at else None,
        expired_at=format_timestamp(job.expires_at),
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
