"""A dead worker's burial that the job store fails half way is resumed by the next pass.

The sweeper turns a dead worker's record into a tombstone, recovers the jobs its beats listed,
and removes the tombstone last (``sweeper._bury_dead_workers``). Here the store fails right
after the first recovery, by a real server: a Redis out of memory (an ``OOM`` error reply to
every write), a Redis stopped and started again on the same port with its data (a lost
connection), a PostgreSQL server of the test's own restarted. The next pass, by another
sweeper (a new app: nothing of the first process is needed), recovers the rest at once (the
attempt the worker started after its last beat too), recovers nothing twice, leaves alone the
job the worker finished meanwhile, and says the worker's death once (the warning,
``worker.stopped``)."""

from __future__ import annotations

import json
import logging
import pathlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery

from ojs_celery.envelope import parse_envelope
from ojs_celery.lifecycle import WORKER
from ojs_celery.runtime import get_runtime
from ojs_celery.store import JobStore, WorkerInfo
from ojs_celery.sweeper import sweep
from ojs_celery.worker.registry import Registry
from tests.conftest import store_app
from tests.e2eapp import make_app
from tests.pgserver import PrivatePostgres
from tests.test_store_faults import PrivateRedis
from tests.test_sweeper import sweeps_at_once
from tests.workers import filesystem_config, ojs_cli, unique

#: A worker last heard this long ago is dead (after 30 s), its jobs not stalled yet (60 s).
SILENT = 40.0


@contextmanager
def sweeper_app(tmp_path: pathlib.Path, url: str, prefix: str) -> Iterator[Celery]:
    """A sweeper's app on the embedded broker folder ``tmp_path`` (shared by every app of the
    test: the messages land in one folder) and the job store ``url``/``prefix``."""
    config = filesystem_config(tmp_path)
    config["ojs"] = {"store_url": url, "store_prefix": prefix, "events": False}
    app = make_app(config)
    try:
        yield app
    finally:
        get_runtime(app).store.close()


def dead_worker(store: JobStore, now: float) -> tuple[str, list[str], str, str]:
    """A worker silent for :data:`SILENT` whose last beat listed three running jobs and one it
    held but had not started, and which started one more after that beat; its id, the listed
    running jobs' ids, the held one's, the unlisted one's."""
    worker_id = unique("w")
    running = []
    for started in (now - SILENT - 1,) * 3 + (now - SILENT + 1,):
        job = parse_envelope({"type": "e2e.add", "args": [1, 2]})
        store.create(job, now=now - SILENT - 2)
        assert store.start(job.id, 1, worker_id, now=started).applied
        running.append(job.id)
    held = parse_envelope({"type": "e2e.add", "args": [3, 4]})
    store.create(held, now=now - SILENT - 2)
    store.workers.save(WorkerInfo(worker_id=worker_id, hostname="h", pid=1,
                                  last_beat=now - SILENT, active_job_ids=running[:3],
                                  reserved_job_ids=[held.id]))
    return worker_id, running[:3], held.id, running[3]


