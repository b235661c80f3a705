"""Graceful shutdown end to end (real prefork ``celery worker`` subprocesses on Redis): running
jobs are left alone during the drain, get their cancellation signal only in the window before
its end, and a job's own timeout during the drain stays a ``timeout``.

Each test starts its own worker on a queue of its own, with the drain it examines; bounds are
the drain plus generous slack, and the one timing that is the point of a test (when the
cancellation arrives) is measured in the handler. The last test stops a worker on the
filesystem broker (the embedded default), whose pool shares one task queue.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time
from collections.abc import Iterator
from typing import Any

import celery
import pytest
from celery.result import AsyncResult

from ojs_celery import enqueue
from ojs_celery.runtime import get_runtime
from tests.conftest import Env, start_env
from tests.workers import Worker, filesystem_config, forget_redis_names, unique, wait_for

SLACK = 6.0


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("shutdown")
    with start_env("redis", tmp, concurrency=1,
                   config={"ojs": {"heartbeat_interval": 0.5}}) as started:
        yield started


def own_worker(env: Env, tmp: pathlib.Path, drain: float, queue: str | None = None,
               celery: dict[str, Any] | None = None, **options: Any) -> Worker:
    config = {**env.config, "worker_queues": [queue or unique("own")],
              "ojs": {**env.config["ojs"], "shutdown_grace_period": drain},
              "celery": {**env.config.get("celery", {}), **(celery or {})}}
    worker = Worker(config, tmp / f"{unique('w')}.log", **options)
    worker.wait_ready()
    return worker


def queue_of(worker: Worker) -> str:
    return str(worker.config["worker_queues"][0])


def sigterm(worker: Worker, group: bool) -> float:
    """SIGTERM to the main process, or to the whole process group (systemd, docker stop)."""
    began = time.time()
    if group:
        os.killpg(worker.process.pid, signal.SIGTERM)
    else:
        worker.process.send_signal(signal.SIGTERM)
    return began


@pytest.mark.parametrize("group", [False, True], ids=["main", "group"])
def test_sigterm_lets_a_running_job_finish(env: Env, tmp_path: pathlib.Path, group: bool) -> None:
    worker = own_worker(env, tmp_path, drain=20.0, concurrency=2)
    try:
        job = enqueue({"type": "e2e.sleep", "args": [5.0, "done"], "queue": queue_of(worker)},
                      app=env.app)  # default grace_period (30 s) > drain: the old code
        env.wait_state(job.id, "active")   # cancelled it at once
        began = time.monotonic()
        sigterm(worker, group)
        assert worker.process.wait(5 + SLACK) == 0
        assert time.monotonic() - began < 5 + SLACK  # not the 20 s drain
        done = env.job(job.id)
        assert done.state == "completed" and done.result == "done"
        assert done.attempt == 1 and done.errors == []
    finally:
        worker.stop()


@pytest.mark.parametrize("pool", ["prefork", "gevent"])
def test_a_long_job_is_cancelled_in_the_window_and_resumes(
    env: Env, tmp_path: pathlib.Path, pool: str
) -> None:
    """Drain 10 s, window 5 s (the default): the job is signalled 5 s before the end, saves a
    checkpoint, fails with ``shutdown`` and its next attempt resumes from the checkpoint. On
    gevent, where Celery has no soft limit, OJS throws it into the job's greenlet."""
    if pool == "gevent":
        pytest.importorskip("gevent")
        if celery.VERSION < (5, 5):
            pytest.skip("Celery 5.4's gevent pool cannot stop a greenlet: the drain's end "
                        "waits for the handler (README, Graceful shutdown)")
    queue = unique("own")
    worker = own_worker(env, tmp_path, drain=10.0, queue=queue, pool=pool,
                        concurrency=5 if pool == "gevent" else 1)
    job = enqueue({"type": "e2e.resumable", "args": [60], "queue": queue, "timeout": 100,
                   "retry": {"max_attempts": 3, "initial_interval": "PT0.1S"}}, app=env.app)
    try:
        env.wait_state(job.id, "active")
        began = sigterm(worker, group=True)
        assert worker.process.wait(10 + SLACK) == 0
        [cancelled] = [line.split() for line in env.lines("cancelled") if job.id in line]
        signalled_after = float(cancelled[2].removeprefix("at=")) - began
        assert 10 - 5 - 0.5 <= signalled_after <= 10 - 5 + 2.0, signalled_after
        failed = env.job(job.id)
        assert failed.state == "retryable"
        assert [e["type"] for e in failed.errors] == ["shutdown"]
        assert failed.last_checkpoint == {"step": 1}
    finally:
        worker.stop()
    second = own_worker(env, tmp_path, drain=10.0, queue=queue)
    try:
        done = env.wait_state(job.id, "completed")
        assert done.attempt == 2 and done.result == {"resumed_from": {"step": 1}}
    finally:
        second.stop()


