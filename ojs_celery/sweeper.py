"""The sweeper: server-side enforcement of every deadline, from the store's indexes.

One pass takes what is due on each clock (``store.due``, O(log n + k)), applies the transition
with compare-and-set, emits the events, terminates a running attempt that lost its job, and
publishes what is owed (retries, the outbox, scheduled jobs that came due). Only the process
whose compare-and-set won acts, so any number of sweepers may run at once. The jobs due on one
clock are read in one batch and written in one batch (``store.apply_many``); a job whose write
lost a race goes through ``store.apply`` alone, which re-reads it. It knows nothing of Celery
beyond publishing and one control command: the Celery task, the beat entry and
``ojs-celery sweep --loop`` are thin shells around :func:`sweep`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from . import lifecycle
from .effects import carry_out
from .envelope import Job, JsonValue
from .lifecycle import Publish, Record, Transition
from .producer import BrokerUnavailable
from .runtime import Runtime
from .store import StoreError

logger = logging.getLogger(__name__)

LAST_SWEEP_KEY = "last_sweep"
SWEEP_TASK = "ojs_celery.sweep"


@dataclass
class SweepReport:
    """What one pass did, per clock; ``error`` is set when the pass was skipped."""

    started: float
    applied: Counter[str] = field(default_factory=Counter)
    published: int = 0
    pruned: int = 0
    error: str | None = None

    @property
    def total(self) -> int:
        return sum(self.applied.values()) + self.published + self.pruned


def _execution_overdue(now: float, tolerance: float) -> Callable[[Record], Transition]:
    def rule(record: Record) -> Transition:
        job = record.job
        if job.state != "active" or job.started_at is None:
            return lifecycle.rejected("not_active")
        elapsed = now - job.started_at.timestamp()
        if elapsed < job.timeout + job.grace_period + tolerance:
            return lifecycle.rejected("not_due")
        error = lifecycle.timeout_error(
            "timeout", job.timeout, elapsed,
            f"execution timeout of {job.timeout}s exceeded (enforced by the sweeper: the "
            "attempt was still active after its grace period)",
        )
        return lifecycle.fail(record, job.attempt, None, error, now)

    return rule


def _stalled(now: float) -> Callable[[Record], Transition]:
    def rule(record: Record) -> Transition:
        job = record.job
        if job.state != "active" or record.heartbeat_at is None:
            return lifecycle.rejected("not_active")
        silent = now - record.heartbeat_at
        if silent < job.heartbeat_timeout:
            return lifecycle.rejected("not_due")
        error = lifecycle.timeout_error(
            "stalled", job.heartbeat_timeout, silent,
            f"no heartbeat for {round(silent, 1)}s (heartbeat_timeout {job.heartbeat_timeout}s)",
        )
        return lifecycle.fail(record, job.attempt, None, error, now)

    return rule


def _invisible(now: float) -> Callable[[Record], Transition]:
    def rule(record: Record) -> Transition:
        job = record.job
        if job.state != "active" or record.extended_at is None:
            return lifecycle.rejected("not_active")
        if now - record.extended_at < job.visibility_timeout:
            return lifecycle.rejected("not_due")
        error = lifecycle.make_error(
            "visibility_timeout",
            f"reservation not extended for {job.visibility_timeout}s (visibility_timeout)",
        )
        return lifecycle.fail(record, job.attempt, None, error, now)

    return rule


def _orphaned(worker_id: str, now: float) -> Callable[[Record], Transition]:
    """An attempt of a worker declared dead: error ``worker_death``, retried per policy."""

    def rule(record: Record) -> Transition:
        if record.job.state != "active" or record.worker_id != worker_id:
            return lifecycle.rejected("not_owned")
        error = lifecycle.make_error(
            "worker_death", f"worker {worker_id} stopped sending heartbeats")
        return lifecycle.fail(record, record.job.attempt, None, error, now)

    return rule


def _redispatch(now: float, grace: float) -> Callable[[Record], Transition]:
    """A job a dead worker held but never started: the same message again (same token, no
    error, no attempt used), so that it need not wait for the broker's redelivery."""

    def rule(record: Record) -> Transition:
        if record.job.state not in lifecycle.STARTABLE:
            return lifecycle.rejected("not_startable")
        new = record.copy()
        eta = _eta_of(record.job, now)  # a message held for its ETA keeps it
        new.dispatch_due = now + grace + max((eta or now) - now, 0.0)
        return Transition(new, publish=Publish(record.job.id, record.token, eta))

    return rule


def _eta_of(job: Job, now: float) -> float | None:
    """When the job's message is due, if later than ``now`` (a scheduled job, a retry)."""
    eta = None
    if job.state == "scheduled" and job.scheduled_at is not None:
        eta = job.scheduled_at.timestamp()
    elif job.state == "retryable" and job.next_retry_at is not None:
        eta = job.next_retry_at.timestamp()
    return eta if eta is not None and eta > now else None


def _owed_message(now: float, clock: str, grace: float) -> Callable[[Record], Transition]:
    """Claim a message the job is owed (outbox entry past due, or a held job now due), so
    that one sweeper publishes it; the claim pushes the outbox deadline one grace ahead."""

    def rule(record: Record) -> Transition:
        job = record.job
        if job.state in lifecycle.TERMINAL or job.state == "active":
            return lifecycle.rejected("not_owed")
        if clock == "promote":
            if record.promote_at is None or record.promote_at > now:
                return lifecycle.rejected("not_due")
        elif record.dispatch_due is None or record.dispatch_due > now:
            return lifecycle.rejected("not_due")
        new = record.copy()
        eta = _eta_of(job, now)
        new.promote_at = None
        new.dispatch_due = now + grace + max((eta or now) - now, 0.0)
        return Transition(new, publish=Publish(job.id, new.token, eta))

    return rule


