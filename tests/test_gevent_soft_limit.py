"""The soft time limit on Celery's gevent pool, which Celery does not enforce there: OJS throws
``SoftTimeLimitExceeded`` into the attempt's greenlet at its ``timeout`` (``ctx.cancelled``
set), so a handler saves its checkpoint in the grace period as on prefork, and the limit is held
during the attempt's store writes. Needs gevent (a test dependency)."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from billiard.exceptions import SoftTimeLimitExceeded

from ojs_celery import enqueue, softlimit
from tests.conftest import Env, start_env
from tests.e2eapp import SLOW_TYPE
from tests.test_arrival_limits import runs, slowed
from tests.test_e2e_core import check_execution_timeout_grace_period_and_checkpoint
from tests.test_store_faults import PrivateRedis
from tests.workers import wait_for

gevent = pytest.importorskip("gevent")
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with start_env("redis", tmp_path_factory.mktemp("gevent-soft"), pool="gevent",
                   concurrency=20, config={"slow_bookkeeping": True}) as started:
        yield started


def test_execution_timeout_grace_period_and_checkpoint_on_gevent(env: Env) -> None:
    """What tests/test_e2e_core.py checks on prefork, on a real ``celery worker -P gevent``:
    the cancellation at ``timeout``, a checkpoint and a return in the grace period, Celery's
    hard limit at timeout + grace, and the limit that escapes the handler."""
    check_execution_timeout_grace_period_and_checkpoint(env)


def test_concurrent_greenlets_each_get_their_own_limit(env: Env) -> None:
    """20 attempts at once, with limits of 1 to 4 s: each handler is cancelled at its own
    limit, in its own job (``ctx.cancelled`` set), returns in the grace period, and no
    attempt's hold is left in the worker after them (one: the probe's own)."""
    jobs = [(enqueue({"type": "e2e.timed", "args": [30], "timeout": 1 + i % 4,
                      "grace_period": 5, "retry": {"max_attempts": 1}}, app=env.app).id,
             1 + i % 4) for i in range(20)]
    for job_id, limit in jobs:
        done = env.wait_state(job_id, "completed", "discarded", timeout=60)
        assert (done.state, done.errors) == ("completed", []), done.errors
        result = done.result
        assert isinstance(result, dict)
        assert result["job"] == job_id and result["cancelled"] is True
        assert limit - 0.2 <= float(result["after"]) < limit + 1.5, (limit, result)
    probe = enqueue({"type": "e2e.soft_limit_holds", "args": [], "timeout": 10}, app=env.app)
    assert env.wait_state(probe.id, "completed").result == 1


def test_time_limits_in_the_bookkeeping_end_in_an_outcome_on_gevent(env: Env) -> None:
    """What tests/test_arrival_limits.py checks of the soft limit on prefork: fired while the
    start's write waits (before or after it commits), the attempt started and timed out, and
    the retry completes (never ``available`` at attempt 0); fired while the outcome's write
    waits, the handler's result stands (never left ``active``)."""
    before = slowed(env, "start", 4, grace=6)
    after = slowed(env, "started", 4, grace=6)
    outcome = slowed(env, "complete", 4, grace=6)
    for job_id in (before, after):
        done = env.wait_state(job_id, "completed", timeout=60)
        assert done.attempt == 2
        assert [(e["attempt"], e["type"]) for e in done.errors] == [(1, "timeout")]
        assert runs(env, job_id) == [f"{SLOW_TYPE} {job_id} attempt=2"]
    done = env.wait_state(outcome, "completed", timeout=60)
    assert (done.attempt, done.errors, done.result) == (1, [], "ok on 1")


def test_a_soft_limit_while_the_store_is_paused_in_the_outcomes_write(
    tmp_path: pathlib.Path
) -> None:
    """The job store (a private redis-server) pauses all clients just before the handler
    returns, past the job's 1 s limit: the outcome's write waits, the limit fires meanwhile and
    is moot; the job completes as attempt 1, not left ``active`` nor timed out."""
    (tmp_path / "redis").mkdir()
    server = PrivateRedis(tmp_path / "redis")
    try:
        with start_env("redis", tmp_path, pool="gevent", concurrency=5,
                       config={"ojs": {"store_url": server.url}}) as paused:
            job = enqueue({"type": "e2e.sleep", "args": [0.6, "done"], "timeout": 1,
                           "grace_period": 6,
                           "retry": {"max_attempts": 2, "initial_interval": "PT0.1S"}},
                          app=paused.app)
            wait_for(lambda: any(job.id in line for line in paused.lines("runs")), 15,
                     "the handler's first line")
            server.admin.execute_command("CLIENT", "PAUSE", 2500, "ALL")
            done = paused.wait_state(job.id, "completed", "retryable", "discarded", timeout=30)
            assert (done.state, done.attempt, done.errors, done.result) == (
                "completed", 1, [], "done")
            assert f"sleep {job.id} attempt=1" in paused.lines("finished")
    finally:
        server.stop()


