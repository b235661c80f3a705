"""A time limit that fires in the bookkeeping of an attempt (its start, its outcome's write) is
still an outcome: the job ends ``timeout`` and is retried, or it is dispatched again, or its
outcome stands. It never stays ``available`` at attempt 0, nor ``active`` after its handler
returned.

The jobs' own store writes are slowed by the worker's app (``e2eapp.slow_bookkeeping``), as on
the loaded machine where a 2 s job got ``SoftTimeLimitExceeded`` inside its start.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from celery.result import AsyncResult

from ojs_celery import enqueue
from tests.conftest import Env, start_env
from tests.e2eapp import SLOW_TYPE
from tests.workers import wait_for


@pytest.fixture
def env(tmp_path: pathlib.Path) -> Iterator[Env]:
    with start_env("filesystem", tmp_path, concurrency=5,
                   config={"slow_bookkeeping": True}) as started:
        yield started


def slowed(env: Env, where: str, seconds: float, grace: int) -> str:
    envelope: dict[str, Any] = {
        "type": SLOW_TYPE, "args": [where, seconds], "timeout": 1, "grace_period": grace,
        "retry": {"max_attempts": 2, "initial_interval": "PT0.1S"}}
    return enqueue(envelope, app=env.app).id


def runs(env: Env, job_id: str) -> list[str]:
    return [line for line in env.lines("runs") if job_id in line]


def test_time_limits_in_the_bookkeeping_end_in_an_outcome(env: Env) -> None:
    # The soft limit (1 s) fires while the start write is slowed, before or after it commits:
    # the attempt started, so it timed out, and the retry completes.
    before = slowed(env, "start", 4, grace=6)
    after = slowed(env, "started", 4, grace=6)
    # ... while the outcome's write is slowed: the handler had returned, its result stands.
    outcome = slowed(env, "complete", 4, grace=6)
    # The hard limit (2 s) kills the child inside the start write: the attempt never started,
    # so the message goes back to the broker and the job runs once.
    killed = slowed(env, "start", 8, grace=1)
    # ... inside the outcome's write: the main process fails the attempt by its token.
    killed_late = slowed(env, "complete", 8, grace=1)

    for job_id in (before, after):
        done = env.wait_state(job_id, "completed", timeout=60)
        assert done.attempt == 2
        assert [(e["attempt"], e["type"]) for e in done.errors] == [(1, "timeout")]
        # the error says why a 1 s limit fired before the handler ran at all
        assert "the start waited 4." in str(done.errors[0]["message"]), done.errors
        assert runs(env, job_id) == [f"{SLOW_TYPE} {job_id} attempt=2"]

    done = env.wait_state(outcome, "completed", timeout=60)
    assert (done.attempt, done.errors, done.result) == (1, [], "ok on 1")
    result = AsyncResult(outcome, app=env.app)
    wait_for(lambda: result.state == "SUCCESS", 10, "SUCCESS in the result backend")

    done = env.wait_state(killed, "completed", timeout=60)
    assert (done.attempt, done.errors) == (1, [])
    assert runs(env, killed) == [f"{SLOW_TYPE} {killed} attempt=1"]

    done = env.wait_state(killed_late, "completed", timeout=60)
    assert done.attempt == 2
    assert [(e["attempt"], e["type"]) for e in done.errors] == [(1, "timeout")]


def test_a_start_whose_reply_timed_out_is_known_as_its_own(env: Env) -> None:
    """The store ran a start whose reply never came (StoreTimeout): the pool process tries the
    start once more and recognises its own write, so the job runs now, once, as attempt 1,
    instead of its message going back to find the job started by nobody (which would wait for
    the stall clock and count a failed attempt)."""
    job_id = enqueue({"type": SLOW_TYPE, "args": ["start-unanswered", 0], "timeout": 30},
                     app=env.app).id
    done = env.wait_state(job_id, "completed", timeout=30)
    assert (done.attempt, done.errors) == (1, [])
    assert runs(env, job_id) == [f"{SLOW_TYPE} {job_id} attempt=1"]
