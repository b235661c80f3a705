"""The sweep pass against real stores (SQLite and Redis) and a real broker folder, with
explicit clocks: what is due is enforced once, whoever sweeps."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import multiprocessing
import pathlib
import threading
import time
import types
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from ojs_celery import enqueue
from ojs_celery import sweeper as sweeper_module
from ojs_celery.envelope import parse_envelope
from ojs_celery.faults import AtMostEvery
from ojs_celery.lifecycle import BlindSpell
from ojs_celery.runtime import Runtime, get_runtime
from ojs_celery.store import StoreError
from ojs_celery.store.workers import WorkerInfo
from ojs_celery.sweeper import READ_PAST, last_sweep, run_loop, sweep
from tests.conftest import messages, store_app
from tests.e2eapp import make_app
from tests.test_store_contract import corrupt_record


def runtime_of(app: Celery) -> Runtime:
    return get_runtime(app)


def test_enqueue_ttl_expires_a_job_nobody_started(app: Celery, seen: Counter[str]) -> None:
    job = enqueue({"type": "e2e.add", "args": [1, 2], "enqueue_ttl": 5}, app=app)
    created = job.created_at.timestamp()  # type: ignore[union-attr]
    assert sweep(runtime_of(app), now=created + 4).total == 0

    report = sweep(runtime_of(app), now=created + 5.5)
    assert report.applied["enqueue_ttl"] == 1
    stored = runtime_of(app).store.get(job.id)
    assert stored is not None and stored.state == "discarded"
    assert stored.error == {"type": "enqueue_ttl_expired", "code": "HANDLER_TIMEOUT",
                            "message": stored.error["message"], "timeout_kind": "enqueue_ttl",
                            "limit_seconds": 5, "elapsed_seconds": 5.5}
    assert seen["job.ttl_expired"] == 1 and seen["job.discarded"] == 1


def test_the_report_as_a_dict_is_what_the_task_returns_and_the_cli_prints(app: Celery) -> None:
    job = enqueue({"type": "e2e.add", "args": [1, 2], "enqueue_ttl": 5}, app=app)
    created = job.created_at.timestamp()  # type: ignore[union-attr]
    report = sweep(runtime_of(app), now=created + 6)
    assert report.as_dict() == {"applied": {"enqueue_ttl": 1}, "published": 0, "pruned": 0,
                                "skipped": 0, "awaiting": 0, "error": None}
    task = app.tasks["ojs_celery.sweep"]
    assert task() == {"applied": {}, "published": 0, "pruned": 0, "skipped": 0, "awaiting": 0,
                      "error": None}


def test_scheduled_job_counts_its_ttl_from_created_at(app: Celery) -> None:
    later = time.time() + 3600
    job = enqueue({"type": "e2e.add", "args": [1, 2], "enqueue_ttl": 10,
                   "scheduled_at": _rfc3339(later)}, app=app)
    assert job.state == "scheduled"
    sweep(runtime_of(app), now=job.created_at.timestamp() + 11)  # type: ignore[union-attr]
    stored = runtime_of(app).store.get(job.id)
    assert stored is not None and stored.error is not None
    assert stored.state == "discarded" and stored.error["type"] == "enqueue_ttl_expired"


def test_total_timeout_discards_whatever_the_state(app: Celery, seen: Counter[str]) -> None:
    store = runtime_of(app).store
    job = enqueue({"type": "e2e.add", "args": [1, 2], "total_timeout": 30, "timeout": 10},
                  app=app)
    created = job.created_at.timestamp()  # type: ignore[union-attr]
    started = store.start(job.id, 1, "worker_a", now=created + 1)
    assert started.record is not None and started.record.job.state == "active"

    report = sweep(runtime_of(app), now=created + 31)
    assert report.applied["total"] == 1
    stored = store.get(job.id)
    assert stored is not None and stored.state == "discarded"
    assert stored.error is not None and stored.error["type"] == "total_timeout"
    late = store.complete(job.id, 1, "worker_a", 3, now=created + 32)
    assert not late.applied  # the running attempt's late result is rejected
    assert seen["job.total_timeout"] == 1


def test_execution_timeout_is_enforced_after_grace_and_tolerance(
    app: Celery, seen: Counter[str]
) -> None:
    store = runtime_of(app).store
    job = enqueue({"type": "e2e.add", "args": [1, 2], "timeout": 10, "grace_period": 5,
                   "retry": {"max_attempts": 3, "initial_interval": "PT1S", "jitter": False}},
                  app=app)
    start = time.time()
    store.start(job.id, 1, "worker_a", now=start)
    before = len(messages(app))
    assert sweep(runtime_of(app), now=start + 16).applied["execution"] == 0  # tolerance 1.5 s

    report = sweep(runtime_of(app), now=start + 16.6)
    assert report.applied["execution"] == 1
    stored = store.get_record(job.id)
    assert stored is not None and stored.job.state == "retryable" and stored.token == 2
    error = stored.job.error
    assert error is not None and error["type"] == "timeout"
    assert error["timeout_kind"] == "execution" and error["limit_seconds"] == 10
    assert len(messages(app)) == before + 1  # the retry was published
    assert stored.dispatch_due is None
    assert seen["job.timeout"] == 1 and seen["job.retrying"] == 1
    assert not store.complete(job.id, 1, "worker_a", 3).applied


def _short_celery_job(app: Celery) -> str:
    """A Celery caller's job, timeout 2 s and grace 2 s (final ``timeout`` under its semantics)."""
    job = runtime_of(app).store.get(app.tasks["e2e.add"].apply_async(
        (1, 2), soft_time_limit=2, time_limit=4).id)
    assert job is not None and (job.timeout, job.grace_period) == (2, 2)
    return job.id


