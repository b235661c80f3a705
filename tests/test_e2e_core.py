"""End to end on every broker: OJS JSON jobs run on a real prefork ``celery worker``."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from celery.result import AsyncResult

from ojs_celery import enqueue
from tests.conftest import Env
from tests.workers import wait_for


def test_json_job_completes_with_result_and_events(env: Env) -> None:
    job = enqueue(json.dumps({"type": "e2e.add", "args": [2, 3]}), app=env.app)
    assert job.state == "available"

    done = env.wait_state(job.id, "completed")
    assert done.result == 5
    assert done.attempt == 1
    assert done.started_at is not None and done.completed_at is not None
    assert AsyncResult(job.id, app=env.app).get(timeout=10) == 5
    types = env.wait_events(job.id, lambda t: {"job.enqueued", "job.completed"} <= set(t))
    # the producer's and the worker's buses publish apart: only each one's own order is given
    assert sorted(types) == ["job.completed", "job.enqueued", "job.started"]
    assert types.index("job.started") < types.index("job.completed")
    started = env.events.of(job.id, "job.started")[0]
    assert started["specversion"] == "1.0" and started["id"].startswith("evt_")
    assert started["data"]["worker_id"].startswith("worker_")


def test_every_event_of_a_job_with_trace_context_carries_its_trace_id(env: Env) -> None:
    """OJS: "if the job has trace context, every event for it MUST carry data.trace_id"; from
    meta.trace_id, or from a W3C meta.traceparent."""
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    given = enqueue({"type": "e2e.fail_until", "args": [2], "meta": {"trace_id": trace},
                     "retry": {"initial_interval": "PT0.1S", "jitter": False}}, app=env.app)
    parented = enqueue({"type": "e2e.add", "args": [1, 1], "meta": {
        "traceparent": f"00-{trace}-00f067aa0ba902b7-01"}}, app=env.app)
    for job, last in ((given, "job.completed"), (parented, "job.completed")):
        env.wait_state(job.id, "completed")
        types = env.wait_events(job.id, lambda t, last=last: "job.enqueued" in t and last in t)
        assert len(types) >= 3
        assert [e["data"].get("trace_id") for e in env.events.of(job.id)] == [trace] * len(types)
    assert "job.failed" in env.events.types(given.id)


def test_scheduled_and_heartbeat_events_reach_the_bus(env: Env) -> None:
    """OJS's catalog: job.scheduled for a job that waits for its scheduled_at, job.heartbeat
    for the worker beats that keep a running attempt alive (the first one within a
    heartbeat_interval, 5 s, of the start)."""
    soon = (datetime.now(timezone.utc) + timedelta(seconds=1)).isoformat()
    scheduled = enqueue({"type": "e2e.add", "args": [1, 2], "scheduled_at": soon}, app=env.app)
    long = enqueue({"type": "e2e.sleep", "args": [8]}, app=env.app)
    env.wait_events(scheduled.id, lambda t: "job.completed" in t)
    assert env.events.types(scheduled.id)[:2] == ["job.enqueued", "job.scheduled"]
    env.wait_state(long.id, "completed", timeout=60)
    types = env.wait_events(long.id, lambda t: "job.completed" in t and "job.heartbeat" in t)
    beat = env.events.of(long.id, "job.heartbeat")[0]["data"]
    assert beat["attempt"] == 1 and beat["worker_id"].startswith("worker_")
    assert "visible_until" in beat and types.index("job.started") < types.index("job.heartbeat")


def test_an_attempt_cut_short_by_total_timeout_reads_total_timeout_not_execution(
    env: Env,
) -> None:
    """The hard limit is clamped to the job's total deadline: the kill there, inside the
    execution timeout's grace period (the handler saved a checkpoint and ran on), is the total
    timeout's (OJS: an execution timeout is past timeout + grace_period)."""
    job = enqueue({"type": "e2e.checkpointing", "args": ["overrun"], "timeout": 1,
                   "grace_period": 10, "total_timeout": 3}, app=env.app)
    done = env.wait_state(job.id, "discarded", timeout=30)
    assert done.error is not None and done.error["type"] == "total_timeout"
    assert [e["type"] for e in done.errors] == ["total_timeout"]
    types = env.wait_events(job.id, lambda t: "job.discarded" in t)
    assert "job.total_timeout" in types and "job.timeout" not in types