def test_jobs_the_pool_had_not_started_go_back_unattempted_when_the_window_begins(
    env: Env, tmp_path: pathlib.Path
) -> None:
    """Drain 6 s, window 3 s, one pool process: the long job is cancelled 3 s before the end
    and stops; the 1 s jobs prefetched behind it, which would start then and be cancelled at
    once (their only attempt failed with ``shutdown`` for work they never did), go back to the
    broker unstarted and run on the next worker as their first attempt."""
    queue = unique("own")
    worker = own_worker(env, tmp_path, drain=6.0, queue=queue, concurrency=1,
                        extra=["--prefetch-multiplier", "4"])
    long = enqueue({"type": "e2e.sleep", "args": [60.0], "queue": queue, "timeout": 100,
                    "retry": {"max_attempts": 3, "initial_interval": "PT0.1S"}}, app=env.app)
    short = [enqueue({"type": "e2e.sleep", "args": [1.0, "short"], "queue": queue,
                      "retry": {"max_attempts": 1}}, app=env.app) for _ in range(3)]
    try:
        env.wait_state(long.id, "active")
        wait_for(lambda: all(any(job.id in line for line in env.lines("received"))
                             for job in short), 15, "the short jobs prefetched")
        sigterm(worker, group=True)
        assert worker.process.wait(6 + SLACK) == 0
        assert [e["type"] for e in env.job(long.id).errors] == ["shutdown"]
        for job in short:
            left = env.job(job.id)
            assert (left.state, left.attempt, left.errors) == ("available", 0, [])
        log = worker.log()
        assert "not started, the worker is shutting down" in log
        assert "celery.exceptions.Reject" not in log  # one line each, no traceback
    finally:
        worker.stop()
    second = own_worker(env, tmp_path, drain=6.0, queue=queue)
    try:
        for job in short:
            done = env.wait_state(job.id, "completed")
            assert done.attempt == 1 and done.result == "short"
    finally:
        second.stop()


def test_a_jobs_own_timeout_during_the_drain_is_a_timeout(
    env: Env, tmp_path: pathlib.Path
) -> None:
    worker = own_worker(env, tmp_path, drain=20.0)
    try:
        job = enqueue({"type": "e2e.sleep", "args": [60.0], "queue": queue_of(worker),
                       "timeout": 3, "retry": {"max_attempts": 1}}, app=env.app)
        active = env.wait_state(job.id, "active")
        assert active.attempt == 1
        began = time.monotonic()
        sigterm(worker, group=True)
        assert worker.process.wait(3 + SLACK) == 0
        assert time.monotonic() - began < 3 + SLACK
        failed = env.job(job.id)
        assert failed.state == "discarded"
        assert [e["type"] for e in failed.errors] == ["timeout"]
    finally:
        worker.stop()


@pytest.mark.parametrize("pool", ["prefork", "gevent"])
def test_jobs_own_timeouts_and_the_drains_cancellation_at_about_the_same_time(
    env: Env, tmp_path: pathlib.Path, pool: str
) -> None:
    """Drain 8 s, window 5 s, eight jobs at once: those whose own limit fires before or at
    about the window (2 s, 3 s) end ``timeout``, the others ``shutdown``, each error once, on
    gevent (OJS's soft limit and the drain's, in greenlets) as on prefork."""
    if pool == "gevent":
        pytest.importorskip("gevent")
        if celery.VERSION < (5, 5):
            pytest.skip("Celery 5.4's gevent pool cannot stop a greenlet")
    worker = own_worker(env, tmp_path, drain=8.0, pool=pool, concurrency=10)
    try:
        queue = queue_of(worker)
        once = {"retry": {"max_attempts": 1}, "queue": queue}
        own = [enqueue({"type": "e2e.checkpointing", "args": ["escape"], "timeout": limit,
                        "grace_period": 20, **once}, app=env.app) for limit in (2, 2, 3)]
        own += [enqueue({"type": "e2e.sleep", "args": [60.0], "timeout": 3, **once},
                        app=env.app) for _ in range(2)]
        drained = [enqueue({"type": "e2e.checkpointing", "args": ["escape"], "timeout": 100,
                            **once}, app=env.app) for _ in range(3)]
        for job in own + drained:
            env.wait_state(job.id, "active")
        began = sigterm(worker, group=True)
        assert worker.process.wait(8 + SLACK) == 0
        assert time.time() - began < 8 + SLACK
        for job in own:
            done = env.job(job.id)
            assert (done.state, [e["type"] for e in done.errors]) == ("discarded", ["timeout"])
        for job in drained:
            done = env.job(job.id)
            assert (done.state, [e["type"] for e in done.errors]) == ("discarded", ["shutdown"])
    finally:
        worker.stop()