def test_self_retry_at_the_soft_limit(env: Env) -> None:
    job = enqueue({"type": "e2e.retries_at_its_limit", "args": [30], "timeout": 1,
                   "grace_period": 5, "retry": {"max_attempts": 3, "initial_interval": "PT0.1S"}},
                  app=env.app)
    done = env.wait_state(job.id, "completed", "discarded", timeout=30)
    assert (done.state, done.result, done.attempt) == ("completed", "ok on 2", 2)


def test_a_celery_callers_soft_time_limit_is_raised_on_gevent(env: Env) -> None:
    """README, "Time limits": ``soft_time_limit=1, time_limit=2`` on the task."""
    result = env.app.tasks["e2e.celery_time_limit"].apply_async(("gevent",))
    done = env.wait_state(result.id, "discarded", "retryable", "completed", timeout=30)
    assert done.errors and done.errors[0]["type"] == "timeout"
    assert float(done.errors[0]["elapsed_seconds"]) < 1.9  # the soft limit, not the hard one


@pytest.mark.parametrize("pool", ["prefork", "gevent"])
def test_a_handler_calling_its_own_task_directly_keeps_its_attempt(
    env: Env, tmp_path: pathlib.Path, pool: str
) -> None:
    """``self(...)`` in a handler is a direct call, as in Celery: not the message's attempt
    started again (the store refused that as not the job's, and the job ended cancelled) and,
    on gevent, not a new soft-limit hold replacing the attempt's (its limit was lost)."""
    def check(on: Env) -> None:
        job = enqueue({"type": "e2e.calls_itself", "args": [30], "timeout": 1,
                       "grace_period": 5, "retry": {"max_attempts": 1}}, app=on.app)
        done = on.wait_state(job.id, "completed", "discarded", "cancelled", timeout=30)
        assert (done.state, done.result, done.errors) == ("completed", "cancelled after inner",
                                                          [])

    if pool == "gevent":
        check(env)
        return
    with start_env("redis", tmp_path, concurrency=1) as prefork:
        check(prefork)


def in_greenlet(body: Any) -> tuple[str, float]:
    """Run ``body`` in a gevent greenlet as Celery's gevent pool runs a task; what it came to
    (its return value or the name of what it raised) and how long it took."""
    def run() -> tuple[str, float]:
        began = time.monotonic()
        try:
            return str(body()), time.monotonic() - began
        except SoftTimeLimitExceeded:
            return "SoftTimeLimitExceeded", time.monotonic() - began
        finally:
            softlimit.forget()

    return gevent.spawn(run).get(timeout=10)  # type: ignore[no-any-return]


def test_the_limit_is_thrown_at_the_greenlet_s_next_switch() -> None:
    def body() -> str:
        softlimit.begin("job-a", (None, 0.2))
        softlimit.release()  # the handler's first line
        gevent.sleep(5)
        return "slept"

    outcome, took = in_greenlet(body)
    assert outcome == "SoftTimeLimitExceeded" and 0.15 <= took < 2


def test_a_limit_that_fires_while_held_is_raised_at_the_release() -> None:
    """The start's store write outlasts the limit: the handler's first line times out."""
    def body() -> str:
        softlimit.begin("job-b", (None, 0.1))
        gevent.sleep(0.3)  # the start's write, waiting on the store: nothing is thrown here
        softlimit.release()
        return "ran"

    outcome, took = in_greenlet(body)
    assert outcome == "SoftTimeLimitExceeded" and took >= 0.3


def test_a_limit_that_fires_during_the_outcome_s_write_is_moot() -> None:
    def body() -> str:
        softlimit.begin("job-c", (None, 0.1))
        softlimit.release()
        softlimit.hold()  # the handler returned: its outcome's write
        gevent.sleep(0.3)
        return "written"

    assert in_greenlet(body)[0] == "written"


def test_an_ended_attempt_s_timer_never_fires() -> None:
    def first() -> str:
        softlimit.begin("job-d", (None, 0.1))
        softlimit.release()
        return "done"

    assert in_greenlet(first)[0] == "done"
    assert in_greenlet(lambda: gevent.sleep(0.3) or "later")[0] == "later"
    assert not softlimit.runs_here("job-d")


def test_the_drain_s_cancel_reaches_only_its_job_s_greenlet() -> None:
    """Two attempts without a soft limit: :func:`softlimit.cancel` of one throws into its
    greenlet alone."""
    def attempt(job_id: str) -> str:
        softlimit.begin(job_id, (None, None))
        softlimit.release()
        gevent.sleep(1)
        return "finished"

    cancelled = gevent.spawn(in_greenlet, lambda: attempt("job-e"))
    left = gevent.spawn(in_greenlet, lambda: attempt("job-f"))
    gevent.sleep(0.1)
    assert softlimit.runs_here("job-e") and softlimit.runs_here("job-f")
    softlimit.cancel("job-e")
    assert cancelled.get(timeout=5)[0] == "SoftTimeLimitExceeded"
    assert left.get(timeout=5)[0] == "finished"


def test_outside_gevent_the_hold_is_the_process_s() -> None:
    """A prefork child, solo or threads: no greenlet, no timer; the one hold of the process."""
    softlimit.begin("job-g", (None, 0.05))
    try:
        time.sleep(0.1)
        assert not softlimit.runs_here("job-g")
        softlimit.release()  # nothing fired: billiard's signal is the only soft limit here
    finally:
        softlimit.forget()