def test_failing_job_retries_with_backoff_then_completes(env: Env) -> None:
    job = enqueue(
        {"type": "e2e.fail_until", "args": [3],
         "retry": {"max_attempts": 5, "initial_interval": "PT0.2S", "backoff_coefficient": 2.0}},
        app=env.app,
    )
    done = env.wait_state(job.id, "completed")
    assert done.attempt == 3
    assert done.result == "ok on 3"
    assert [(e["attempt"], e["type"]) for e in done.errors] == [
        (1, "ConnectionError"), (2, "ConnectionError")]
    types = env.wait_events(job.id, lambda t: "job.completed" in t)
    assert types.count("job.retrying") == 2 and types.count("job.failed") == 2
    delays = [e["data"]["delay_seconds"] for e in env.events.of(job.id, "job.retrying")]
    # 0.2 s, then 0.4 s, × jitter in [0.5, 1.5); the event rounds to the millisecond, so the
    # upper bound itself can be reported
    assert 0.1 <= delays[0] <= 0.3
    assert 0.2 <= delays[1] <= 0.6
    assert AsyncResult(job.id, app=env.app).get(timeout=10) == "ok on 3"


def test_exhausted_job_is_discarded_and_celery_sees_failure(env: Env) -> None:
    job = enqueue(
        {"type": "e2e.fail_until", "args": [99],
         "retry": {"max_attempts": 2, "initial_interval": "PT0.1S"}},
        app=env.app,
    )
    done = env.wait_state(job.id, "discarded")
    assert done.attempt == 2
    assert done.error is not None and done.error["type"] == "ConnectionError"
    assert len(done.errors) == 2
    types = env.wait_events(job.id, lambda t: "job.discarded" in t)
    assert types[-1] == "job.discarded"
    result = AsyncResult(job.id, app=env.app)
    wait_for(lambda: result.state == "FAILURE", 10, "FAILURE in the result backend")


def test_execution_timeout_grace_period_and_checkpoint(env: Env) -> None:
    check_execution_timeout_grace_period_and_checkpoint(env)


def check_execution_timeout_grace_period_and_checkpoint(env: Env) -> None:
    """Soft signal at `timeout`, checkpoint in the grace period, kill at timeout + grace."""
    common = {"timeout": 1, "grace_period": 1}
    overrun = enqueue({"type": "e2e.checkpointing", "args": ["overrun"], **common,
                       "retry": {"max_attempts": 2, "initial_interval": "PT0.1S"}}, app=env.app)
    in_grace = enqueue({"type": "e2e.checkpointing", "args": ["return"], **common}, app=env.app)
    escape = enqueue({"type": "e2e.checkpointing", "args": ["escape"], **common,
                      "retry": {"max_attempts": 1}}, app=env.app)

    finished = env.wait_state(in_grace.id, "completed")
    assert finished.result == "finished in grace"
    assert finished.errors == []

    escaped = env.wait_state(escape.id, "discarded")
    assert escaped.error is not None
    assert escaped.error["type"] == "timeout"
    assert escaped.error["timeout_kind"] == "execution"

    done = env.wait_state(overrun.id, "discarded", timeout=40)
    assert done.attempt == 2
    assert [e["type"] for e in done.errors] == ["timeout", "timeout"]
    for error in done.errors:
        assert error["timeout_kind"] == "execution"
        assert error["limit_seconds"] == 1
        assert 1.5 <= float(error["elapsed_seconds"]) < 10  # type: ignore[arg-type]
    assert done.last_checkpoint == {"attempt": 2}
    runs = [line for line in env.lines("runs") if overrun.id in line]
    assert runs[1].endswith('last_checkpoint={"attempt": 1}')  # attempt 2 resumed from it
    cancelled = [line for line in env.lines("cancelled") if overrun.id in line]
    assert cancelled == [f"{overrun.id} attempt=1 cancelled=True",
                         f"{overrun.id} attempt=2 cancelled=True"]
    env.wait_events(overrun.id, lambda t: "job.discarded" in t)
    timeouts = env.events.of(overrun.id, "job.timeout")
    assert [e["data"]["attempt"] for e in timeouts] == [1, 2]
    assert timeouts[0]["data"]["timeout_kind"] == "execution"
    result = AsyncResult(overrun.id, app=env.app)
    wait_for(lambda: result.state == "FAILURE", 10, "FAILURE in the result backend")