@pytest.mark.skipif(celery.VERSION < (5, 5), reason="worker_soft_shutdown_timeout is Celery 5.5+")
def test_the_drain_governs_ojs_jobs_under_celerys_soft_shutdown(
    env: Env, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``REMAP_SIGTERM=SIGQUIT`` with ``worker_soft_shutdown_timeout`` 60 s: SIGTERM is still
    the OJS drain (10 s), not Celery's 60 s soft shutdown: the short job finishes, the long one
    is cancelled in the window and fails with ``shutdown``, and the worker leaves at the end of
    the drain through Celery's cold shutdown."""
    monkeypatch.setenv("REMAP_SIGTERM", "SIGQUIT")
    worker = own_worker(env, tmp_path, drain=10.0, concurrency=2,
                        celery={"worker_soft_shutdown_timeout": 60.0})
    try:
        queue = queue_of(worker)
        short = enqueue({"type": "e2e.sleep", "args": [3.0, "short"], "queue": queue},
                        app=env.app)
        long = enqueue({"type": "e2e.checkpointing", "args": ["overrun"], "timeout": 100,
                        "queue": queue}, app=env.app)
        env.wait_state(short.id, "active")
        env.wait_state(long.id, "active")
        began = time.monotonic()
        sigterm(worker, group=True)
        # The bound only has to stay well under Celery's 60 s: after the 10 s drain, Celery's
        # cold shutdown takes 1-2 s here, and several times that on a loaded CI machine.
        code = worker.process.wait(10 + 3 * SLACK)
        assert time.monotonic() - began < 10 + 3 * SLACK  # far less than the 60 s soft shutdown
        assert code in (0, 1)  # Celery's cold shutdown (REMAP_SIGTERM) may report EX_FAILURE
        assert env.job(short.id).state == "completed"
        failed = env.job(long.id)
        assert [e["type"] for e in failed.errors] == ["shutdown"]
        assert failed.last_checkpoint == {"attempt": 1}
        store = get_runtime(env.app).store
        assert not [w for w in store.workers.all() if w.pid == worker.process.pid]
    finally:
        worker.stop()


def test_a_drain_of_zero_fails_running_jobs_at_once(env: Env, tmp_path: pathlib.Path) -> None:
    worker = own_worker(env, tmp_path, drain=0.0)
    try:
        job = enqueue({"type": "e2e.sleep", "args": [60.0], "queue": queue_of(worker),
                       "retry": {"max_attempts": 1}}, app=env.app)
        env.wait_state(job.id, "active")
        sigterm(worker, group=False)
        assert worker.process.wait(SLACK) == 0
        assert [e["type"] for e in env.job(job.id).errors] == ["shutdown"]
    finally:
        worker.stop()


def test_a_job_the_drain_discards_shows_failure_once(env: Env, tmp_path: pathlib.Path) -> None:
    """Discarded by the drain → FAILURE in the result backend, written by the drain (Celery
    would write REVOKED for the stopped pool process); a job the drain retries is no REVOKED."""
    worker = own_worker(env, tmp_path, drain=0.0, concurrency=2)
    queue = queue_of(worker)
    try:
        ended = enqueue({"type": "e2e.sleep", "args": [60.0], "queue": queue,
                         "retry": {"max_attempts": 1}}, app=env.app)
        retried = enqueue({"type": "e2e.sleep", "args": [60.0], "queue": queue,
                           "retry": {"max_attempts": 3, "initial_interval": "PT60S"}},
                          app=env.app)
        env.wait_state(ended.id, "active")
        env.wait_state(retried.id, "active")
        sigterm(worker, group=False)
        assert worker.process.wait(SLACK) == 0
        assert env.job(ended.id).state == "discarded"
        assert env.job(retried.id).state == "retryable"
        result = AsyncResult(ended.id, app=env.app)
        assert result.state == "FAILURE"
        assert "shutdown" in str(result.result)
        assert AsyncResult(retried.id, app=env.app).state in ("PENDING", "RETRY")
    finally:
        worker.stop()
        forget_redis_names(env.config["broker_url"], [queue])


@pytest.mark.parametrize("concurrency", [1, 2])
def test_sigquit_stops_an_idle_worker_on_the_embedded_transport(
    tmp_path: pathlib.Path, concurrency: int
) -> None:
    """Cold shutdown (SIGQUIT) on the filesystem broker, whose non-async prefork pool shares
    one task queue: an idle pool process SIGKILLed while it held that queue's read lock used
    to hang billiard's exit-time finalizer for ever."""
    worker = Worker(filesystem_config(tmp_path), tmp_path / "worker.log",
                    concurrency=concurrency)
    try:
        worker.wait_ready()
        time.sleep(1.0)  # the pool processes are waiting for their next task
        began = time.monotonic()
        worker.process.send_signal(signal.SIGQUIT)
        code = worker.process.wait(15.0)
        assert time.monotonic() - began < 15.0
        assert code in (0, 1)  # Celery's cold shutdown may report EX_FAILURE
    finally:
        worker.stop()
