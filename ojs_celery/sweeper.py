"""The sweeper: server-side enforcement of every deadline, from the store's indexes.

One pass takes what is due on each clock of :data:`ojs_celery.lifecycle.SWEEP`, in its order
(``store.due``, O(log n + k)), applies the clock's transition with compare-and-set, and carries
it out (:func:`~ojs_celery.effects.carry_out`: events, terminating a running attempt that lost
its job, publishing what is owed). The rules and deadlines live in :mod:`ojs_celery.lifecycle`:
this module only orchestrates. Only the process whose compare-and-set won acts, so any number
of sweepers may run at once. The jobs due on one clock are read in one batch and written in
one batch (``store.apply_many``); a job whose write lost a race goes through ``store.apply``
alone, which re-reads it. Each pass also checks that a Redis broker still holds its data
(:func:`_check_broker`). The Celery task, the beat entry and ``ojs-celery sweep --loop`` are
thin shells around :func:`sweep`.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from . import handback, lifecycle
from .broker_mark import Unreachable
from .effects import carry_out
from .entropy import random_hex
from .envelope import JsonValue
from .faults import AtMostEvery, OncePerKind
from .lifecycle import BlindSpell, Clock, Heard, Rule, WorkerClock
from .producer import BrokerUnavailable
from .runtime import Runtime, UnknownType
from .store import BrokerMark, StoreError, StoreMisconfigured, WorkerInfo

logger = logging.getLogger(__name__)

SWEEP_TASK = "ojs_celery.sweep"
#: The longest pause of the sweep loop after failed passes.
MAX_BACKOFF = 30.0


@dataclass
class SweepReport:
    """What one pass did, per clock; ``error`` is set when the pass was skipped."""

    started: float
    applied: Counter[str] = field(default_factory=Counter)
    published: int = 0
    pruned: int = 0
    #: Jobs passed over because of an error of their own (see ``_skip``).
    skipped: int = 0
    #: Attempts past their execution deadline whose worker fell silent before it: left for the
    #: worker clock to end as ``worker_death`` once the worker is declared dead.
    awaiting: int = 0
    error: str | None = None

    @property
    def total(self) -> int:
        return sum(self.applied.values()) + self.published + self.pruned + self.skipped

    def as_dict(self) -> dict[str, JsonValue]:
        """The report as the Celery task returns it, the CLI prints it and the loop logs it."""
        applied: dict[str, JsonValue] = dict(self.applied)
        return {"applied": applied, "published": self.published, "pruned": self.pruned,
                "skipped": self.skipped, "awaiting": self.awaiting, "error": self.error}


def sweep_faults() -> OncePerKind:
    """How a sweeping loop logs an unexpected error: at ERROR, with its traceback the first time
    its kind is seen, in one line after (a loop failing every pass does not flood the log, and a
    new kind of failure is still shown whole)."""
    return OncePerKind(logger, "sweep", level=logging.ERROR, again_level=logging.ERROR)


def sweep(
    runtime: Runtime,
    now: float | None = None,
    batch: int | None = None,
    *,
    faults: OncePerKind | None = None,
    interval: float | None = None,
) -> SweepReport:
    """One enforcement pass. Store or broker trouble is logged and ends the pass early; so
    does any other error (logged through ``faults``, with its traceback the first time). What
    was not done is still due, so the next pass does it. ``error`` in the report says why the
    pass ended early. It raises only :class:`~ojs_celery.store.StoreMisconfigured`, which no
    later pass can mend (a loop would retry it for ever). ``interval``: the seconds until the
    next pass (a loop's own; default ``sweep_interval``), which the pruning may take."""
    at = time.time() if now is None else now
    report = SweepReport(started=at)
    try:
        limit = batch or runtime.settings.sweep_batch
        # Outbox entries this process has published are cleared before the pass reads the
        # outbox (else it would publish them again), and the pass's own when it returns.
        runtime.acks.flush()
        try:
            _sweep(runtime, at, limit, report,
                   interval or runtime.settings.sweep_interval)
            runtime.store.meta.record_sweep(at)
            if faults is not None:
                faults.succeeded()
        finally:
            runtime.acks.flush()
    except StoreMisconfigured:
        raise
    except (StoreError, BrokerUnavailable) as exc:
        report.error = str(exc)
        logger.warning("ojs_celery: sweep skipped, will retry next interval: %s", exc)
    except Exception as exc:  # a bug or an unexpected reply must not end the caller's loop
        report.error = f"{type(exc).__name__}: {exc}"
        (faults or sweep_faults()).failed(exc)
    return report


#: Errors that are an outage of the store or the broker, never one job's fault: they end the
#: pass (what was not done is still due) and count against no job.
OUTAGES = (StoreError, BrokerUnavailable)


def _sweep(runtime: Runtime, now: float, limit: int, report: SweepReport,
           interval: float) -> None:
    spell = _blind_spell(runtime)
    for clock in lifecycle.SWEEP:
        if isinstance(clock, WorkerClock):
            _bury_dead_workers(runtime, clock, now, limit, report, spell)
        elif clock.when_due is None:  # retention: what is due is deleted, not changed
            try:
                _prune(runtime, now, limit, report, interval)
            except OUTAGES:
                raise
            except Exception as exc:  # unexpected (prune passes unreadable records over)
                logger.warning("ojs_celery: sweep could not prune: %s: %s",
                               type(exc).__name__, exc)
        else:
            _enforce_clock(runtime, clock, now, limit, report, spell)
    # last: a broker that fails the republishing ends the pass after every clock's work
    _check_broker(runtime, limit, report)


def _prune(runtime: Runtime, now: float, limit: int, report: SweepReport,
           interval: float) -> None:
    """Prune in batches of ``limit`` until a batch comes back short, for at most ``interval``
    (the time until the next pass: a loop's ``--interval``, not always ``sweep_interval``):
    every job ends on the retention clock, so one batch per pass (250 jobs/s with the
    defaults) fell behind a worker finishing more than that, and the store grew without bound.
    Each batch is counted in ``report`` as it is done, so that a later batch's error (which
    ends the pruning) does not hide the jobs the earlier ones deleted."""
    budget = time.monotonic() + interval
    while True:
        done = runtime.store.prune(now, limit)
        report.pruned += done
        if done < limit or time.monotonic() >= budget:
            return


#: How many batches' worth of due entries a pass reads past attempts left to the worker clock.
READ_PAST = 10


def _enforce_clock(
    runtime: Runtime, clock: Clock, now: float, limit: int, report: SweepReport,
    spell: BlindSpell | None,
) -> None:
    """The jobs due on ``clock``, at most ``limit`` of them acted on. An attempt the worker
    clock claims (``Clock.defers_to``) stays due and is read past: a node that died with many
    running attempts must not hold back every other job's timeout until it is declared dead.
    So is a job whose rule finds it not due yet (an index entry written under other settings
    or by an older version), whose entry is moved to the deadline its record gives. A pass
    reads at most :data:`READ_PAST` × ``limit`` index entries so (each claimed attempt is
    claimed for twice the worker heartbeat timeout at most)."""
    store = runtime.store
    policy = store.policy
    cutoff = clock.cutoff(now, policy)
    rule: Rule | None = None
    seen: set[str] = set()
    left = limit
    while left > 0 and len(seen) < READ_PAST * limit:
        due = [entry for entry in store.due(clock.name, cutoff, len(seen) + left)
               if entry[0] not in seen][:left]
        if not due:
            return
        if rule is None:  # the registry is read only when something is due, once a pass
            workers = None if clock.defers_to is None else {
                info.worker_id: Heard(info.last_beat, info.time_limits,
                                         info.heartbeat_timeout)
                for info in store.workers.all()}
            rule = clock.rule(now, policy, spell, workers)
        passed = _enforce(runtime, clock.name, due, rule, now, report)
        if not passed:
            return
        seen.update(job_id for job_id, _ in due)
        left -= len(due) - len(passed)


def _enforce(
    runtime: Runtime,
    clock: str,
    due: list[tuple[str, float]],
    rule: Rule,
    now: float,
    report: SweepReport,
) -> set[str]:
    """Apply ``rule`` to the jobs due on ``clock`` and act on every transition that applied:
    emit its events, stop the attempt it took the job from, publish what it owes. Returns the
    jobs to read past: those the rule left to the worker clock
    (:data:`~ojs_celery.lifecycle.AWAITING_WORKER`, counted as ``awaiting``) or found not due.

    A store or broker error does not stop the acting on transitions already written (their
    events are emitted; a message that could not be published stays in the outbox); it is
    raised at the end, and what was not written is still due next pass. Any other error
    concerns one job (its record, its rule, the broker refusing its message): that job is
    skipped (:func:`_skip`) and the others go on.
    """
    store = runtime.store
    job_ids = [job_id for job_id, _ in due]
    passed: set[str] = set()
    if not job_ids:
        return passed
    try:
        results = store.apply_many(job_ids, rule)
    except OUTAGES:
        raise
    except Exception:  # one job spoils the batch: go job by job to find it
        results = [None] * len(job_ids)
    missing = [job_id for job_id, done in zip(job_ids, results, strict=True)
               if done is not None and done.reason == "unknown_job"]
    if missing:  # index entries a write that failed half way left behind
        forgotten = store.forget_missing(clock, missing)
        if forgotten:
            logger.warning("ojs_celery: sweep took %d id(s) of jobs that do not exist out of "
                           "the %s index", forgotten, clock)
    failure: StoreError | BrokerUnavailable | None = None
    read_at = dict(due)
    later: list[tuple[str, float, float]] = []  # index entries to move to their deadline
    for job_id, done in zip(job_ids, results, strict=True):
        if done is None:  # lost a race, or the batch failed: decide again on fresh data
            if failure is not None:
                continue
            try:
                done = store.apply(job_id, rule)
            except StoreError as exc:
                failure = exc
                continue
            except Exception as exc:
                failure = _skip(runtime, clock, job_id, exc, now, report)
                continue
        if done.record is None:
            if done.reason == lifecycle.AWAITING_WORKER:
                passed.add(job_id)
                report.awaiting += 1
            elif done.reason == lifecycle.NOT_DUE:
                passed.add(job_id)
                deadline = None if done.previous is None else \
                    lifecycle.BY_NAME[clock].deadline(done.previous, store.policy)
                if deadline is not None and deadline > read_at[job_id]:
                    later.append((job_id, read_at[job_id], deadline))
            continue
        report.applied[clock] += 1
        try:
            report.published += carry_out(runtime, done, stop_attempt=True,
                                          publish_message=failure is None,
                                          raise_unpublished=True, report_result=True)
        except BrokerUnavailable as exc:
            failure = exc
        except Exception as exc:  # the broker refused this job's message
            failure = _skip(runtime, clock, job_id, exc, now, report) or failure
    if later and failure is None:
        store.move_due(clock, later)
    if failure is not None:
        raise failure
    return passed


def _skip(
    runtime: Runtime, clock: str, job_id: str, exc: Exception, now: float, report: SweepReport
) -> StoreError | None:
    """Job ``job_id`` could not be moved on ``clock`` for a reason of its own: log it, count it
    in its record (:func:`ojs_celery.lifecycle.dispatch_failed`: discarded after
    ``dispatch_failure_limit`` sweeps in a row) and go on. Returns the store error that kept
    the count from being written, if any (an outage: the pass ends)."""
    reason = f"{type(exc).__name__}: {exc}"
    report.skipped += 1
    if isinstance(exc, UnknownType):
        _unpublishable(job_id, exc)
        return None
    logger.warning("ojs_celery: sweep skipped job %s (%s clock): %s", job_id, clock, reason)
    store = runtime.store
    policy = store.policy
    try:
        done = store.apply(job_id, lambda r: lifecycle.dispatch_failed(r, reason, now, policy))
    except StoreError as error:
        return error
    except Exception as error:  # its record cannot be read: it stays skipped, pass after pass
        logger.warning("ojs_celery: could not count the failure of job %s: %s: %s",
                       job_id, type(error).__name__, error)
        return None
    if done.record is not None and done.record.job.state == "discarded":
        report.applied[lifecycle.DISPATCH_FAILED] += 1
        carry_out(runtime, done, stop_attempt=True, report_result=True)
    return None


#: Each type this process cannot publish is said every ten minutes at most (``_unpublishable``).
_unknown_types: dict[str, AtMostEvery] = {}


def _unpublishable(job_id: str, exc: UnknownType) -> None:
    """A job whose type this process does not register (a sweeper still on the code before
    the task was added, in a rolling deploy): not the job's fault, so it is not counted
    towards ``dispatch_failed``; it stays owed, for a sweeper that registers the task."""
    said = _unknown_types.setdefault(str(exc), AtMostEvery(600.0))
    if said.due(time.monotonic()):
        logger.warning("ojs_celery: sweep cannot publish job %s (and others of its type): %s. "
                       "This process does not register the task: it stays owed, for a "
                       "sweeper that does (deploy the sweep worker with the app's tasks)",
                       job_id, exc)


#: A blind spell ahead of this host's clock is said every ten minutes at most (``_blind_spell``).
_future_spell = AtMostEvery(600.0)


def _blind_spell(runtime: Runtime) -> BlindSpell | None:
    """Record this pass's contact with the store; the last blind spell, unless it ends ahead of
    this host's clock (a sweeper whose clock is ahead recorded it): such a spell would keep
    every worker and job from being judged for as long as that clock is ahead, so it is left
    out, and said every ten minutes at most."""
    settings = runtime.settings
    spell = runtime.store.meta.record_contact(None, settings.blind_after)
    wall = time.time()
    if spell is None or spell.end <= wall + settings.blind_after:
        return spell
    if _future_spell.due(time.monotonic()):
        logger.warning("ojs_celery: a blind spell recorded by another sweeper ends %.1fs ahead "
                       "of this host's clock: left out (are the hosts' clocks in step?)",
                       spell.end - wall)
    return None


def _bury_dead_workers(
    runtime: Runtime, clock: WorkerClock, now: float, limit: int, report: SweepReport,
    spell: BlindSpell | None = None,
) -> None:
    """Workers silent for the worker heartbeat timeout: declare them dead, recover their jobs,
    at most ``limit`` of them, and resume at most ``limit`` burials besides: the tombstones,
    which come first, may be kept as long as a put-back fails (ten minutes), and must not hold
    back the burial of the workers that die meanwhile. Silence during a blind spell does not
    count (see :class:`~ojs_celery.lifecycle.BlindSpell`): a worker silent since before it is
    declared dead that much later. Workers silent for this process's timeout but not their
    own longer one are read past, up to :data:`READ_PAST` × ``limit``: they must not hide dead
    ones.

    A burial is resumable. The sweeper that declares a worker dead first turns its record
    into a tombstone (``store.bury_worker``: the claim, which one sweeper wins, so the
    ``worker.stopped`` event and the warning are said once), then recovers the jobs its beats
    listed, those it started after its last beat (:func:`_recover_unlisted`) and the messages
    it received since (:func:`_put_back_unlisted`), and removes the tombstone last. The store
    failing on the way ends the pass; ``stale`` returns the tombstone first to the next pass,
    this sweeper's or another's, which recovers the jobs again with the rules of the worker's
    death (computed at ``buried_at``): compare-and-set rules that change nothing the second
    time (an attempt failed already, or started since; a message sent since), so only what
    was not recovered is. A put-back the broker or the store failed keeps the tombstone too,
    so that the next pass, any sweeper's, tries it again (until :data:`PUT_BACK_TRIES` after
    the last beat). A broker that fails a recovery's publish does not stop the others (each
    is written, its message left in the outbox for the dispatch clock), and is raised at the
    end, once the burials are done."""
    store = runtime.store
    policy = store.policy
    cutoff = clock.cutoff(now, policy)
    buried: dict[str, WorkerInfo] = {}
    unpublished: BrokerUnavailable | None = None
    resumed = declared = 0
    for worker_id in store.workers.stale(cutoff, READ_PAST * limit):
        if declared >= limit:
            break
        info = store.workers.get(worker_id)
        if info is None:
            continue
        if info.buried:  # a burial a failing store or put-back interrupted: resumed
            if resumed >= limit:
                continue
            resumed += 1
            marker = runtime.broker_marker  # a failing put-back resumes it at every pass
            logger.log(logging.DEBUG if marker and marker.put_back_failing else logging.INFO,
                       "ojs_celery: resuming the burial of worker %s, declared dead %.1fs ago",
                       worker_id, now - (info.buried_at or now))
        else:
            if not clock.is_dead(info.last_beat, now, policy, spell, info.heartbeat_timeout):
                continue  # it beat meanwhile, its own timeout is longer, or a blind spell
            tombstone = store.bury_worker(info, now)
            if tombstone is None:
                continue  # another sweeper took it
            info = tombstone
            declared += 1
            report.applied[clock.name] += 1
            logger.warning("ojs_celery: worker %s (%s) missed its beats for %.1fs: declared "
                           "dead", worker_id, info.nodename or info.hostname,
                           now - info.last_beat)
            runtime.bus.emit("worker.stopped", {
                "worker_id": worker_id, "reason": "error", "detail": "missed heartbeats",
                "active_jobs": len(info.active_job_ids),
            }, subject=worker_id)
        buried[worker_id] = info
        unpublished = _recover_listed(runtime, clock, info, now, report, unpublished)
    if not buried:
        marker = runtime.broker_marker
        if marker is not None and marker.put_back_failing:
            # no burial owes a put-back any more (another sweeper did it, or it was left to
            # kombu past its tries): a later one that fails is another failure, said again
            marker.put_back_failing = False
            logger.debug("ojs_celery: no put-back of dead workers' messages is owed any more")
        return
    # the put-back first: it never raises, and the pass may end in the other
    owed = _put_back_unlisted(runtime, clock, list(buried.values()), now, limit, report, spell)
    unpublished = _recover_unlisted(runtime, clock, buried, limit, report, unpublished)
    for worker_id, info in buried.items():  # the drain marks the active jobs
        if worker_id not in owed:
            store.remove_worker(worker_id, info.active_job_ids, buried=True)
    if unpublished is not None:
        raise unpublished


def _recover_listed(
    runtime: Runtime, clock: WorkerClock, tombstone: WorkerInfo, now: float,
    report: SweepReport, unpublished: BrokerUnavailable | None,
) -> BrokerUnavailable | None:
    """The jobs a dead worker's last beat listed, running or held, recovered with the rules of
    its death (at ``buried_at``). Returns the broker's failure, if any: the recoveries after
    it are written with their messages left in the outbox. Raises a store outage."""
    store = runtime.store
    policy = store.policy
    since = tombstone.buried_at
    assert since is not None
    recoveries = [(job_id, clock.active_rule(tombstone.worker_id, since, policy))
                  for job_id in tombstone.active_job_ids]
    recoveries += [(job_id, clock.reserved_rule(since, policy))
                   for job_id in tombstone.reserved_job_ids]
    for job_id, rule in recoveries:
        try:
            done = store.apply(job_id, rule)
            report.published += carry_out(runtime, done, publish_message=unpublished is None,
                                          raise_unpublished=True, report_result=True)
        except BrokerUnavailable as exc:  # written: its message waits in the outbox, and
            unpublished = unpublished or exc  # so do the rest's (the worker is gone)
        except OUTAGES:
            raise
        except Exception as exc:
            failure = _skip(runtime, clock.name, job_id, exc, now, report)
            if failure is not None:
                raise failure from exc
    return unpublished


#: Counted in ``SweepReport.applied``: messages published again because the broker lost them.
BROKER_LOST = "broker_lost"
#: How far past its own clock a sweeper counts a message as sent before a loss: a job's last
#: publish is stamped by the producer's or a worker's clock, which may run ahead of the
#: sweeper's by the few seconds the README's clock-skew section tolerates; a message sent
#: after the loss and taken for lost only costs a copy, which fencing drops.
LOSS_SKEW = 30.0


def _check_broker(runtime: Runtime, limit: int, report: SweepReport) -> None:
    """Notice that the broker lost its data, and republish what waited on it.

    A Redis broker restarted without persistence, flushed, or failed over to an empty replica
    loses every queued message, while their jobs wait ``available`` in the store, their
    messages sent, until the ``redispatch_after`` backstop (an hour). So the sweepers keep a
    random mark in the broker (:mod:`ojs_celery.broker_mark`) and in the store
    (``MetaArea.broker_mark``). The broker holds the store's mark: nothing was lost. It holds
    none: it lost its data (or this is the first check), and the sweeper that sets a new mark
    there (``SET NX``: one among those that saw none) records it in the store, with the time
    after it set it: every job still waiting for a message published before then is owed that
    message (:func:`~ojs_celery.lifecycle.resend_lost`), ``limit`` jobs a pass, through a scan
    of the redispatch clock's index whose cursor the store keeps. It holds another mark: a
    sweeper set it after a loss and has not recorded it yet (or stopped before), so it is
    recorded here, with the loss, by whichever sweeper's compare-and-set wins. The time is
    taken once the mark is in place, so a loss during the check is seen at the next pass;
    a copy that meets a message that survived is dropped by fencing. A store without a mark
    (first run, a store that lost its data too) takes the broker's, and republishes nothing.
    Not reaching the broker skips the check (said once), and the next pass checks again."""
    marker = runtime.broker_marker
    if marker is None:
        return
    meta = runtime.store.meta
    known = meta.broker_mark()
    try:
        held = marker.read()
        if held is None:
            new = random_hex(16)
            if not marker.claim(new):
                return  # another sweeper marked it first: recorded at the next pass
            held = new
    except Unreachable as exc:
        if not marker.failing:
            marker.failing = True
            logger.warning("ojs_celery: could not check whether the broker lost its data "
                           "(checked again next pass): %s", exc)
        return
    if marker.failing:
        marker.failing = False
        logger.info("ojs_celery: the broker answers the check of its data again")
    if known is None:
        meta.swap_broker_mark(None, BrokerMark(held))
        return
    lost = held != known.mark
    if lost:
        known = meta.swap_broker_mark(
            known, BrokerMark(held, lost_before=time.time() + LOSS_SKEW))
        if known is None:
            return  # another sweeper recorded it: it republishes from its next pass
    if known.republishing:
        _republish_lost(runtime, known, limit, report, marker.where() if lost else None)


def _republish_lost(runtime: Runtime, known: BrokerMark, limit: int, report: SweepReport,
                    detected: str | None) -> None:
    """One pass's share of the jobs waiting for a message when the broker lost its data:
    about ``limit`` ids of the redispatch index from the scan's cursor, each owed its message
    unless published since; the cursor moves on by compare-and-set (a sweeper that lost that
    race may have sent some of the same messages once more, copies that fencing drops)."""
    store = runtime.store
    clock = lifecycle.REDISPATCH.name
    assert known.lost_before is not None
    rule = partial(lifecycle.resend_lost, now=time.time(), policy=store.policy,
                   lost_before=known.lost_before)
    cursor, read, done = known.cursor, 0, 0
    for _ in range(READ_PAST):  # a Redis scan's page may come back short, or empty
        ids, cursor = store.scan(clock, cursor, limit - read)
        before = report.applied[clock]
        _enforce(runtime, clock, [(job_id, 0.0) for job_id in ids], rule, time.time(), report)
        done += report.applied[clock] - before
        read += len(ids)
        if cursor is None or read >= limit:
            break
    if done:  # counted as this loss's, not as the backstop's
        report.applied[clock] -= done
        report.applied[BROKER_LOST] += done
        if not report.applied[clock]:
            del report.applied[clock]
    total = known.republished + done
    after = BrokerMark(known.mark, None if cursor is None else known.lost_before, cursor, total)
    if store.meta.swap_broker_mark(known, after) is None:
        return  # another sweeper moved the scan on: it says what happened
    if detected is not None:
        logger.warning("ojs_celery: the broker %s lost its data (restarted without persistence, "
                       "flushed, or failed over): %s the messages of %d job(s) waiting on it%s",
                       detected, "republished" if cursor is None else "republishing", total,
                       "" if cursor is None else f" so far, up to {limit} a pass")
    elif cursor is None:
        logger.warning("ojs_celery: republished the messages of %d job(s) in all that were "
                       "waiting on the broker when it lost its data", total)


def _recover_unlisted(
    runtime: Runtime, clock: WorkerClock, buried: dict[str, WorkerInfo], limit: int,
    report: SweepReport, unpublished: BrokerUnavailable | None,
) -> BrokerUnavailable | None:
    """The attempts that workers just declared dead (``buried``: their tombstones) started
    after their last beat, which no beat listed: found among the active jobs (the visibility
    clock's index holds every one, the ``limit`` nearest their deadline), so that they too fail
    with ``worker_death`` now rather than stall a ``heartbeat_timeout`` later. A broker that
    fails a publish does not stop the others (see :func:`_recover_listed`)."""
    store = runtime.store
    rule = clock.orphans_rule({worker_id: info.buried_at for worker_id, info in buried.items()
                               if info.buried_at is not None}, store.policy)
    active = [job_id for job_id, _ in store.due(lifecycle.VISIBILITY.name, math.inf, limit)]
    if not active:
        return unpublished
    try:
        results = store.apply_many(active, rule)
    except OUTAGES:
        raise
    except Exception:  # one record spoils the batch: go job by job
        results = [None] * len(active)
    for job_id, done in zip(active, results, strict=True):
        try:
            if done is None:  # lost a race, or the batch failed: decide again on fresh data
                done = store.apply(job_id, rule)
            if done.record is not None:
                report.published += carry_out(runtime, done,
                                              publish_message=unpublished is None,
                                              raise_unpublished=True, report_result=True)
        except BrokerUnavailable as exc:  # written: its message waits in the outbox
            unpublished = unpublished or exc
        except OUTAGES:
            raise
        except Exception as exc:  # not known to be a dead worker's: counted against nothing
            report.skipped += 1
            logger.warning("ojs_celery: sweep could not check active job %s for a dead "
                           "worker: %s: %s", job_id, type(exc).__name__, exc)
    return unpublished


#: Counted in ``SweepReport.applied``: messages dead workers received after their last beat,
#: put back in their queue (see :func:`_put_back_unlisted`).
PUT_BACK = "put_back"
#: How long after a dead worker's last beat the put-back of its messages is tried again, pass
#: after pass, while the broker or the store fails it.
PUT_BACK_TRIES = 600.0
#: How long around a beat a message a worker received may still be unlisted (a beat lists what
#: the worker holds, then stamps its time).
LISTING_LAG = 1.0


def _put_back_unlisted(runtime: Runtime, clock: WorkerClock, buried: list[WorkerInfo],
                       now: float, limit: int, report: SweepReport,
                       spell: BlindSpell | None) -> set[str]:
    """The messages the workers just declared dead (or whose burial this pass resumed: the pass
    that began it, or its put-back, may have failed) received after their last beat, which no
    beat listed: on a Redis broker kombu keeps them for ``visibility_timeout`` (an hour) while
    their jobs wait. kombu stamps a delivery with the receiving host's clock, as the worker
    stamps its beats, so each dead worker's are among those delivered since its last beat (up to
    :data:`READ_PAST` × ``limit``, oldest first) and before every live worker's last beat (a
    live worker lists what it received before it). Those that no worker lists as held (nor a
    live one as running), whose job still waits for that very message and that kombu can route
    (the app's exchanges, which this channel never declared, are made known to it) go back to
    their queue (:mod:`ojs_celery.handback`). A message put back that a worker does hold (a
    frozen one declared dead) only costs a copy, which fencing drops. A failure of the broker or
    the store is logged, and the ids of the workers whose put-back is still owed are returned:
    their tombstones stay for the next pass, until :data:`PUT_BACK_TRIES` after their last beat;
    then kombu's ``visibility_timeout`` restores their messages."""
    marker = runtime.broker_marker
    if marker is None:  # RabbitMQ redelivers what a closed connection held
        return set()
    store = runtime.store
    try:  # the registered workers, but the tombstones (the dead ones being buried)
        workers = [info for info in store.workers.all() if not info.buried]
        # what a live worker holds, and what the dead ones held (republished from the store
        # just now); not what they ran: a retry's message received after the beat that
        # listed the attempt is owed if the record waits for its token (checked below)
        listed = {job_id for info in workers
                  for job_id in [*info.active_job_ids, *info.reserved_job_ids]}
        listed.update(job_id for info in buried for job_id in info.reserved_job_ids)
        live = [info.last_beat for info in workers
                if not clock.is_dead(info.last_beat, now, store.policy, spell,
                                     info.heartbeat_timeout)]
        until = min([time.time(), *live]) - LISTING_LAG
        channel = marker.channel()
        handback.learn_exchanges(channel, runtime.app)
        tags: dict[str, None] = {}  # each message's body is read once
        for info in buried:
            tags.update(dict.fromkeys(handback.recorded_between(
                channel, info.last_beat - LISTING_LAG, until, READ_PAST * limit)))
        unlisted = [delivery for delivery in handback.deliveries(channel, list(tags))
                    if delivery.job_id not in listed]
        records = store.get_records([delivery.job_id for delivery in unlisted])
        owed = [delivery for delivery, record in zip(unlisted, records, strict=True)
                if record is not None and record.token == delivery.token
                and record.job.state in lifecycle.STARTABLE
                and handback.routable(channel, delivery)]
        put = set(handback.put_back(channel, [delivery.tag for delivery in owed])
                  if owed else ())
    except Exception as exc:  # the broker or the store failed: tried again next pass
        logger.log(logging.DEBUG if marker.put_back_failing else logging.WARNING,
                   "ojs_celery: could not put back the messages that workers declared dead "
                   "received after their last beat (tried again at each pass, for %gs after "
                   "their last beat; then kombu restores them after the broker's "
                   "visibility_timeout): %s: %s", PUT_BACK_TRIES, type(exc).__name__, exc)
        marker.put_back_failing = True
        return {info.worker_id for info in buried if info.last_beat > now - PUT_BACK_TRIES}
    if marker.put_back_failing:
        marker.put_back_failing = False
        logger.warning("ojs_celery: the put-back of dead workers' messages works again")
    if put:
        report.applied[PUT_BACK] += len(put)
        logger.warning("ojs_celery: put back in their queue %d OJS message(s) that workers "
                       "declared dead received after their last beat: jobs %s", len(put),
                       handback.named([d.job_id for d in owed if d.tag in put]))
    return set()


def last_sweep(runtime: Runtime) -> float | None:
    return runtime.store.meta.last_sweep()


def run_loop(runtime: Runtime, interval: float | None = None,
             stop: Callable[[], bool] = lambda: False,
             pause: Callable[[float], object] = time.sleep) -> None:
    """``ojs-celery sweep --loop``: a pass every ``interval`` seconds until ``stop()``, which
    is asked before each pass (a pass under way is finished). ``pause`` waits between passes:
    a stop event's ``wait`` ends the wait as soon as the event is set.

    No error ends it but a misconfigured store (see :func:`sweep`): after a failed pass it
    waits twice as long as after the one before (from ``interval`` up to :data:`MAX_BACKOFF`),
    and back to ``interval`` after a pass that worked."""
    every = interval or runtime.settings.sweep_interval
    faults = sweep_faults()
    failures = 0
    while not stop():
        began = time.monotonic()
        report = sweep(runtime, faults=faults, interval=every)
        if report.error is None:
            failures = 0
            if report.total:
                logger.info("ojs_celery: sweep %s", report.as_dict())
        else:
            failures += 1
        wait = every if not failures else min(every * 2 ** failures, max(MAX_BACKOFF, every))
        pause(max(wait - (time.monotonic() - began), 0.0))