def _register(app: Celery, worker_id: str, last_beat: float, *job_ids: str,
              time_limits: bool = True) -> None:
    runtime_of(app).store.workers.save(WorkerInfo(
        worker_id=worker_id, hostname="h", pid=1, last_beat=last_beat, time_limits=time_limits,
        active_job_ids=list(job_ids)))


def test_an_attempt_whose_worker_fell_silent_before_its_deadline_ends_as_worker_death(
    app: Celery, seen: Counter[str]
) -> None:
    """A worker killed (or frozen) early in a short job: at the execution deadline nobody
    knows yet whether the handler overran or the worker died. Its worker's own hard limit
    would have ended an overrun, so the execution clock leaves the attempt to the worker clock,
    which declares the silent worker dead: ``worker_death``, retried even under Celery's
    semantics, where ``timeout`` would have ended the job."""
    runtime = runtime_of(app)
    store = runtime.store
    dead_after = runtime.settings.worker_heartbeat_timeout
    job_id = _short_celery_job(app)
    start = time.time()
    assert store.start(job_id, 1, "worker_killed", now=start).applied
    _register(app, "worker_killed", start + 0.1, job_id)
    for at in (start + 6, start + dead_after):  # past the deadline and its tolerance
        report = sweep(runtime, now=at)
        assert report.error is None and report.applied["execution"] == 0
        assert report.awaiting == 1
        assert store.get(job_id).state == "active"  # type: ignore[union-attr]
    report = sweep(runtime, now=start + 0.1 + dead_after + 0.5)
    assert report.applied["worker"] == 1 and report.applied["execution"] == 0
    recovered = store.get(job_id)
    assert recovered is not None and recovered.state == "retryable"
    assert [e["type"] for e in recovered.errors] == ["worker_death"]
    assert seen["job.timeout"] == 0


def test_an_attempt_times_out_when_its_worker_could_not_have_ended_it(app: Celery) -> None:
    """``timeout`` as before when the worker clock has no claim: the worker was heard after
    the deadline (alive there: a hung pool process), it runs a pool without time limits (a
    handler there can hold its beats back while it overruns: the sweeper is the only limit),
    it is not registered, or it should have been declared dead long ago (silent for twice the
    worker heartbeat timeout: nothing waits on it for ever)."""
    runtime = runtime_of(app)
    store = runtime.store
    dead_after = runtime.settings.worker_heartbeat_timeout
    start = time.time()
    owners = {"worker_alive": (start + 4.2, True), "worker_solo": (start + 0.1, False),
              "worker_unknown": None, "worker_long_gone": (start - 2 * dead_after, True)}
    jobs = {}
    for worker_id, registered in owners.items():
        jobs[worker_id] = _short_celery_job(app)
        assert store.start(jobs[worker_id], 1, worker_id, now=start).applied
        if registered is not None:
            beat, time_limits = registered
            _register(app, worker_id, beat, jobs[worker_id], time_limits=time_limits)
    report = sweep(runtime, now=start + 6)
    assert report.applied["execution"] == 4 and report.awaiting == 0
    for job_id in jobs.values():
        stored = store.get(job_id)
        assert stored is not None and stored.state == "discarded"
        assert [e["type"] for e in stored.errors] == ["timeout"]


def test_attempts_left_to_the_worker_clock_do_not_hold_back_other_timeouts(
    app: Celery,
) -> None:
    """A node that died with more running attempts than a pass takes (``sweep_batch``): the
    pass reads past them, so another worker's overrunning attempt still times out."""
    runtime = runtime_of(app)
    store = runtime.store
    start = time.time()
    silent = [_short_celery_job(app) for _ in range(3)]
    for job_id in silent:
        assert store.start(job_id, 1, "worker_dead", now=start).applied
    _register(app, "worker_dead", start + 0.1, *silent)
    hung = _short_celery_job(app)
    assert store.start(hung, 1, "worker_alive", now=start + 0.2).applied
    _register(app, "worker_alive", start + 5, hung)
    report = sweep(runtime, now=start + 6, batch=2)
    assert report.applied["execution"] == 1 and report.awaiting == 3
    assert [e["type"] for e in store.get(hung).errors] == ["timeout"]  # type: ignore[union-attr]
    assert [store.get(job_id).state for job_id in silent] == ["active"] * 3  # type: ignore[union-attr]


def test_a_pass_reads_past_at_most_ten_batches_of_attempts_left_to_the_worker_clock(
    app: Celery,
) -> None:
    """Reading past claimed attempts is bounded: a fleet that fell silent at once does not
    make every pass read the whole active set."""
    runtime = runtime_of(app)
    store = runtime.store
    start = time.time()
    silent = [_short_celery_job(app) for _ in range(sweeper_module.READ_PAST * 2 + 5)]
    for job_id in silent:
        assert store.start(job_id, 1, "worker_dead", now=start).applied
    _register(app, "worker_dead", start + 0.1, *silent)
    report = sweep(runtime, now=start + 6, batch=2)
    assert report.awaiting == sweeper_module.READ_PAST * 2 and report.error is None


def test_outbox_publishes_a_message_that_was_never_sent(app: Celery) -> None:
    runtime = runtime_of(app)
    transition = runtime.store.create(parse_envelope({"type": "e2e.add", "args": [1, 2]}))
    assert transition.record is not None  # stored, but "the process died" before publishing
    job_id = transition.record.job.id
    assert messages(app) == []
    assert sweep(runtime, now=time.time() + 1).published == 0  # within the dispatch grace

    report = sweep(runtime, now=time.time() + 11)
    assert report.applied["dispatch"] == 1 and report.published == 1
    assert len(messages(app)) == 1
    record = runtime.store.get_record(job_id)
    assert record is not None and record.dispatch_due is None