def sweep(runtime: Runtime, now: float | None = None, batch: int | None = None) -> SweepReport:
    """One enforcement pass. Store or broker trouble is logged and ends the pass early; what
    was not done is still due, so the next pass does it."""
    at = time.time() if now is None else now
    limit = batch or runtime.settings.sweep_batch
    report = SweepReport(started=at)
    # Outbox entries this process has published are cleared before the pass reads the outbox
    # (else it would publish them again), and the pass's own are cleared when it returns.
    runtime.acks.flush()
    try:
        _sweep(runtime, at, limit, report)
        runtime.store.set_meta(LAST_SWEEP_KEY, repr(at))
    except (StoreError, BrokerUnavailable) as exc:
        report.error = str(exc)
        logger.warning("ojs_celery: sweep skipped, will retry next interval: %s", exc)
    finally:
        runtime.acks.flush()
    return report


def _sweep(runtime: Runtime, now: float, limit: int, report: SweepReport) -> None:
    store = runtime.store
    settings = runtime.settings
    rules: list[tuple[str, float, Callable[[Record], Transition]]] = [
        ("total", now, lambda r: lifecycle.expire_total(r, now, store.policy)),
        ("enqueue_ttl", now, lambda r: lifecycle.expire_ttl(r, now, store.policy)),
        ("execution", now - settings.execution_tolerance,
         _execution_overdue(now, settings.execution_tolerance)),
        ("stall", now, _stalled(now)),
        ("visibility", now, _invisible(now)),
    ]
    for clock, cutoff, rule in rules:
        _enforce(runtime, clock, store.due(clock, cutoff, limit), rule, report)
    _bury_dead_workers(runtime, now, limit, report)
    for clock in ("dispatch", "promote"):
        owed = _owed_message(now, clock, settings.dispatch_grace)
        _enforce(runtime, clock, store.due(clock, now, limit), owed, report)
    report.pruned = store.prune(now, limit)


def _enforce(
    runtime: Runtime,
    clock: str,
    due: list[tuple[str, float]],
    rule: Callable[[Record], Transition],
    report: SweepReport,
) -> None:
    """Apply ``rule`` to the jobs due on ``clock`` and act on every transition that applied:
    emit its events, stop the attempt it took the job from, publish what it owes.

    A store or broker error does not stop the acting on transitions already written (their
    events are emitted; a message that could not be published stays in the outbox); it is
    raised at the end, and what was not written is still due next pass.
    """
    store = runtime.store
    job_ids = [job_id for job_id, _ in due]
    if not job_ids:
        return
    failure: StoreError | BrokerUnavailable | None = None
    for job_id, done in zip(job_ids, store.apply_many(job_ids, rule), strict=True):
        if done is None:  # lost a race: decide again on fresh data
            if failure is not None:
                continue
            try:
                done = store.apply(job_id, rule)
            except StoreError as exc:
                failure = exc
                continue
        if done.record is None:
            continue
        report.applied[clock] += 1
        try:
            report.published += carry_out(runtime, done, stop_attempt=True,
                                          publish_message=failure is None,
                                          raise_unpublished=True)
        except BrokerUnavailable as exc:
            failure = exc
    if failure is not None:
        raise failure


def _bury_dead_workers(runtime: Runtime, now: float, limit: int, report: SweepReport) -> None:
    """Workers silent for the worker heartbeat timeout: remove them, recover their jobs."""
    store = runtime.store
    cutoff = now - runtime.settings.worker_heartbeat_timeout
    for worker_id in store.stale_workers(cutoff, limit):
        info = store.get_worker(worker_id)
        if info is None or info.last_beat > cutoff or not store.deregister_worker(worker_id):
            continue  # it beat meanwhile, or another sweeper took it
        report.applied["worker"] += 1
        logger.warning("ojs_celery: worker %s (%s) missed its beats for %.1fs: declared dead",
                       worker_id, info.nodename or info.hostname, now - info.last_beat)
        runtime.bus.emit("worker.stopped", {
            "worker_id": worker_id, "reason": "error", "detail": "missed heartbeats",
            "active_jobs": len(info.active_job_ids),
        }, subject=worker_id)
        for job_id in info.active_job_ids:
            done = store.apply(job_id, _orphaned(worker_id, now))
            report.published += carry_out(runtime, done, raise_unpublished=True)
        for job_id in info.reserved_job_ids:
            done = store.apply(job_id, _redispatch(now, runtime.settings.dispatch_grace))
            report.published += carry_out(runtime, done, raise_unpublished=True)


def last_sweep(runtime: Runtime) -> float | None:
    value = runtime.store.get_meta(LAST_SWEEP_KEY)
    return float(value) if value else None


def run_loop(runtime: Runtime, interval: float | None = None,
             stop: Callable[[], bool] = lambda: False) -> None:
    """``ojs-celery sweep --loop``: a pass every ``interval`` seconds until ``stop()``."""
    every = interval or runtime.settings.sweep_interval
    while not stop():
        began = time.monotonic()
        report = sweep(runtime)
        if report.total:
            logger.info("ojs_celery: sweep %s", _summary(report))
        time.sleep(max(every - (time.monotonic() - began), 0.0))


def _summary(report: SweepReport) -> dict[str, JsonValue]:
    return {**dict(report.applied), "published": report.published, "pruned": report.pruned}