def failing_after_first_recovery(store: JobStore, fault: Callable[[], object],
                                 monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Calls ``fault`` (which breaks the real server) once the burial's first recovery is
    written: the Python hook only picks the moment. Returns the ids applied, in order."""
    applied: list[str] = []
    apply = store.apply

    def hooked(job_id: str, rule: Any) -> Any:
        done = apply(job_id, rule)
        applied.append(job_id)
        if len(applied) == 1:
            fault()
        return done

    monkeypatch.setattr(store, "apply", hooked)
    return applied


def resumed_burial(
    tmp_path: pathlib.Path, url: str, fault: Callable[[], object], heal: Callable[[], object],
    said_by: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    seen: Counter[str],
) -> None:
    """The burial of :func:`dead_worker`, the store broken by ``fault`` after its first
    recovery (the pass's error says ``said_by``), mended by ``heal``, then resumed."""
    caplog.set_level(logging.WARNING, logger="ojs_celery.sweeper")
    prefix = unique("t")
    now = time.time()
    with sweeper_app(tmp_path, url, prefix) as first:
        runtime = get_runtime(first)
        store = runtime.store
        worker_id, running, held, unlisted = dead_worker(store, now)
        applied = failing_after_first_recovery(store, fault, monkeypatch)
        report = sweep(runtime, now=now)
        assert report.error is not None and said_by in report.error, report
        assert report.applied["worker"] == 1 and applied == running[:1]
    heal()

    def said() -> int:
        return sum("declared dead" in r.getMessage() for r in caplog.records)

    assert said() == 1 and seen["worker.stopped"] == 1
    with sweeper_app(tmp_path, url, prefix) as second:  # another sweeper (the first is gone)
        runtime = get_runtime(second)
        store = runtime.store
        tombstone = store.workers.get(worker_id)
        assert tombstone is not None and tombstone.buried and tombstone.buried_at == now
        assert store.workers.stale(now - 300, 10) == [worker_id]  # to any sweeper, first
        listed = ojs_cli(second._ojs_e2e_config, "workers", "--json")
        assert [(row["worker_id"], row["state"]) for row in json.loads(listed.stdout)] == [
            (worker_id, "dead")], listed.stderr
        first_job, *rest = [store.get(job_id) for job_id in [*running, unlisted]]
        assert first_job is not None and first_job.state == "retryable"
        assert [r is not None and r.state for r in rest] == ["active"] * 3
        # the (frozen) worker finished its last job meanwhile: that is left alone
        assert store.complete(running[2], 1, worker_id, 3, now=now + 1).applied

        report = sweep(runtime, now=now + 5)
        assert report.error is None, report
        assert report.applied["worker"] == 0  # not declared dead again
        jobs = [store.get(job_id) for job_id in [*running, unlisted]]
        for job in [*jobs[:2], jobs[3]]:  # the one started after the last beat too
            assert job is not None and job.state == "retryable" and job.attempt == 1
            assert [e["type"] for e in job.errors] == ["worker_death"]  # once each
        assert jobs[2] is not None and jobs[2].state == "completed" and not jobs[2].errors
        message_sent = store.get_record(held)
        assert message_sent is not None and message_sent.extended_at == now
        assert store.workers.get(worker_id) is None
        assert said() == 1 and seen["worker.stopped"] == 1

        # the rules of the worker's death, applied once more, change nothing
        policy = store.policy
        for job_id in [*running, unlisted]:
            again = store.apply(job_id, WORKER.active_rule(worker_id, now, policy))
            assert again.record is None and again.reason == "not_owned", again.reason
        again = store.apply(held, WORKER.reserved_rule(now, policy))
        assert again.record is None and again.reason == "sent_since", again.reason
        assert sweep(runtime, now=now + 10).error is None
        assert said() == 1 and seen["worker.stopped"] == 1
        store.clear()


def test_a_burial_that_a_redis_out_of_memory_cut_is_resumed(
    redis_server: PrivateRedis, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, seen: Counter[str],
) -> None:
    """The store answers every write with ``-OOM`` (maxmemory reached, noeviction) after the
    first recovery: the pass ends, the tombstone stays; once it has memory again the next
    pass recovers the rest."""
    admin = redis_server.admin

    def fault() -> None:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)

    resumed_burial(tmp_path, redis_server.url, fault,
                   lambda: admin.config_set("maxmemory", 0),
                   "command not allowed when used memory > 'maxmemory'", monkeypatch, caplog,
                   seen)


def test_a_burial_that_a_redis_restart_cut_is_resumed(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    seen: Counter[str],
) -> None:
    """The store goes away after the first recovery (its connections refused), and comes back
    on the same port with its data (append-only file): the next pass recovers the rest."""
    (tmp_path / "redis").mkdir()
    server = PrivateRedis(tmp_path / "redis", durable=True)
    try:
        resumed_burial(tmp_path, server.url, server.stop, server.start, "Connection refused",
                       monkeypatch, caplog, seen)
    finally:
        server.stop()


def test_a_burial_that_a_postgresql_restart_cut_is_resumed(
    pg_server: PrivatePostgres, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, seen: Counter[str],
) -> None:
    """The same on PostgreSQL (a server of the test's own, stopped after the first recovery
    and started again): the tombstone is a row of the workers table."""
    resumed_burial(tmp_path, pg_server.url, lambda: pg_server.stop("fast"), pg_server.start,
                   "Connection refused", monkeypatch, caplog, seen)


def test_a_worker_that_comes_back_during_its_burial_is_left_to_run(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, seen: Counter[str],
) -> None:
    """A frozen worker declared dead whose burial a store failure interrupted beats again
    before the next pass: its save replaces the tombstone, its beat learns it was declared
    dead (and registers again), and the next pass leaves it and the job it still runs alone
    (the job it recovered stays recovered)."""
    with store_app("sqlite", tmp_path) as app:
        runtime = get_runtime(app)
        store = runtime.store
        now = time.time()
        worker_id, running, _, _ = dead_worker(store, now)
        info = store.workers.get(worker_id)
        assert info is not None and store.bury_worker(info, now) is not None
        assert store.apply(running[0], WORKER.active_rule(worker_id, now, store.policy)).applied
        back = WorkerInfo(worker_id=worker_id, hostname="h", pid=1, last_beat=now + 1,
                          active_job_ids=running[1:])
        directive, known = Registry(runtime, worker_id).beat(back)
        assert directive is None and not known
        report = sweep(runtime, now=now + 2)
        assert report.error is None and report.applied["worker"] == 0
        assert store.workers.get(worker_id) == back
        assert [job.state for job in map(store.get, running) if job] == \
            ["retryable", "active", "active"]
        assert seen["worker.stopped"] == 0


def test_concurrent_sweepers_declare_a_worker_dead_once_and_recover_each_job_once(
    app: Celery,
) -> None:
    """Three sweeper processes at once, each of which may find the tombstone of the others'
    burial under way and resume it: one declares the worker dead, each job is recovered once."""
    store = get_runtime(app).store
    now = time.time()
    worker_id, running, held, unlisted = dead_worker(store, now)
    declared = sweeps_at_once(app, now, WORKER.name)
    assert sum(declared) == 1, declared
    for job_id in [*running, unlisted]:
        job = store.get(job_id)
        assert job is not None and job.state == "retryable", job_id
        assert [e["type"] for e in job.errors] == ["worker_death"]
    record = store.get_record(held)
    assert record is not None and record.extended_at == now
    assert store.workers.get(worker_id) is None
