"""A retry's next attempt is published once Celery has stored the attempt's RETRY.

Celery's trace stores RETRY after the task raised ``Retry``, and its result backend guards a
SUCCESS with a read, then a write. A next attempt published before that (``self.retry`` with no
countdown, or a short one) can run in another pool process and store its SUCCESS between the
two: the RETRY then overwrites it, the result reads RETRY for ever and ``get()`` waits until its
timeout (plain Celery's ``self.retry`` has that order; docs/celery-notes.md). The test's result
backend takes a second over that write, so the next attempt, 0.2 s later, would land in it.
"""

from __future__ import annotations

import pathlib
import signal
import time
from typing import Any

import pytest
from celery import states

from ojs_celery import enqueue

from . import services
from .conftest import start_env
from .workers import Worker, unique, wait_for


def test_a_retried_jobs_success_is_not_overwritten_by_its_retry(tmp_path: pathlib.Path) -> None:
    slow = f"tests.e2eapp:SlowRetryResults+{services.redis_url()}"
    with start_env("redis", tmp_path, config={"result_backend": slow}) as env:
        job_id = env.app.tasks["e2e.self_retry"].delay(2).id
        # once the first attempt's trace is over (Celery logs the retry after storing it), the
        # result is read afresh, as a caller that asks then does
        wait_for(lambda: f"[{job_id}] retry:" in env.worker.log(), 30, "the first attempt's retry")
        result = env.app.AsyncResult(job_id)
        assert result.get(timeout=30) == "ok on 2"
        assert result.state == states.SUCCESS
        assert env.job(job_id).state == "completed"


def test_a_retry_whose_on_retry_raises_runs_its_next_attempt_at_once(
        tmp_path: pathlib.Path) -> None:
    """The task's ``on_retry`` raises, so Celery's trace sends no ``task_retry``: the next
    attempt's message is still published at the end of the trace (``task_postrun``), as
    Celery's own retry publishes it, not left to a sweeper (none runs here)."""
    with start_env("redis", tmp_path) as env:
        job_id = env.app.tasks["e2e.retry_on_retry_fails"].delay(2).id
        wait_for(lambda: env.job(job_id).state == "completed", 20, "the second attempt")
        assert env.job(job_id).attempt == 2


# A retry the worker's main process decides (a lost pool process, a hard time limit): it stores
# the RETRY itself, and the next attempt, 0.2 s later, runs in the other worker (this one's only
# pool process is busy until the RETRY is stored) unless its message waits for that write.
MAIN_PROCESS_RETRIES = {
    "lost pool process": {"type": "e2e.dies_once", "args": []},
    "hard time limit": {"type": "e2e.stuck_first", "args": [8], "timeout": 1, "grace_period": 0},
}


@pytest.mark.parametrize("envelope", MAIN_PROCESS_RETRIES.values(), ids=MAIN_PROCESS_RETRIES)
def test_a_retry_of_the_main_process_stores_retry_before_its_next_attempt_runs(
        tmp_path: pathlib.Path, envelope: dict[str, Any]) -> None:
    slow = f"tests.e2eapp:SlowRetryResults+{services.redis_url()}"
    with start_env("redis", tmp_path, config={"result_backend": slow}, concurrency=1) as env:
        other = Worker(env.config, tmp_path / "other.log", concurrency=1)
        try:
            other.wait_ready()
            policy = {"max_attempts": 3, "initial_interval": "PT0.2S", "jitter": False}
            job = enqueue({**envelope, "retry": policy}, app=env.app)
            env.wait_state(job.id, "completed", timeout=30)
            time.sleep(1.5)  # past the slow write of the RETRY, had it come after the SUCCESS
            result = env.app.AsyncResult(job.id)
            assert result.get(timeout=15) == "ok on 2"
            assert result.state == states.SUCCESS
            done = env.job(job.id)
            assert done.state == "completed" and done.attempt == 2
            runs = [line for line in env.lines("runs") if job.id in line]
            assert [line.split()[-1] for line in runs] == ["attempt=1", "attempt=2"]
        finally:
            other.stop()


def test_a_retry_of_the_shutdown_drain_stores_retry_before_its_next_attempt_runs(
        tmp_path: pathlib.Path) -> None:
    """A worker shutting down with a 2 s drain fails a job that overruns its cancellation
    (``shutdown``, retried 0.2 s later) and stops its pool process; the request stores the
    RETRY, slowly, and a second worker on the job's queue runs the next attempt, which resumes
    from the checkpoint the first one saved and returns at once."""
    slow = f"tests.e2eapp:SlowRetryResults+{services.redis_url()}"
    with start_env("redis", tmp_path, config={"result_backend": slow}, concurrency=1) as env:
        queue = unique("own")
        config = {**env.config, "worker_queues": [queue],
                  "ojs": {**env.config["ojs"], "shutdown_grace_period": 2.0}}
        leaving = Worker(config, tmp_path / "leaving.log", concurrency=1)
        other: Worker | None = None
        try:
            leaving.wait_ready()
            policy = {"max_attempts": 3, "initial_interval": "PT0.2S", "jitter": False}
            job = enqueue({"type": "e2e.resumable", "args": [60], "queue": queue,
                           "timeout": 100, "retry": policy}, app=env.app)
            env.wait_state(job.id, "active", worker=leaving)
            other = Worker(config, tmp_path / "other.log", concurrency=1)
            other.wait_ready()
            leaving.process.send_signal(signal.SIGTERM)
            env.wait_state(job.id, "completed", timeout=30, worker=other)
            assert leaving.process.wait(20) == 0
            result = env.app.AsyncResult(job.id)
            assert result.get(timeout=15) == {"resumed_from": {"step": 1}}
            assert result.state == states.SUCCESS
            done = env.job(job.id)
            assert done.attempt == 2 and [e["type"] for e in done.errors] == ["shutdown"]
        finally:
            leaving.stop()
            if other is not None:
                other.stop()
