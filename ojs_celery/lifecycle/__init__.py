"""Job states, every state transition and every clock, as pure functions (no I/O).

:mod:`.rules` holds the records, the retry decision and the transitions (what the producer, the
worker, the API and the sweeper ask the store to apply); :mod:`.clocks` holds each deadline of
the timeout model with the transition applied when it passes. Nothing here touches a store, a
broker or Celery, so every rule can be tested on its own and every caller shares it.
"""

from __future__ import annotations

from .clocks import (
    BY_NAME,
    CLOCKS,
    DISPATCH,
    ENQUEUE_TTL,
    EXECUTION,
    INDEXED,
    PROMOTE,
    RETENTION,
    STALL,
    SWEEP,
    TOTAL,
    VISIBILITY,
    WORKER,
    Clock,
    Rule,
    Times,
    WorkerClock,
    deadlines,
)
from .rules import (
    DAY,
    DISPATCH_ERROR,
    DISPATCH_FAILED,
    NEVER_STARTED,
    STARTABLE,
    STATES,
    TERMINAL,
    TIMEOUT_EVENTS,
    TIMEOUT_KINDS,
    Decision,
    Policy,
    Publish,
    Record,
    Transition,
    ack_dispatch,
    backoff_delay,
    cancel,
    cancel_by_owner,
    complete,
    create,
    decide,
    dispatch_deadline,
    dispatch_failed,
    dispatch_failures,
    expire_at,
    expire_total,
    expire_ttl,
    extend,
    fail,
    fail_token,
    heartbeat,
    invisible,
    make_error,
    matches_non_retryable,
    orphaned,
    overdue,
    promote,
    redispatch,
    rejected,
    republish,
    stalled,
    start,
    timeout_error,
)

__all__ = [
    "BY_NAME", "CLOCKS", "DAY", "DISPATCH", "DISPATCH_ERROR", "DISPATCH_FAILED", "ENQUEUE_TTL",
    "EXECUTION", "INDEXED", "NEVER_STARTED", "PROMOTE", "RETENTION", "STALL", "STARTABLE",
    "STATES", "SWEEP", "TERMINAL", "TIMEOUT_EVENTS", "TIMEOUT_KINDS", "TOTAL", "VISIBILITY",
    "WORKER", "Clock", "Decision", "Policy", "Publish", "Record", "Rule", "Times", "Transition",
    "WorkerClock", "ack_dispatch", "backoff_delay", "cancel", "cancel_by_owner", "complete",
    "create", "deadlines", "decide", "dispatch_deadline", "dispatch_failed", "dispatch_failures",
    "expire_at", "expire_total", "expire_ttl", "extend", "fail", "fail_token", "heartbeat",
    "invisible", "make_error", "matches_non_retryable", "orphaned", "overdue", "promote",
    "redispatch", "rejected", "republish", "stalled", "start", "timeout_error",
]