def test_a_message_this_process_published_is_not_published_again(app: Celery) -> None:
    """Outbox acknowledgements are deferred to a background thread; a sweep in the same
    process waits for them, so it never republishes what was just published."""
    runtime = runtime_of(app)
    job = enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
    assert len(messages(app)) == 1
    report = sweep(runtime, now=time.time() + 11)
    assert report.applied["dispatch"] == 0 and report.published == 0
    assert len(messages(app)) == 1
    record = runtime.store.get_record(job.id)
    assert record is not None and record.dispatch_due is None


def test_a_broker_fault_mid_pass_keeps_written_transitions_whole(
    app: Celery, seen: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Transitions are written in a batch: when publishing fails, the events of every written
    one are still emitted and its message stays owed (the outbox), for the next pass."""
    from ojs_celery import effects
    from ojs_celery.producer import BrokerUnavailable

    runtime = runtime_of(app)
    store = runtime.store
    retry = {"max_attempts": 3, "initial_interval": "PT1S", "jitter": False}
    jobs = [enqueue({"type": "e2e.add", "args": [i, 1], "timeout": 10, "grace_period": 0,
                     "retry": retry}, app=app) for i in range(3)]
    start = time.time()
    for job in jobs:
        assert store.start(job.id, 1, "worker_a", now=start).applied
    before = len(messages(app))

    def broken(*args: object, **kwargs: object) -> None:
        raise BrokerUnavailable("broker down")

    monkeypatch.setattr(effects, "publish", broken)
    report = sweep(runtime, now=start + 12)
    assert report.error == "broker down" and report.applied["execution"] == 3
    assert seen["job.timeout"] == 3 and seen["job.retrying"] == 3
    assert len(messages(app)) == before
    for job in jobs:
        stored = store.get_record(job.id)
        assert stored is not None and stored.job.state == "retryable"
        assert stored.dispatch_due is not None  # still owed
        assert [e["type"] for e in stored.job.errors] == ["timeout"]  # an outage counts not

    monkeypatch.undo()
    report = sweep(runtime, now=start + 12 + 11.5)
    assert report.error is None and report.applied["dispatch"] == 3 and report.published == 3
    assert len(messages(app)) == before + 3
    assert seen["job.timeout"] == 3


def test_scheduled_job_beyond_the_horizon_is_published_when_due(app: Celery) -> None:
    runtime = runtime_of(app)
    due = time.time() + 600
    job = enqueue({"type": "e2e.add", "args": [1, 2], "scheduled_at": _rfc3339(due)}, app=app)
    assert job.state == "scheduled" and messages(app) == []
    assert sweep(runtime, now=due - 1).published == 0

    report = sweep(runtime, now=due + 0.5)
    assert report.applied["promote"] == 1 and report.published == 1
    assert len(messages(app)) == 1


def completed(app: Celery, ids: list[str], now: float) -> None:
    """Run each job's first attempt to completion at ``now`` (written as a worker would)."""
    store = runtime_of(app).store
    for job_id in ids:
        store.start(job_id, 1, "worker_a", now=now)
        store.complete(job_id, 1, "worker_a", 1, now=now)


def test_retention_prunes_terminal_jobs_in_bounded_batches(app: Celery) -> None:
    runtime = runtime_of(app)
    store = runtime.store
    ids = [enqueue({"type": "e2e.add", "args": [i, 1]}, app=app).id for i in range(5)]
    now = time.time()
    completed(app, ids[:3], now)
    assert sweep(runtime, now=now + 6 * 86400).pruned == 0
    deleted: list[int] = []
    prune = store.prune

    def counted(at: float | None = None, limit: int = 500) -> int:
        deleted.append(prune(at, limit))
        return deleted[-1]

    store.prune = counted  # type: ignore[method-assign]
    try:
        report = sweep(runtime, now=now + 8 * 86400, batch=2)
    finally:
        del store.prune
    assert deleted == [2, 1] and report.pruned == 3
    assert sweep(runtime, now=now + 8 * 86400).pruned == 0
    assert [store.get(i) is None for i in ids] == [True, True, True, False, False]


def test_one_pass_prunes_more_than_a_batch_so_retention_keeps_up_with_the_workers(
    app: Celery,
) -> None:
    """Every job ends on the retention clock: one batch per pass (250 jobs/s with the
    defaults) let a worker finishing more than that grow the store without bound."""
    runtime = runtime_of(app)
    store = runtime.store
    now = time.time()
    completed(app, [enqueue({"type": "e2e.add", "args": [i, 1]}, app=app).id for i in range(7)],
              now)
    assert sweep(runtime, now=now + 8 * 86400, batch=2).pruned == 7
    assert store.due("retention", now + 8 * 86400, 100) == []


def test_a_prune_batch_that_fails_keeps_the_count_of_the_batches_before_it(
    app: Celery,
) -> None:
    """The pass's report counts what the earlier batches deleted when a later one fails (an
    outage ends the pass, an unreadable record the pruning): it said 0 pruned."""
    runtime = runtime_of(app)
    store = runtime.store
    now = time.time()
    completed(app, [enqueue({"type": "e2e.add", "args": [i, 1]}, app=app).id for i in range(5)],
              now)
    prune = store.prune
    for error in (StoreError("store gone"), ValueError("unreadable record")):
        calls: list[int] = []

        def failing_second(at: float | None = None, limit: int = 500,
                           error: Exception = error, calls: list[int] = calls) -> int:
            calls.append(limit)
            if len(calls) == 2:
                raise error
            return prune(at, limit)

        store.prune = failing_second  # type: ignore[method-assign]
        try:
            report = sweep(runtime, now=now + 8 * 86400, batch=2)
        finally:
            del store.prune
        assert len(calls) == 2 and report.pruned == 2, (error, report)
    assert sweep(runtime, now=now + 8 * 86400).pruned == 1


@pytest.mark.parametrize("interval", [None, 60.0])
def test_a_loops_pruning_may_take_the_loops_own_interval(
    app: Celery, monkeypatch: pytest.MonkeyPatch, interval: float | None
) -> None:
    """``ojs-celery sweep --loop --interval 60`` pruned for at most ``sweep_interval`` (2 s)
    a pass, then idled the rest of the minute: a backlog the loop had the time to clear took
    thirty times as many passes. Each batch here takes a second of the sweeper's clock."""
    runtime = runtime_of(app)
    store = runtime.store
    clock = [1000.0]
    batches: list[int] = []

    def full_batch(at: float | None = None, limit: int = 500) -> int:
        batches.append(limit)
        clock[0] += 1.0
        return limit

    monkeypatch.setattr(sweeper_module, "time", types.SimpleNamespace(
        time=time.time, monotonic=lambda: clock[0], sleep=time.sleep))
    passes = iter([False, True])  # stop() is asked before each pass: one pass
    store.prune = full_batch  # type: ignore[method-assign]
    try:
        run_loop(runtime, interval, stop=lambda: next(passes), pause=lambda _: None)
    finally:
        del store.prune
    assert len(batches) == math.ceil(interval or runtime.settings.sweep_interval)


def test_concurrent_sweepers_apply_each_transition_once(
    app: Celery, seen: Counter[str]
) -> None:
    runtime = runtime_of(app)
    count = 300
    jobs = [parse_envelope({"type": "e2e.add", "args": [i, 1], "enqueue_ttl": 1})
            for i in range(count)]
    created = time.time()
    for job in jobs:
        runtime.store.create(job, now=created)
    reports = []

    def run() -> None:
        reports.append(sweep(runtime, now=created + 2, batch=count))

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(r.applied["enqueue_ttl"] for r in reports) == count
    assert seen["job.ttl_expired"] == count and seen["job.discarded"] == count
    for job in jobs:
        stored = runtime.store.get(job.id)
        assert stored is not None and stored.state == "discarded" and len(stored.errors) == 1


def _sweep_in_process(app_config: dict[str, Any], now: float, counted: str, out: Any) -> None:
    app = make_app(app_config)
    out.put(sweep(get_runtime(app), now=now, batch=1000).applied[counted])


def sweeps_at_once(app: Celery, now: float, counted: str, count: int = 3) -> list[int]:
    """``count`` sweeper processes (forks, each with its own app and store) pass at once at
    ``now``; what each applied of clock ``counted``."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    processes = [context.Process(target=_sweep_in_process,
                                 args=(app._ojs_e2e_config, now, counted, results))
                 for _ in range(count)]
    for process in processes:
        process.start()
    applied = [results.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(30)
    return applied


def test_concurrent_sweeper_processes_never_double_apply(app: Celery) -> None:
    runtime = runtime_of(app)
    count = 200
    created = time.time()
    for i in range(count):
        runtime.store.create(
            parse_envelope({"type": "e2e.add", "args": [i, 1], "enqueue_ttl": 1}), now=created)
    assert sum(sweeps_at_once(app, created + 2, "enqueue_ttl")) == count


def test_a_store_fault_skips_the_pass_and_the_next_one_recovers(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = runtime_of(app)
    job = enqueue({"type": "e2e.add", "args": [1, 2], "enqueue_ttl": 1}, app=app)
    original = runtime.store.due

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise StoreError("connection refused")

    monkeypatch.setattr(runtime.store, "due", broken)
    report = sweep(runtime, now=time.time() + 2)
    assert report.error == "connection refused"
    assert last_sweep(runtime) is None
    monkeypatch.setattr(runtime.store, "due", original)
    report = sweep(runtime, now=time.time() + 2)
    assert report.error is None and report.applied["enqueue_ttl"] == 1
    stored = runtime.store.get(job.id)
    assert stored is not None and stored.state == "discarded" and len(stored.errors) == 1
    assert last_sweep(runtime) is not None


def _rfc3339(epoch: float) -> str:
    from ojs_celery.envelope import format_timestamp, from_epoch

    return format_timestamp(from_epoch(epoch))


def test_the_loop_survives_any_error_and_sweeps_again_when_it_goes(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """Not only store outages: an unexpected error (an unwrapped error reply, a bug) fails the
    pass, is logged with its traceback once, and the loop backs off and goes on."""
    runtime = runtime_of(app)
    store = runtime.store
    job = parse_envelope({"type": "e2e.add", "args": [1, 2], "enqueue_ttl": 1})
    store.create(job, now=time.time() - 10)
    original = store.due
    calls = Counter[str]()

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["due"] += 1
        if calls["due"] <= 2:
            raise ValueError("an error reply nobody wrapped")
        return original(*args, **kwargs)

    store.due = flaky  # type: ignore[method-assign]
    began = time.monotonic()

    def stop() -> bool:
        stored = store.get(job.id)
        return (stored is not None and stored.state == "discarded") or (
            time.monotonic() - began > 20)

    with caplog.at_level("ERROR", logger="ojs_celery.sweeper"):
        run_loop(runtime, interval=0.01, stop=stop)
    stored = store.get(job.id)
    assert stored is not None and stored.state == "discarded"
    assert stored.error is not None and stored.error["type"] == "enqueue_ttl_expired"
    failures = [r for r in caplog.records if r.name == "ojs_celery.sweeper"]
    assert len(failures) == 2 and [r.exc_info is not None for r in failures] == [True, False]


def test_the_sweep_task_reports_an_unexpected_error(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = runtime_of(app)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("a record that cannot be decoded")

    monkeypatch.setattr(runtime.store, "due", broken)
    report = app.tasks["ojs_celery.sweep"]()
    assert report["error"] == "KeyError: 'a record that cannot be decoded'"


@pytest.fixture(params=["sqlite", "postgres", "redis"])
def any_store_app(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[Celery]:
    """``app``, on each backend the store contract runs on (PostgreSQL too)."""
    with store_app(request.param, tmp_path) as celery_app:
        yield celery_app


def test_a_retained_record_that_cannot_be_read_does_not_stop_the_pruning(
    any_store_app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """One undecodable record at the head of the retention index failed every pass's prune
    ("sweep could not prune"), forever: the store grew without bound. The readable jobs are
    pruned, in several batches; the unreadable one stays, said once, and no pass reads it
    again before its entry's new time."""
    from ojs_celery.store.base import UNREADABLE_RETRY

    app = any_store_app
    runtime = runtime_of(app)
    store = runtime.store
    now = time.time()
    ids = [enqueue({"type": "e2e.add", "args": [i, 1]}, app=app).id for i in range(6)]
    for i, job_id in enumerate(ids):  # in this order on the retention clock
        completed(app, [job_id], now + i)
    corrupt_record(runtime.store, ids[0])
    at = now + 8 * 86400
    with caplog.at_level(logging.WARNING, logger="ojs_celery"):
        report = sweep(runtime, now=at, batch=2)
    assert report.error is None and report.pruned == 5, report
    assert [store.get(i) is None for i in ids[1:]] == [True] * 5
    said = [r for r in caplog.records if ids[0] in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING and said[0].exc_info is None
    assert not any("could not prune" in r.getMessage() for r in caplog.records)
    assert store.due("retention", at + 1e9, 10) == [(ids[0], at + UNREADABLE_RETRY)]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ojs_celery"):
        assert sweep(runtime, now=at + 60).pruned == 0
        assert caplog.records == []  # not read again
        assert sweep(runtime, now=at + UNREADABLE_RETRY).pruned == 0
    assert [ids[0] in r.getMessage() for r in caplog.records] == [True]  # tried, said again
    assert [i for i, _ in store.due("retention", at + 1e9, 10)] == [ids[0]]
    with pytest.raises(ValueError):  # left as it was
        store.get(ids[0])


def test_a_job_the_broker_refuses_is_skipped_then_discarded_and_the_pass_goes_on(
    app: Celery, seen: Counter[str]
) -> None:
    """Its queue is not declared (and Celery may not create it): each pass logs and counts it
    and does everything else; the fifth discards it with ``dispatch_failed``."""
    app.conf.task_create_missing_queues = False
    runtime = runtime_of(app)
    store = runtime.store
    now = time.time()
    bad = store.create(parse_envelope({"type": "e2e.add", "args": [1, 2], "queue": "nowhere"}),
                       now=now)  # stored before the queue went away; its message is owed
    assert bad.record is not None
    bad_id = bad.record.job.id
    for i in range(1, 5):
        expiring = store.create(parse_envelope({"type": "e2e.add", "args": [i, 1],
                                                "enqueue_ttl": 1}), now=now + 11 * (i - 1))
        assert expiring.record is not None
        report = sweep(runtime, now=now + 11 * i)
        assert report.error is None and report.skipped == 1
        assert report.applied["enqueue_ttl"] == 1  # the rest of the pass went on
        stored = store.get(bad_id)
        assert stored is not None and stored.state == "available"
        assert [e["type"] for e in stored.errors] == ["dispatch_error"] * i
    assert messages(app) == []
    report = sweep(runtime, now=now + 55)
    assert report.skipped == 1 and report.applied["dispatch_failed"] == 1
    stored = store.get(bad_id)
    assert stored is not None and stored.state == "discarded"
    assert stored.error is not None and stored.error["type"] == "dispatch_failed"
    assert seen["job.discarded"] == 1 + 4  # this one, and the four whose TTL expired
    assert sweep(runtime, now=now + 66).total == 0


def test_a_job_of_a_type_this_sweeper_does_not_register_stays_owed_for_one_that_does(
    app: Celery, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweeper still on the code before a task was added (a rolling deploy) cannot publish
    that task's jobs: not the job's fault, so it is never discarded for it (it was, with
    ``dispatch_failed``, after five passes); it stays owed, said in the log, and a sweeper
    that registers the task publishes it."""
    from ojs_celery import OJSTask

    monkeypatch.setattr(sweeper_module, "_unknown_types", {})  # said once per process
    runtime = runtime_of(app)
    store = runtime.store
    now = time.time()
    owed = store.create(parse_envelope({"type": "e2e.added_later", "args": [1]}), now=now)
    assert owed.record is not None
    job_id = owed.record.job.id
    with caplog.at_level(logging.WARNING, logger="ojs_celery.sweeper"):
        for i in range(1, 8):
            report = sweep(runtime, now=now + 11 * i)
            assert report.error is None and report.skipped == 1
    stored = store.get(job_id)
    assert stored is not None and stored.state == "available" and stored.errors == []
    said = [r.getMessage() for r in caplog.records if "e2e.added_later" in r.getMessage()]
    assert len(said) == 1 and "stays owed" in said[0]  # once, not every pass
    assert messages(app) == []

    @app.task(shared=False, name="e2e.added_later", base=OJSTask)
    def added_later(n: int) -> int:
        return n

    report = sweep(runtime, now=now + 99)
    assert report.skipped == 0 and report.published == 1 and len(messages(app)) == 1


def test_a_record_that_cannot_be_decoded_does_not_stop_the_pass(app: Celery) -> None:
    runtime = runtime_of(app)
    store = runtime.store
    created = time.time()
    ids = []
    for i in range(3):
        done = store.create(parse_envelope({"type": "e2e.add", "args": [i, 1],
                                            "enqueue_ttl": 1}), now=created)
        assert done.record is not None
        ids.append(done.record.job.id)
    corrupt_record(runtime.store, ids[1])
    report = sweep(runtime, now=created + 2)
    assert report.error is None and report.skipped == 1
    assert report.applied["enqueue_ttl"] == 2
    assert [store.get(i).state for i in (ids[0], ids[2])] == ["discarded"] * 2  # type: ignore[union-attr]
    assert last_sweep(runtime) is not None


def test_a_job_whose_message_is_gone_is_published_again_after_redispatch_after(
    app: Celery,
) -> None:
    """The backstop: published and acknowledged, then lost (here: deleted from the broker's
    folder), the job is sent once more after ``redispatch_after`` (default one hour), and
    then not again before another hour."""
    runtime = runtime_of(app)
    job = enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
    sent = job.created_at.timestamp()  # type: ignore[union-attr]
    folder = pathlib.Path(app.conf.broker_transport_options["data_folder_in"])
    for message in folder.glob("*.msg"):
        message.unlink()
    assert sweep(runtime, now=sent + 3599).total == 0
    report = sweep(runtime, now=sent + 3601)
    assert report.applied["redispatch"] == 1 and report.published == 1
    assert len(messages(app)) == 1
    record = runtime.store.get_record(job.id)
    assert record is not None and record.token == 1 and record.job.state == "available"
    assert sweep(runtime, now=sent + 3601 + 3599).total == 0


def test_a_backlog_gets_copies_of_its_messages_at_doubling_intervals(app: Celery) -> None:
    """Jobs that wait behind a backlog (no worker for hours) still have their messages: a copy
    every ``redispatch_after`` (one hour) would grow the queue by the whole backlog each time.
    Swept every six minutes for ten hours, a waiting job gets four copies, each after at least
    twice the wait of the one before (1, 2, 4, 8 hours, give or take a sweep), not ten."""
    runtime = runtime_of(app)
    job = enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
    sent = job.created_at.timestamp()  # type: ignore[union-attr]
    copies: list[float] = []
    for sweeps in range(1, 101):
        waited = sweeps * 360 + 1
        copies += [waited] * sweep(runtime, now=sent + waited).published
    assert len(copies) == 4 and copies[0] == 3601
    assert all(later >= 2 * earlier for earlier, later in itertools.pairwise(copies))
    assert len(messages(app)) == 5  # the first and four copies: fencing drops all but one


def test_index_entries_not_due_by_this_sweepers_rule_do_not_hold_back_due_jobs(
    app: Celery,
) -> None:
    """Index entries written under other settings (a shorter ``redispatch_after``, or an older
    version's rule) that this sweeper's rule finds not due are read past: a batch of them at
    the head of the index used to end the pass, and due jobs behind them waited."""
    runtime = runtime_of(app)
    store = runtime.store
    policy = store.policy
    wall = time.time()

    def stored(redispatch_after: float, created: float) -> str:
        store.policy = dataclasses.replace(policy, redispatch_after=redispatch_after)
        transition, confirm = store.begin_create(
            parse_envelope({"type": "e2e.add", "args": [1, 2]}), now=created)
        confirm()
        assert transition.record is not None
        store.ack_dispatch(transition.record.job.id, 1)
        return transition.record.job.id

    try:
        early = [stored(100, wall) for _ in range(3)]  # indexed at +100, due at +7200 now
        behind = stored(7200, wall - 7000)  # indexed and due at +200
    finally:
        store.policy = policy
    store.policy = dataclasses.replace(policy, redispatch_after=7200)
    try:
        report = sweep(runtime, now=wall + 300, batch=2)
        # read past, and moved to the deadline the rule gives: not read again before it
        assert {i for i, _ in store.due("redispatch", wall + 7199, 10)} == set()
        assert {i for i, _ in store.due("redispatch", wall + 7200, 10)} == set(early)
    finally:
        store.policy = policy
    assert report.applied["redispatch"] == 1 and report.published == 1
    assert [store.get_record(i).extended_at for i in early] == [wall] * 3  # type: ignore[union-attr]
    assert store.get_record(behind).extended_at == wall + 300  # type: ignore[union-attr]


def test_more_index_entries_not_due_than_a_pass_reads_hold_due_jobs_back_one_pass(
    app: Celery,
) -> None:
    """More such entries than a pass reads past (ten batches): each pass moves those it read to
    their deadline, so the due job behind them is reached by the next pass, not only when they
    come due (an upgrade over a backlog the previous version had resent)."""
    runtime = runtime_of(app)
    store = runtime.store
    policy = store.policy
    wall = time.time()
    fast = dataclasses.replace(policy, redispatch_after=100)
    slow = dataclasses.replace(policy, redispatch_after=7200)
    ids = []
    for redispatch, created in [(fast, wall)] * (READ_PAST + 2) + [(slow, wall - 7000)]:
        store.policy = redispatch
        try:
            transition, confirm = store.begin_create(
                parse_envelope({"type": "e2e.add", "args": [1, 2]}), now=created)
            confirm()
        finally:
            store.policy = policy
        assert transition.record is not None
        store.ack_dispatch(transition.record.job.id, 1)
        ids.append(transition.record.job.id)
    store.policy = slow
    try:
        first = sweep(runtime, now=wall + 300, batch=1)
        second = sweep(runtime, now=wall + 301, batch=1)
    finally:
        store.policy = policy
    assert first.applied["redispatch"] == 0
    assert second.applied["redispatch"] == 1
    assert store.get_record(ids[-1]).extended_at == wall + 301  # type: ignore[union-attr]


def test_a_dead_workers_attempt_its_last_beat_did_not_list_fails_at_once(app: Celery) -> None:
    """A worker killed within a beat interval of starting a job never listed it in a beat: the
    job must still fail with ``worker_death`` when the worker is declared dead, not wait a
    ``heartbeat_timeout`` to stall. Another worker's active job is left alone."""
    runtime = runtime_of(app)
    store = runtime.store
    timeout = runtime.settings.worker_heartbeat_timeout
    wall = time.time()
    unlisted = enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
    other = enqueue({"type": "e2e.add", "args": [3, 4]}, app=app)
    assert store.start(unlisted.id, 1, "worker_gone", now=wall - timeout - 2).applied
    assert store.start(other.id, 1, "worker_alive", now=wall - timeout - 2).applied
    for worker_id, beat in (("worker_gone", wall - timeout - 3), ("worker_alive", wall)):
        store.workers.save(WorkerInfo(worker_id=worker_id, hostname="h", pid=1, last_beat=beat))
    report = sweep(runtime, now=wall + 0.5)
    assert report.applied["worker"] == 1
    gone = store.get(unlisted.id)
    assert gone is not None and gone.state == "retryable"
    assert [e["type"] for e in gone.errors] == ["worker_death"]
    assert store.get(other.id).state == "active"  # type: ignore[union-attr]


def test_a_dead_worker_leaves_nothing_behind_in_the_store(app: Celery) -> None:
    """What was left for a worker (a directive sent before it died, the drain's mark of a job
    it was cancelling) goes with it when it is declared dead: nothing else would remove it,
    and every worker comes back under a new id."""
    runtime = runtime_of(app)
    store = runtime.store
    wall = time.time()
    job = enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
    assert store.start(job.id, 1, "worker_gone", now=wall - 100).applied
    store.workers.save(WorkerInfo(worker_id="worker_gone", hostname="h", pid=1,
                                  last_beat=wall - 100, active_job_ids=[job.id]))
    store.meta.send_directive("worker_gone", "quiet")
    store.meta.mark_draining("worker_gone", job.id)
    store.meta.send_directive("worker_alive", "quiet")
    store.workers.save(WorkerInfo(worker_id="worker_alive", hostname="h", pid=2, last_beat=wall))
    assert sweep(runtime, now=wall + 0.5).applied["worker"] == 1
    assert store.meta.pending_directive("worker_gone") is None
    assert not store.meta.is_draining("worker_gone", job.id)
    assert store.meta.pending_directive("worker_alive") == "quiet"


def test_a_worker_is_judged_by_its_own_heartbeat_timeout_where_it_is_longer(
    app: Celery,
) -> None:
    """Workers whose beats come further apart than this sweeper's settings expect (another
    app on the same store; a deploy that lengthened ``heartbeat_interval`` and
    ``worker_heartbeat_timeout``, its workers first) say so in their record: the sweeper waits
    for their own timeout before declaring them dead, or a healthy worker's running job failed
    with ``worker_death`` between two of its beats and ran again. A shorter one of their own
    does not hasten it."""
    runtime = runtime_of(app)
    store = runtime.store
    timeout = runtime.settings.worker_heartbeat_timeout
    wall = time.time()
    job = enqueue({"type": "e2e.add", "args": [1, 2], "heartbeat_timeout": 3600,
                   "visibility_timeout": 3600}, app=app)  # its own clocks stay quiet
    assert store.start(job.id, 1, "worker_slow_beats", now=wall).applied
    for worker_id, own in (("worker_slow_beats", 4 * timeout), ("worker_quick", timeout / 2)):
        store.workers.save(WorkerInfo(worker_id=worker_id, hostname="h", pid=1, last_beat=wall,
                                      heartbeat_timeout=own,
                                      active_job_ids=[job.id] if own > timeout else []))
    assert sweep(runtime, now=wall + timeout - 1).applied["worker"] == 0  # past quick's own
    assert sweep(runtime, now=wall + timeout + 1).applied["worker"] == 1
    assert {w.worker_id for w in store.workers.all()} == {"worker_slow_beats"}
    assert store.get(job.id).state == "active"  # type: ignore[union-attr]
    report = sweep(runtime, now=wall + 4 * timeout + 1)
    assert report.applied["worker"] == 1
    assert [e["type"] for e in store.get(job.id).errors] == ["worker_death"]  # type: ignore[union-attr]


def test_workers_with_longer_timeouts_of_their_own_do_not_hide_a_dead_one(app: Celery) -> None:
    """Live workers silent for this sweeper's timeout but not their own come first in the
    registry's stale list: a pass reads past them to the dead worker behind them (a batch of
    them used to fill the pass, and the dead worker's job stayed active)."""
    runtime = runtime_of(app)
    store = runtime.store
    timeout = runtime.settings.worker_heartbeat_timeout
    wall = time.time()
    for index in range(3):
        store.workers.save(WorkerInfo(worker_id=f"worker_slow_{index}", hostname="h", pid=1,
                                      last_beat=wall - timeout - 10 + index,
                                      heartbeat_timeout=10 * timeout))
    job = enqueue({"type": "e2e.add", "args": [1, 2], "heartbeat_timeout": 3600,
                   "visibility_timeout": 3600}, app=app)
    assert store.start(job.id, 1, "worker_dead", now=wall - timeout - 2).applied
    store.workers.save(WorkerInfo(worker_id="worker_dead", hostname="h", pid=2,
                                  last_beat=wall - timeout - 2, active_job_ids=[job.id]))
    report = sweep(runtime, now=wall, batch=2)
    assert report.applied["worker"] == 1
    assert store.get(job.id).state == "retryable"  # type: ignore[union-attr]
    assert {w.worker_id for w in store.workers.all()} == {f"worker_slow_{i}" for i in range(3)}


def test_silence_in_a_blind_spell_is_not_a_death(app: Celery) -> None:
    """A Redis pause longer than the worker heartbeat timeout stops every beat and every sweep
    alike: the first sweep after it must not declare live workers dead (their running jobs
    would run a second time). Silence since before the spell counts that much later."""
    runtime = runtime_of(app)
    store = runtime.store
    timeout = runtime.settings.worker_heartbeat_timeout
    wall = time.time()
    pause = timeout + 14
    for worker_id in ("worker_alive", "worker_gone"):
        store.workers.save(WorkerInfo(worker_id=worker_id, hostname="h", pid=1,
                                      last_beat=wall - pause - 1))
    store.meta.record_contact(wall - pause, blind_after=1.0)  # the last sweep before it
    assert sweep(runtime, now=time.time()).applied["worker"] == 0  # the first one after it
    assert {w.worker_id for w in store.workers.all()} == {"worker_alive", "worker_gone"}

    alive = store.workers.get("worker_alive")
    assert alive is not None
    alive.last_beat = wall + 1  # it beats again after the pause; the other never does
    store.workers.save(alive)
    report = sweep(runtime, now=wall + timeout + 0.5)
    assert report.applied["worker"] == 1
    assert [w.worker_id for w in store.workers.all()] == ["worker_alive"]


def test_silence_in_a_blind_spell_stalls_no_job_and_hides_no_reservation(app: Celery) -> None:
    """The same pause stops a running job's beats: the first sweep after a pause longer than
    its ``heartbeat_timeout`` or ``visibility_timeout`` must not fail the attempt, which is
    still running (its job would run twice). Silence since before the spell counts that much
    later."""
    runtime = runtime_of(app)
    store = runtime.store
    stall = enqueue({"type": "e2e.add", "args": [1, 2], "timeout": 3600,
                     "heartbeat_timeout": 60, "visibility_timeout": 3600}, app=app)
    hidden = enqueue({"type": "e2e.add", "args": [1, 2], "timeout": 3600,
                      "heartbeat_timeout": 3600, "visibility_timeout": 60}, app=app)
    wall = time.time()
    pause = 120
    for job in (stall, hidden):  # last heard from just before the pause
        assert store.start(job.id, 1, "worker_a", now=wall - pause - 2).applied
    store.meta.record_contact(wall - pause - 1, blind_after=1.0)  # the last sweep before it
    store.meta.record_contact(wall - 1, blind_after=1.0)  # the first after it
    report = sweep(runtime, now=time.time())  # silent for 122 s, 2 s of them outside it
    assert report.applied["stall"] == 0 and report.applied["visibility"] == 0
    assert {store.get(job.id).state for job in (stall, hidden)} == {"active"}  # type: ignore[union-attr]

    report = sweep(runtime, now=wall - 2 + 60 + 0.5)  # 60.5 s heard of, outside it
    assert report.applied["stall"] == 1 and report.applied["visibility"] == 1
    errors = {job.id: store.get(job.id).errors[-1]["type"]  # type: ignore[union-attr]
              for job in (stall, hidden)}
    assert errors == {stall.id: "stalled", hidden.id: "visibility_timeout"}


def test_a_blind_spell_ahead_of_this_hosts_clock_is_left_out(
    app: Celery, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweeper whose clock runs an hour ahead records a spell that ends in the future: taken
    at its word, no worker could be declared dead and no job stalled for that hour. The other
    sweepers leave it out, and say so."""
    runtime = runtime_of(app)
    store = runtime.store
    timeout = runtime.settings.worker_heartbeat_timeout
    wall = time.time()
    store.workers.save(WorkerInfo(worker_id="worker_gone", hostname="h", pid=1,
                                  last_beat=wall - timeout - 5))
    store.meta.record_contact(wall - 2, blind_after=1.0)
    store.meta.record_contact(wall + 3600, blind_after=1.0)  # the host an hour ahead
    monkeypatch.setattr(sweeper_module, "_future_spell", AtMostEvery(600.0))  # said per process
    with caplog.at_level(logging.WARNING, logger="ojs_celery.sweeper"):
        assert sweep(runtime, now=time.time()).applied["worker"] == 1
    assert store.workers.get("worker_gone") is None
    assert any("ahead of this host's clock" in r.getMessage() for r in caplog.records)


def test_a_beat_inside_a_blind_spell_counts_from_the_spell_s_end() -> None:
    """A beat may land after the last contact the spell starts at, just before the store went
    away: its silence counts from the spell's end, not from the beat."""
    spell = BlindSpell(start=100.0, end=160.0)
    assert spell.heard(90.0) == 150.0  # before it: moved on by the spell's length
    assert spell.heard(101.0) == 160.0  # in it: heard at its end
    assert spell.heard(170.0) == 170.0  # after it: as it is


def test_an_attempt_a_worker_started_after_coming_back_is_not_failed_as_its_death(
    app: Celery,
) -> None:
    """A frozen worker thaws while a sweep declares it dead, registers again under its id and
    starts a job: that attempt, which started after the pass began, is a live worker's."""
    runtime = runtime_of(app)
    store = runtime.store
    timeout = runtime.settings.worker_heartbeat_timeout
    wall = time.time()
    job = enqueue({"type": "e2e.add", "args": [1, 2]}, app=app)
    store.workers.save(WorkerInfo(worker_id="worker_thawed", hostname="h", pid=1,
                                  last_beat=wall - timeout - 3))
    assert store.start(job.id, 1, "worker_thawed", now=wall + 1).applied  # after `now` below
    assert sweep(runtime, now=wall).applied["worker"] == 1
    assert store.get(job.id).state == "active"  # type: ignore[union-attr]
