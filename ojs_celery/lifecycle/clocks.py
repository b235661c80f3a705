"""Every clock of the timeout model: its deadline, and the transition applied when it passes.

A :class:`Clock` reads its deadline from a record (None: the clock does not run in that state);
the store indexes every clock of :data:`INDEXED` by that deadline, and the sweeper takes what is
due on each clock of :data:`SWEEP` in turn and applies the clock's rule with compare-and-set.
Worker liveness is a clock on the worker registry instead of on job records
(:class:`WorkerClock`). The clocks that count a worker's silence (liveness, stall, visibility)
do not count it during a :class:`BlindSpell`, when the store itself was away. The order of
:data:`SWEEP` breaks ties when several deadlines of one attempt are due at once: the first
clock's transition wins, and the compare-and-set on the attempt makes the others moot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from .rules import (
    NEVER_STARTED,
    TERMINAL,
    Policy,
    Record,
    Transition,
    expire_total,
    expire_ttl,
    invisible,
    orphaned,
    overdue,
    promote,
    redispatch,
    rejected,
    republish,
    resend,
    stalled,
    waiting_deadline,
)

#: A rule as the store applies it: the record read, the transition to write.
Rule = Callable[[Record], Transition]


def _no_lag(policy: Policy) -> float:
    return 0.0


@dataclass(frozen=True)
class BlindSpell:
    """The last time no sweep reached the store for long enough to hide beats (a Redis pause
    or failover stops the workers' beats and the sweeps alike): from the last sweep's contact
    before it to the first after it (see ``MetaArea.record_contact``).

    Silence in it is not a worker's: were it counted, the first sweep after a pause longer than
    a timeout would declare every live worker dead, or every running job stalled, and run
    their jobs a second time. A silence that overlapped the spell counts that much later."""

    start: float
    end: float

    def heard(self, at: float) -> float:
        """When a worker last heard at ``at`` counts as heard: moved on by the part of the
        spell after ``at`` (a beat may land just after the last contact the spell starts at)."""
        if at > self.end:
            return at
        return at + self.end - max(at, self.start)


class Times(NamedTuple):
    """A record's timestamps in epoch seconds, read once for all its clocks (converting an
    aware datetime costs more than the rest of a deadline)."""

    created: float | None
    #: ``started_at`` of the running attempt (None unless the job is active).
    started: float | None

    @classmethod
    def of(cls, record: Record) -> Times:
        job = record.job
        created = job.created_at
        started = job.started_at if job.state == "active" else None
        return cls(
            None if created is None else created.timestamp(),
            None if started is None else started.timestamp(),
        )


#: Why the execution clock passed over an attempt this pass: its worker is silent and may yet
#: be declared dead (see :meth:`WorkerClock.claims`).
AWAITING_WORKER = "awaiting_worker"


class Heard(NamedTuple):
    """A registered worker as the clocks see it: its last beat, whether its pool ends an
    attempt at the hard time limit by itself (``WorkerInfo.time_limits``) and its own worker
    heartbeat timeout (``WorkerInfo.heartbeat_timeout``, 0 if not known)."""

    last_beat: float
    time_limits: bool
    heartbeat_timeout: float = 0.0


@dataclass(frozen=True)
class Clock:
    """One deadline kind of job records.

    ``when`` computes the deadline the store indexes (None: the clock does not run in the
    record's state); ``when_due`` is the transition the sweeper applies once ``now - lag``
    reaches it (None for retention: a job past it is deleted by ``JobStore.prune``, not
    changed). ``silent_since`` is set on the clocks that count a worker's silence: when the
    worker was last heard, which a :class:`BlindSpell` moves on. ``defers_to`` is set on the
    clock that judges the attempt's time (execution): it leaves an attempt whose worker fell
    silent before the deadline to that worker clock (see :meth:`WorkerClock.claims`).
    """

    name: str
    when: Callable[[Record, Times, Policy], float | None]
    when_due: Callable[[Record, float, Policy], Transition] | None
    lag: Callable[[Policy], float] = _no_lag
    silent_since: Callable[[Record], float | None] | None = None
    defers_to: WorkerClock | None = None

    def deadline(self, record: Record, policy: Policy) -> float | None:
        return self.when(record, Times.of(record), policy)

    def cutoff(self, now: float, policy: Policy) -> float:
        """What is indexed at or before this time is due."""
        return now - self.lag(policy)

    def rule(self, now: float, policy: Policy, spell: BlindSpell | None = None,
             workers: Mapping[str, Heard] | None = None) -> Rule:
        """The due transition at ``now``, as a rule for ``JobStore.apply``; a worker's silence
        during ``spell`` does not count towards it. ``workers`` (the registered workers, for a
        clock that ``defers_to`` the worker clock): an attempt that clock claims is rejected
        with :data:`AWAITING_WORKER`."""
        when_due = self.when_due
        assert when_due is not None, f"clock {self.name} has no transition"
        silent_since = self.silent_since
        counts_spell = spell is not None and silent_since is not None
        worker_clock = self.defers_to if workers is not None else None
        if not counts_spell and worker_clock is None:
            return lambda record: when_due(record, now, policy)

        def rule(record: Record) -> Transition:
            deadline = self.deadline(record, policy)
            if deadline is not None and counts_spell:
                assert spell is not None and silent_since is not None
                since = silent_since(record)
                if since is not None and deadline + spell.heard(since) - since > now:
                    return rejected("blind_spell")
            if deadline is not None and worker_clock is not None and record.worker_id:
                assert workers is not None
                owner = workers.get(record.worker_id)
                if worker_clock.claims(owner, deadline, now, policy, spell):
                    return rejected(AWAITING_WORKER)
            return when_due(record, now, policy)

        return rule


@dataclass(frozen=True)
class WorkerClock:
    """Worker liveness: due at ``last_beat + worker_heartbeat_timeout``, or the worker's own
    timeout where it is longer (its beats may be further apart than this process's settings
    expect). The worker is then declared dead: its active attempts fail with ``worker_death``
    (retried per policy) and the jobs it held but never started are dispatched again (same
    token, no attempt used). Its silence during a :class:`BlindSpell` does not count (see
    :meth:`is_dead`)."""

    name: str = "worker"

    def deadline(self, last_beat: float, policy: Policy) -> float:
        return last_beat + policy.worker_heartbeat_timeout

    def cutoff(self, now: float, policy: Policy) -> float:
        """Workers whose last beat is at or before this time may be due (those whose own
        timeout is longer are not yet: see :meth:`is_dead`)."""
        return now - policy.worker_heartbeat_timeout

    def timeout(self, policy: Policy, own_timeout: float = 0.0) -> float:
        """The silence after which a worker is dead: this process's worker heartbeat timeout,
        or ``own_timeout``, the worker's own, if that is longer."""
        return max(policy.worker_heartbeat_timeout, own_timeout)

    def is_dead(self, last_beat: float, now: float, policy: Policy,
                spell: BlindSpell | None = None, own_timeout: float = 0.0) -> bool:
        """Silent for :meth:`timeout`."""
        heard = last_beat if spell is None else spell.heard(last_beat)
        return heard <= now - self.timeout(policy, own_timeout)

    def claims(self, owner: Heard | None, deadline: float, now: float, policy: Policy,
               spell: BlindSpell | None = None) -> bool:
        """Whether an attempt past its execution ``deadline`` is this clock's to end rather
        than a ``timeout``: its worker (``owner``, None if not registered) ends attempts at the
        hard time limit itself but has not beaten since the deadline, and may still be
        declared dead (silent for under twice the worker heartbeat timeout).

        Such a worker was not alive at the deadline, or its own limit would have ended the
        attempt there: it may have died or frozen before the attempt ran its time, which only
        this clock can tell, as ``worker_death`` (retried even under Celery's semantics, where
        ``timeout`` is final). A pool without time limits (solo, threads) is not waited for: a
        handler there can hold the beats back while it overruns. Nor is a worker this clock
        should have declared dead long ago: nothing waits on it for ever."""
        if owner is None or not owner.time_limits or owner.last_beat >= deadline:
            return False
        timeout = self.timeout(policy, owner.heartbeat_timeout)
        return not self.is_dead(owner.last_beat, now - timeout, policy, spell,
                                owner.heartbeat_timeout)

    def active_rule(self, worker_id: str, now: float, policy: Policy) -> Rule:
        """An attempt the worker declared dead at ``now`` listed as running: see
        :func:`~ojs_celery.lifecycle.orphaned`."""
        return partial(orphaned, worker_id=worker_id, now=now, policy=policy)

    def orphans_rule(self, buried: Mapping[str, float], policy: Policy) -> Rule:
        """:meth:`active_rule` for an attempt of any of the workers ``buried`` (each with the
        time it was declared dead), whichever it is: for the active jobs the dead workers'
        last beats did not list (started after it)."""

        def rule(record: Record) -> Transition:
            owner = record.worker_id
            since = None if owner is None else buried.get(owner)
            if owner is None or since is None:
                return rejected("not_owned")
            return orphaned(record, owner, since, policy)

        return rule

    def reserved_rule(self, now: float, policy: Policy) -> Rule:
        return partial(redispatch, now=now, policy=policy)


# --------------------------------------------------------------------------- deadlines


def _total(record: Record, times: Times, policy: Policy) -> float | None:
    job = record.job
    if times.created is None or not job.total_timeout or job.state in TERMINAL:
        return None
    return times.created + job.total_timeout


def _enqueue_ttl(record: Record, times: Times, policy: Policy) -> float | None:
    job = record.job
    if (times.created is None or not job.enqueue_ttl or job.state not in NEVER_STARTED
            or job.attempt):
        return None
    return times.created + job.enqueue_ttl


def _execution(record: Record, times: Times, policy: Policy) -> float | None:
    job = record.job
    return None if times.started is None else times.started + job.timeout + job.grace_period


def _stall(record: Record, times: Times, policy: Policy) -> float | None:
    if times.started is None or record.heartbeat_at is None:
        return None
    return record.heartbeat_at + record.job.heartbeat_timeout


def _visibility(record: Record, times: Times, policy: Policy) -> float | None:
    if times.started is None or record.extended_at is None:
        return None
    return record.extended_at + record.job.visibility_timeout


def _dispatch(record: Record, times: Times, policy: Policy) -> float | None:
    return None if record.job.state in TERMINAL else record.dispatch_due


def _promote(record: Record, times: Times, policy: Policy) -> float | None:
    return None if record.job.state in TERMINAL else record.promote_at


def _redispatch(record: Record, times: Times, policy: Policy) -> float | None:
    return waiting_deadline(record, policy)


def _retention(record: Record, times: Times, policy: Policy) -> float | None:
    job = record.job
    state = job.state
    if state not in TERMINAL:
        return None
    ended = job.completed_at or job.cancelled_at or job.discarded_at
    if ended is None:
        return None
    if state == "completed":
        keep = policy.retention_completed
    elif state == "cancelled":
        keep = policy.retention_cancelled
    elif record.dead_letter:
        keep = policy.retention_dead_letter
    else:
        keep = policy.retention_discarded
    return ended.timestamp() + keep


def _execution_lag(policy: Policy) -> float:
    return policy.execution_tolerance


# --------------------------------------------------------------------------- the clocks

#: The owning worker's ``last_beat + worker_heartbeat_timeout``: see :class:`WorkerClock`.
WORKER = WorkerClock()
#: ``created_at + total_timeout``, any non-terminal state: discarded, ``total_timeout``.
TOTAL = Clock("total", _total, expire_total)
#: ``created_at + enqueue_ttl``, never started: discarded, ``enqueue_ttl_expired``.
ENQUEUE_TTL = Clock("enqueue_ttl", _enqueue_ttl, expire_ttl)
#: ``started_at + timeout + grace_period``, active (the sweeper waits a tolerance more, so
#: that the worker's hard limit normally wins): retry or discard, ``timeout``.
#: An attempt whose worker fell silent before the deadline is left to the worker clock.
EXECUTION = Clock("execution", _execution, overdue, _execution_lag, defers_to=WORKER)
#: ``heartbeat_at + heartbeat_timeout``, active: retry or discard, ``stalled``.
STALL = Clock("stall", _stall, stalled, silent_since=lambda record: record.heartbeat_at)
#: ``extended_at + visibility_timeout``, active: retry or discard, ``visibility_timeout``.
VISIBILITY = Clock("visibility", _visibility, invisible,
                   silent_since=lambda record: record.extended_at)
#: The outbox entry (``dispatch_due``, see ``dispatch_deadline``): the message again.
DISPATCH = Clock("dispatch", _dispatch, republish)
#: ``promote_at`` of a job held in the store (scheduled beyond the horizon, or a long
#: backoff): its message is published.
PROMOTE = Clock("promote", _promote, promote)
#: The last publish of a waiting job's message (or the time it is meant for, if later) plus
#: ``redispatch_after``: the message once more, the backstop for a message that is gone.
REDISPATCH = Clock("redispatch", _redispatch, resend)
#: ``completed_at + retention`` of the terminal state: the job is deleted.
RETENTION = Clock("retention", _retention, None)

#: The clocks a sweep pass enforces, in the order that breaks ties.
SWEEP: tuple[Clock | WorkerClock, ...] = (
    TOTAL, ENQUEUE_TTL, EXECUTION, STALL, VISIBILITY, WORKER, DISPATCH, PROMOTE, REDISPATCH,
    RETENTION,
)
#: The clocks the store indexes on job records.
INDEXED: tuple[Clock, ...] = tuple(clock for clock in SWEEP if isinstance(clock, Clock))
#: Their names, in index order (one sorted set or indexed column each in the backends).
CLOCKS: tuple[str, ...] = tuple(clock.name for clock in INDEXED)
BY_NAME: dict[str, Clock] = {clock.name: clock for clock in INDEXED}


def deadlines(record: Record, policy: Policy) -> dict[str, float | None]:
    """Every indexed clock's deadline for this record (None: the clock does not run)."""
    times = Times.of(record)
    return {clock.name: clock.when(record, times, policy) for clock in INDEXED}
