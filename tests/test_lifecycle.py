"""Pure lifecycle rules: backoff, retry decision, every transition, events and deadlines."""

from __future__ import annotations

import random
from typing import Any

import pytest

from ojs_celery import lifecycle
from ojs_celery.envelope import Job, RetryPolicy, format_timestamp, from_epoch, parse_envelope
from ojs_celery.lifecycle import (
    CLOCKS,
    DAY,
    Decision,
    Policy,
    Publish,
    Record,
    Transition,
    ack_dispatch,
    backoff_delay,
    cancel,
    complete,
    create,
    deadlines,
    decide,
    expire_total,
    expire_ttl,
    fail,
    heartbeat,
    make_error,
    matches_non_retryable,
    start,
    timeout_error,
)

T0 = 1_800_000_000.0
POLICY = Policy()
W1 = "worker-1"
W2 = "worker-2"


def ts(seconds: float) -> str:
    return format_timestamp(from_epoch(seconds))


def make_job(**fields: Any) -> Job:
    data: dict[str, Any] = {"type": "email.send", "queue": "emails", "args": [1]}
    data.update(fields)
    return parse_envelope(data)


def created(now: float = T0, policy: Policy = POLICY, **fields: Any) -> Record:
    transition = create(make_job(**fields), now, policy)
    assert transition.record is not None
    return transition.record


def started(at: float = T0 + 1, worker: str = W1, **fields: Any) -> Record:
    transition = start(created(**fields), 1, worker, at, POLICY)
    assert transition.record is not None
    assert transition.record.job.state == "active"
    return transition.record


def applied(transition: Transition) -> Record:
    assert transition.applied, transition.reason
    assert transition.record is not None
    return transition.record


def names(transition: Transition) -> list[str]:
    return [name for name, _ in transition.events]


def event(transition: Transition, name: str) -> dict[str, Any]:
    found = [data for n, data in transition.events if n == name]
    assert len(found) == 1, (name, names(transition))
    return found[0]


def policy(**fields: Any) -> RetryPolicy:
    return RetryPolicy(**fields)


def no_jitter(**fields: Any) -> dict[str, Any]:
    return {"retry": {"jitter": False, **fields}}


# --------------------------------------------------------------------------- backoff


@pytest.mark.parametrize(("n", "expected"), [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (9, 256.0)])
def test_backoff_exponential_formula(n: int, expected: float) -> None:
    assert backoff_delay(policy(jitter=False), n) == expected


def test_backoff_formula_other_parameters() -> None:
    p = policy(jitter=False, initial_interval="PT0.5S", backoff_coefficient=3.0)
    assert [backoff_delay(p, n) for n in (1, 2, 3)] == [0.5, 1.5, 4.5]
    linear = policy(jitter=False, initial_interval="PT7S", backoff_coefficient=1.0)
    assert backoff_delay(linear, 5) == 7.0


def test_backoff_beyond_a_float_is_the_cap() -> None:
    """A long policy's growth (2 ** 1100) passes a float's range: the delay is the cap, not an
    OverflowError that would leave the attempt's outcome unwritten."""
    long = policy(max_attempts=5000, max_interval="PT10M")
    assert backoff_delay(long, 1100, rand=lambda: 0.99) == 600.0
    assert backoff_delay(policy(jitter=False, max_interval="PT10M"), 3000) == 600.0


def test_backoff_capped_at_max_interval() -> None:
    assert backoff_delay(policy(jitter=False), 10) == 300.0  # 512 s capped to PT5M
    p = policy(jitter=False, max_interval="PT3S")
    assert [backoff_delay(p, n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, 3.0]


def test_backoff_retry_number_below_one_is_initial() -> None:
    assert backoff_delay(policy(jitter=False), 0) == 1.0


@pytest.mark.parametrize(("r", "factor"), [(0.0, 0.5), (0.25, 0.75), (0.5, 1.0), (0.999, 1.499)])
def test_backoff_jitter_factor(r: float, factor: float) -> None:
    delay = backoff_delay(policy(), 3, rand=lambda: r)  # 4 s before jitter
    assert delay == pytest.approx(4.0 * factor)


def test_backoff_jitter_applied_after_pre_cap() -> None:
    p = policy(max_interval="PT10S")
    # 16 s capped to 10 s first, then jittered down to 5 s (not 8 s).
    assert backoff_delay(p, 5, rand=lambda: 0.0) == 5.0


def test_backoff_post_jitter_cap() -> None:
    p = policy(initial_interval="PT8S", max_interval="PT10S")
    assert backoff_delay(p, 1, rand=lambda: 0.99) == 10.0  # 8 * 1.49 = 11.92 -> 10
    assert backoff_delay(p, 1, rand=lambda: 0.2) == pytest.approx(5.6)


def test_backoff_jitter_range_with_real_random() -> None:
    rng = random.Random(1234)
    values = [backoff_delay(policy(), 2, rand=rng.random) for _ in range(500)]
    assert all(1.0 <= v < 3.0 for v in values)
    assert min(values) < 1.2 and max(values) > 2.8


def test_backoff_no_jitter_does_not_call_rand() -> None:
    def boom() -> float:
        raise AssertionError("rand called")

    assert backoff_delay(policy(jitter=False), 2, rand=boom) == 2.0


# --------------------------------------------------------------------------- non-retryable


@pytest.mark.parametrize(
    ("error_type", "patterns", "expected"),
    [
        ("ValueError", ["ValueError"], True),
        ("ValueError", ["KeyError", "ValueError"], True),
        ("ValueError", ["valueerror"], False),
        ("ValueErrorX", ["ValueError"], False),
        ("auth.x", ["auth.*"], True),
        ("auth.token.expired", ["auth.*"], True),
        ("auth", ["auth.*"], False),
        ("external.auth.x", ["auth.*"], False),
        ("authx", ["auth.*"], False),
        ("auth.x", ["auth"], False),
        ("auth.x", ["auth.x"], True),
        ("anything", [], False),
    ],
)
def test_matches_non_retryable(error_type: str, patterns: list[str], expected: bool) -> None:
    assert matches_non_retryable(error_type, patterns) is expected


# --------------------------------------------------------------------------- decide


def job_with(attempt: int, now: float = T0, **fields: Any) -> Job:
    job = applied(create(make_job(**fields), now, POLICY)).job
    job.attempt = attempt
    return job


def test_decide_retry_with_backoff_of_retry_number() -> None:
    job = job_with(1, **no_jitter())
    assert decide(job, "ValueError", T0 + 5) == Decision(retry=True, delay=1.0)
    job.attempt = 2
    assert decide(job, "ValueError", T0 + 5) == Decision(retry=True, delay=2.0)


def test_decide_uses_rand_for_jitter() -> None:
    job = job_with(2)
    assert decide(job, "ValueError", T0, rand=lambda: 0.0).delay == 1.0


def test_decide_explicit_delay_overrides_backoff() -> None:
    job = job_with(1)
    assert decide(job, "Retry", T0, delay=42.0) == Decision(retry=True, delay=42.0)
    assert decide(job, "Retry", T0, delay=-3.0) == Decision(retry=True, delay=0.0)


@pytest.mark.parametrize(
    ("max_attempts", "attempt", "retry"),
    [
        (3, 1, True),
        (3, 2, True),
        (3, 3, False),
        (3, 4, False),
        (1, 1, False),
        (0, 1, False),
        (2, 1, True),
    ],
)
def test_decide_max_attempts(max_attempts: int, attempt: int, retry: bool) -> None:
    job = job_with(attempt, retry={"max_attempts": max_attempts})
    assert decide(job, "ValueError", T0).retry is retry


def test_decide_non_retryable_exact_and_prefix() -> None:
    job = job_with(1, retry={"max_attempts": 10, "non_retryable_errors": ["KeyError", "auth.*"]})
    assert decide(job, "KeyError", T0) == Decision(retry=False)
    assert decide(job, "auth.expired", T0) == Decision(retry=False)
    assert decide(job, "auth", T0).retry is True
    assert decide(job, "ValueError", T0).retry is True


@pytest.mark.parametrize("error_type", ["total_timeout", "enqueue_ttl_expired"])
def test_decide_never_retries_deadline_errors(error_type: str) -> None:
    assert decide(job_with(1, retry={"max_attempts": 10}), error_type, T0).retry is False


def test_decide_timeout_is_retryable_by_default() -> None:
    assert decide(job_with(1), "timeout", T0).retry is True
    assert decide(job_with(1), "stalled", T0).retry is True
    job = job_with(1, retry={"non_retryable_errors": ["timeout"]})
    assert decide(job, "timeout", T0).retry is False


def test_decide_total_timeout_rule_boundary() -> None:
    # created_at + total (T0+100) < now + backoff + timeout -> discard.
    job = job_with(1, timeout=10, total_timeout=100)
    now = T0 + 50
    assert decide(job, "ValueError", now, delay=40.0) == Decision(retry=True, delay=40.0)
    decision = decide(job, "ValueError", now, delay=40.5)
    assert decision.retry is False
    assert decision.total_timeout_error == {
        "type": "total_timeout",
        "message": decision.total_timeout_error["message"],  # type: ignore[index]
        "timeout_kind": "total",
        "limit_seconds": 100,
        "elapsed_seconds": 50.0,
        "code": "HANDLER_TIMEOUT",
    }
    assert "100" in str(decision.total_timeout_error["message"])


def test_decide_total_timeout_rule_uses_backoff() -> None:
    job = job_with(3, timeout=10, total_timeout=100, retry={"max_attempts": 5, "jitter": False})
    # retry 3: backoff 4 s; 50 + 4 + 10 = 64 <= 100 -> retry; at 87: 87 + 4 + 10 = 101 > 100.
    assert decide(job, "E", T0 + 50) == Decision(retry=True, delay=4.0)
    assert decide(job, "E", T0 + 87).total_timeout_error is not None


def test_decide_without_total_timeout_has_no_deadline() -> None:
    job = job_with(1, timeout=10)
    assert decide(job, "E", T0 + 10 * DAY, delay=DAY).retry is True


def test_decide_max_attempts_beats_total_timeout_error() -> None:
    job = job_with(3, timeout=10, total_timeout=100)
    assert decide(job, "E", T0 + 99) == Decision(retry=False)


# --------------------------------------------------------------------------- error helpers


def test_make_error_drops_none_extras() -> None:
    assert make_error("ValueError", "bad", backtrace=None, code="X") == {
        "type": "ValueError",
        "message": "bad",
        "code": "X",
    }


@pytest.mark.parametrize(
    ("type_", "kind"),
    [
        ("timeout", "execution"),
        ("total_timeout", "total"),
        ("enqueue_ttl_expired", "enqueue_ttl"),
        ("stalled", "stalled"),
    ],
)
def test_timeout_error_shape(type_: str, kind: str) -> None:
    assert timeout_error(type_, 30, 31.23456, "msg") == {
        "type": type_,
        "message": "msg",
        "timeout_kind": kind,
        "limit_seconds": 30,
        "elapsed_seconds": 31.235,
        "code": "HANDLER_TIMEOUT",
    }


# --------------------------------------------------------------------------- create


def test_create_available() -> None:
    job = make_job()
    transition = create(job, T0, POLICY)
    record = applied(transition)
    j = record.job
    assert j.state == "available"
    assert j.attempt == 0
    assert j.created_at == from_epoch(T0)
    assert j.enqueued_at == j.created_at
    assert record.token == 1
    assert record.dispatch_due == T0 + POLICY.dispatch_grace
    assert record.promote_at is None
    assert transition.publish == Publish(j.id, 1, None)
    assert names(transition) == ["job.enqueued"]
    assert event(transition, "job.enqueued") == {
        "job_id": j.id,
        "job_type": "email.send",
        "queue": "emails",
        "state": "available",
        "priority": 0,
    }
    # The input job is not modified.
    assert job.created_at is None


def test_create_with_past_scheduled_at_is_available() -> None:
    transition = create(make_job(scheduled_at=ts(T0 - 60)), T0, POLICY)
    record = applied(transition)
    assert record.job.state == "available"
    assert transition.publish is not None
    assert transition.publish.eta is None
    assert event(transition, "job.enqueued")["scheduled_at"] == ts(T0 - 60)


def test_create_scheduled_within_horizon_publishes_with_eta() -> None:
    transition = create(make_job(scheduled_at=ts(T0 + 30)), T0, POLICY)
    record = applied(transition)
    assert record.job.state == "scheduled"
    assert record.job.enqueued_at is None
    assert transition.publish == Publish(record.job.id, 1, T0 + 30)
    assert record.dispatch_due == T0 + 30 + POLICY.dispatch_grace
    assert record.promote_at is None
    data = event(transition, "job.enqueued")
    assert data["state"] == "scheduled"
    assert data["scheduled_at"] == ts(T0 + 30)
    assert names(transition) == ["job.enqueued", "job.scheduled"]  # OJS: job.scheduled too


def test_create_scheduled_beyond_horizon_is_held() -> None:
    transition = create(make_job(scheduled_at=ts(T0 + 3600)), T0, POLICY)
    record = applied(transition)
    assert record.job.state == "scheduled"
    assert transition.publish is None
    assert record.promote_at == T0 + 3600
    assert record.dispatch_due is None
    assert names(transition) == ["job.enqueued", "job.scheduled"]
    assert event(transition, "job.scheduled")["scheduled_at"] == ts(T0 + 3600)


def test_create_horizon_comes_from_policy() -> None:
    short = Policy(schedule_horizon=5.0, dispatch_grace=1.0)
    held = create(make_job(scheduled_at=ts(T0 + 30)), T0, short)
    assert held.publish is None
    assert applied(held).promote_at == T0 + 30
    near = create(make_job(scheduled_at=ts(T0 + 5)), T0, short)
    assert near.publish == Publish(applied(near).job.id, 1, T0 + 5)
    assert applied(near).dispatch_due == T0 + 6


# --------------------------------------------------------------------------- ack_dispatch


def test_ack_dispatch_clears_outbox_for_current_token() -> None:
    record = created()
    cleared = applied(ack_dispatch(record, 1))
    assert cleared.dispatch_due is None
    assert record.dispatch_due is not None  # the input record is not modified
    assert ack_dispatch(record, 2).reason == "stale"
    assert ack_dispatch(cleared, 1).reason == "stale"


# --------------------------------------------------------------------------- start


def test_start_available() -> None:
    record = created()
    transition = start(record, 1, W1, T0 + 5, POLICY)
    new = applied(transition)
    j = new.job
    assert j.state == "active"
    assert j.attempt == 1
    assert j.started_at == from_epoch(T0 + 5)
    assert j.enqueued_at == from_epoch(T0)
    assert new.worker_id == W1
    assert new.heartbeat_at == T0 + 5
    assert new.extended_at == T0 + 5
    assert new.dispatch_due is None
    assert new.promote_at is None
    assert new.token == 1
    assert transition.publish is None
    assert transition.events == [
        (
            "job.started",
            {
                "job_id": j.id,
                "job_type": "email.send",
                "queue": "emails",
                "state": "active",
                "worker_id": W1,
                "attempt": 1,
            },
        )
    ]
    assert record.job.state == "available"  # input untouched


def test_start_scheduled_sets_enqueued_at() -> None:
    record = created(scheduled_at=ts(T0 + 30))
    new = applied(start(record, 1, W1, T0 + 30, POLICY))
    assert new.job.state == "active"
    assert new.job.enqueued_at == from_epoch(T0 + 30)


def test_start_duplicate_message() -> None:
    record = started()
    assert start(record, 1, W2, T0 + 2, POLICY).reason == "duplicate"
    assert start(record, 1, W1, T0 + 2, POLICY).reason == "duplicate"


def test_start_stale_and_unknown_tokens() -> None:
    retrying = applied(fail(started(), 1, W1, make_error("E", "x"), T0 + 2, delay=1.0))
    assert retrying.token == 2
    assert start(retrying, 1, W1, T0 + 3, POLICY).reason == "stale"
    assert start(retrying, 3, W1, T0 + 3, POLICY).reason == "unknown_token"
    assert start(created(), 2, W1, T0 + 1, POLICY).reason == "unknown_token"
    again = applied(start(retrying, 2, W2, T0 + 3, POLICY))
    assert again.job.attempt == 2
    assert again.worker_id == W2


def test_start_rejected_in_terminal_states() -> None:
    done = applied(complete(started(), 1, W1, None, T0 + 2))
    assert start(done, 1, W1, T0 + 3, POLICY).reason == "terminal"
    cancelled = applied(cancel(created(), T0 + 1))
    assert start(cancelled, 1, W1, T0 + 3, POLICY).reason == "cancelled"
    discarded = applied(
        fail(started(retry={"max_attempts": 1}), 1, W1, make_error("E", "x"), T0 + 2)
    )
    assert start(discarded, 1, W1, T0 + 3, POLICY).reason == "terminal"


def test_start_rejected_when_pending() -> None:
    record = created()
    record.job.state = "pending"
    assert start(record, 1, W1, T0 + 1, POLICY).reason == "not_startable:pending"


def test_start_ttl_expired_discards() -> None:
    record = created(enqueue_ttl=30)
    transition = start(record, 1, W1, T0 + 30, POLICY)
    new = applied(transition)
    j = new.job
    assert j.state == "discarded"
    assert j.attempt == 0
    assert j.started_at is None
    assert j.discarded_at == from_epoch(T0 + 30)
    assert j.completed_at == from_epoch(T0 + 30)
    assert j.error == {
        "type": "enqueue_ttl_expired",
        "code": "HANDLER_TIMEOUT",
        "message": j.error["message"],  # type: ignore[index]
        "timeout_kind": "enqueue_ttl",
        "limit_seconds": 30,
        "elapsed_seconds": 30.0,
    }
    assert len(j.errors) == 1
    entry = j.errors[0]
    assert entry["code"] == "HANDLER_TIMEOUT"
    assert entry["type"] == "enqueue_ttl_expired"
    assert entry["attempt"] == 0  # it never started: the same attempt as the job's
    assert entry["occurred_at"] == ts(T0 + 30)
    assert new.worker_id is None
    assert new.dispatch_due is None
    assert transition.publish is None
    assert names(transition) == ["job.ttl_expired", "job.discarded"]
    expired = event(transition, "job.ttl_expired")
    assert expired["job_id"] == j.id
    assert expired["timeout_kind"] == "enqueue_ttl"
    assert expired["limit_seconds"] == 30
    assert expired["elapsed_seconds"] == 30.0
    assert expired["attempt"] == 0
    discarded = event(transition, "job.discarded")
    assert discarded["total_attempts"] == 0
    assert discarded["last_error"] == {"code": "HANDLER_TIMEOUT", "type": "enqueue_ttl_expired",
                                       "message": j.error["message"]}


def test_start_just_before_ttl_starts() -> None:
    record = created(enqueue_ttl=30)
    assert applied(start(record, 1, W1, T0 + 29.999, POLICY)).job.state == "active"


def test_ttl_does_not_apply_to_retries() -> None:
    first = started(enqueue_ttl=30)
    retrying = applied(fail(first, 1, W1, make_error("E", "x"), T0 + 2, delay=1.0))
    again = applied(start(retrying, 2, W1, T0 + 100, POLICY))
    assert again.job.state == "active"
    assert again.job.attempt == 2


def test_start_total_timeout_expired_discards() -> None:
    record = created(timeout=10, total_timeout=60)
    transition = start(record, 1, W1, T0 + 60, POLICY)
    j = applied(transition).job
    assert j.state == "discarded"
    assert j.error is not None
    assert j.error["type"] == "total_timeout"
    assert j.error["timeout_kind"] == "total"
    assert j.error["limit_seconds"] == 60
    assert names(transition) == ["job.total_timeout", "job.discarded"]


def test_start_total_timeout_wins_over_ttl() -> None:
    record = created(timeout=10, total_timeout=60, enqueue_ttl=30)
    transition = start(record, 1, W1, T0 + 61, POLICY)
    assert applied(transition).job.error["type"] == "total_timeout"  # type: ignore[index]


def test_start_after_expires_at_does_not_run() -> None:
    record = created(expires_at=ts(T0 + 10))
    transition = start(record, 1, W1, T0 + 20, POLICY)
    assert not (transition.record is not None and transition.record.job.state == "active")
    assert names(transition) == ["job.expired", "job.discarded"]
    assert event(transition, "job.expired")["ttl_ms"] == 10_000  # created at T0, expires T0 + 10


# --------------------------------------------------------------------------- heartbeat


def test_heartbeat_extends_clocks_for_owner() -> None:
    record = started(at=T0 + 1)
    new = applied(heartbeat(record, 1, W1, T0 + 20))
    assert new.heartbeat_at == T0 + 20
    assert new.extended_at == T0 + 20
    assert new.job.progress is None
    assert record.heartbeat_at == T0 + 1  # input untouched


def test_heartbeat_without_stall_extends_only_visibility() -> None:
    new = applied(heartbeat(started(at=T0 + 1), 1, W1, T0 + 20, stall=False))
    assert new.heartbeat_at == T0 + 1
    assert new.extended_at == T0 + 20


def test_a_worker_beat_extending_an_attempt_is_a_job_heartbeat_event() -> None:
    record = started(at=T0 + 1, visibility_timeout=120)
    transition = lifecycle.extend(record, record.token, W1, T0 + 20, stall=True)
    assert names(transition) == ["job.heartbeat"]
    data = event(transition, "job.heartbeat")
    assert data["worker_id"] == W1 and data["attempt"] == 1
    assert data["visible_until"] == ts(T0 + 140)
    assert lifecycle.extend(record, record.token + 1, W1, T0 + 20, stall=True).events == []
    # the handler's heartbeats are the job's (x_heartbeat, or the task's heartbeat="handler")
    assert lifecycle.extend(record, record.token, W1, T0 + 20, stall=False).events == []
    handler = started(at=T0 + 1, x_heartbeat="handler")
    assert lifecycle.extend(handler, handler.token, W1, T0 + 20, stall=True).events == []


def test_heartbeat_fencing() -> None:
    record = started()
    assert heartbeat(record, 1, W2, T0 + 2).reason == "not_owner"
    assert heartbeat(record, 2, W1, T0 + 2).reason == "stale_attempt"
    assert heartbeat(record, 0, W1, T0 + 2).reason == "stale_attempt"
    retrying = applied(fail(record, 1, W1, make_error("E", "x"), T0 + 3, delay=1.0))
    assert heartbeat(retrying, 1, W1, T0 + 4).reason == "not_active"
    done = applied(complete(record, 1, W1, 1, T0 + 3))
    assert heartbeat(done, 1, W1, T0 + 4).reason == "not_active"


def test_heartbeat_progress_clamped_and_monotonic() -> None:
    record = started()
    r1 = applied(heartbeat(record, 1, W1, T0 + 2, progress=0.6, data={"step": 1}))
    assert r1.job.progress == {"progress": 0.6, "data": {"step": 1}, "updated_at": ts(T0 + 2)}
    r2 = applied(heartbeat(r1, 1, W1, T0 + 3, progress=0.3))
    assert r2.job.progress is not None
    assert r2.job.progress["progress"] == 0.6
    assert r2.job.progress["data"] == {"step": 1}
    assert r2.job.progress["updated_at"] == ts(T0 + 3)
    r3 = applied(heartbeat(r2, 1, W1, T0 + 4, progress=1.7))
    assert r3.job.progress["progress"] == 1.0  # type: ignore[index]
    low = applied(heartbeat(record, 1, W1, T0 + 2, progress=-0.5))
    assert low.job.progress["progress"] == 0.0  # type: ignore[index]


def test_heartbeat_data_only_keeps_progress() -> None:
    r1 = applied(heartbeat(started(), 1, W1, T0 + 2, progress=0.4))
    r2 = applied(heartbeat(r1, 1, W1, T0 + 3, data="halfway"))
    assert r2.job.progress == {"progress": 0.4, "data": "halfway", "updated_at": ts(T0 + 3)}


def test_heartbeat_checkpoint() -> None:
    r1 = applied(heartbeat(started(), 1, W1, T0 + 2, checkpoint={"offset": 10}))
    assert r1.job.last_checkpoint == {"offset": 10}
    r2 = applied(heartbeat(r1, 1, W1, T0 + 3))
    assert r2.job.last_checkpoint == {"offset": 10}


def test_progress_reset_on_next_attempt_checkpoint_kept() -> None:
    r1 = applied(heartbeat(started(), 1, W1, T0 + 2, progress=0.5, checkpoint=3))
    retrying = applied(fail(r1, 1, W1, make_error("E", "x"), T0 + 3, delay=1.0))
    again = applied(start(retrying, 2, W1, T0 + 5, POLICY))
    assert again.job.progress is None
    assert again.job.last_checkpoint == 3


# --------------------------------------------------------------------------- complete


def test_complete_by_owner() -> None:
    record = started(at=T0 + 1)
    transition = complete(record, 1, W1, {"sent": True}, T0 + 3.5)
    new = applied(transition)
    j = new.job
    assert j.state == "completed"
    assert j.completed_at == from_epoch(T0 + 3.5)
    assert j.result == {"sent": True}
    assert j.error is None
    assert j.attempt == 1
    assert new.worker_id is None
    assert transition.publish is None
    assert transition.events == [
        (
            "job.completed",
            {
                "job_id": j.id,
                "job_type": "email.send",
                "queue": "emails",
                "state": "completed",
                "duration_ms": 2500,
                "attempt": 1,
            },
        )
    ]


def test_complete_sets_progress_to_one_if_reported() -> None:
    r1 = applied(heartbeat(started(), 1, W1, T0 + 2, progress=0.4))
    assert applied(complete(r1, 1, W1, None, T0 + 3)).job.progress["progress"] == 1.0  # type: ignore[index]
    assert applied(complete(started(), 1, W1, None, T0 + 3)).job.progress is None


def test_complete_clears_previous_error() -> None:
    retrying = applied(fail(started(), 1, W1, make_error("E", "x"), T0 + 2, delay=1.0))
    again = applied(start(retrying, 2, W1, T0 + 4, POLICY))
    done = applied(complete(again, 2, W1, 5, T0 + 5))
    assert done.job.error is None
    assert len(done.job.errors) == 1  # the history stays


def test_complete_fencing() -> None:
    record = started()
    assert complete(record, 1, W2, None, T0 + 2).reason == "not_owner"
    assert complete(record, 2, W1, None, T0 + 2).reason == "stale_attempt"
    cancelled = applied(cancel(record, T0 + 2))
    assert complete(cancelled, 1, W1, None, T0 + 3).reason == "not_active"
    done = applied(complete(record, 1, W1, None, T0 + 2))
    assert complete(done, 1, W1, None, T0 + 3).reason == "not_active"
    assert complete(created(), 1, W1, None, T0 + 3).reason == "not_active"


def test_late_outcome_of_recovered_attempt_rejected() -> None:
    record = started()
    recovered = applied(
        fail(record, 1, None, timeout_error("stalled", 60, 61, "x"), T0 + 62, delay=1.0)
    )
    again = applied(start(recovered, 2, W2, T0 + 64, POLICY))
    assert complete(again, 1, W1, "late", T0 + 65).reason == "stale_attempt"
    assert fail(again, 1, W1, make_error("E", "late"), T0 + 65).reason == "stale_attempt"
    assert heartbeat(again, 1, W1, T0 + 65).reason == "stale_attempt"


# --------------------------------------------------------------------------- fail


def test_fail_retryable() -> None:
    record = started(at=T0 + 1)
    error = make_error("ValueError", "boom", backtrace=["line 1"])
    transition = fail(record, 1, W1, error, T0 + 10, rand=lambda: 0.5)
    new = applied(transition)
    j = new.job
    assert j.state == "retryable"
    assert j.attempt == 1
    assert new.token == 2
    assert j.next_retry_at == from_epoch(T0 + 11)
    assert j.error == error
    assert j.errors == [
        {
            "code": "HANDLER_ERROR",
            "type": "ValueError",
            "message": "boom",
            "backtrace": ["line 1"],
            "attempt": 1,
            "occurred_at": ts(T0 + 10),
        }
    ]
    assert new.worker_id is None
    assert new.heartbeat_at is None
    assert new.extended_at == T0 + 10  # the retry's message was sent: the backstop's start
    assert transition.publish == Publish(j.id, 2, T0 + 11)
    assert new.dispatch_due == T0 + 11 + POLICY.dispatch_grace
    assert new.promote_at is None
    assert names(transition) == ["job.failed", "job.retrying"]
    base = {"job_id": j.id, "job_type": "email.send", "queue": "emails"}
    assert event(transition, "job.failed") == {
        **base,
        "state": "retryable",
        "attempt": 1,
        "error": {"code": "HANDLER_ERROR", "type": "ValueError", "message": "boom",
                  "retryable": True},
    }
    assert event(transition, "job.retrying") == {
        **base,
        "state": "retryable",
        "attempt": 1,
        "max_attempts": 3,
        "next_retry_at": ts(T0 + 11),
        "delay_seconds": 1.0,
        "error": {"code": "HANDLER_ERROR", "type": "ValueError", "message": "boom"},
    }
    assert record.job.state == "active"  # input untouched


def test_fail_retry_beyond_horizon_is_held() -> None:
    transition = fail(started(), 1, W1, make_error("E", "x"), T0 + 10, delay=120.0)
    new = applied(transition)
    assert new.job.state == "retryable"
    assert transition.publish is None
    assert new.promote_at == T0 + 130
    assert new.dispatch_due is None
    assert new.token == 2


def test_fail_retry_without_delay_publishes_now() -> None:
    transition = fail(started(), 1, W1, make_error("E", "x"), T0 + 10, delay=0.0)
    new = applied(transition)
    assert transition.publish == Publish(new.job.id, 2, None)
    assert new.dispatch_due == T0 + 10 + POLICY.dispatch_grace


def test_fail_exhausted_discards() -> None:
    record = started(retry={"max_attempts": 1})
    transition = fail(record, 1, W1, make_error("ValueError", "boom"), T0 + 10)
    new = applied(transition)
    j = new.job
    assert j.state == "discarded"
    assert j.discarded_at == from_epoch(T0 + 10)
    assert j.completed_at == from_epoch(T0 + 10)
    assert j.next_retry_at is None
    assert new.token == 1
    assert new.dead_letter is False
    assert new.worker_id is None
    assert transition.publish is None
    assert names(transition) == ["job.failed", "job.discarded"]
    assert event(transition, "job.failed")["state"] == "discarded"
    assert event(transition, "job.failed")["error"]["retryable"] is False
    assert event(transition, "job.discarded") == {
        "job_id": j.id,
        "job_type": "email.send",
        "queue": "emails",
        "state": "discarded",
        "total_attempts": 1,
        "last_error": {"code": "HANDLER_ERROR", "type": "ValueError", "message": "boom"},
    }


def test_fail_exhausted_after_all_attempts() -> None:
    record = started(retry={"max_attempts": 2, "jitter": False})
    r = applied(fail(record, 1, W1, make_error("E", "1"), T0 + 2))
    assert r.job.state == "retryable"
    r = applied(start(r, 2, W1, T0 + 4, POLICY))
    r = applied(fail(r, 2, W1, make_error("E", "2"), T0 + 5))
    assert r.job.state == "discarded"
    assert [e["attempt"] for e in r.job.errors] == [1, 2]


def test_fail_dead_letter_flag() -> None:
    record = started(retry={"max_attempts": 1, "on_exhaustion": "dead_letter"})
    new = applied(fail(record, 1, W1, make_error("E", "x"), T0 + 10))
    assert new.job.state == "discarded"
    assert new.dead_letter is True


def test_fail_non_retryable_discards() -> None:
    record = started(retry={"max_attempts": 10, "non_retryable_errors": ["auth.*"]})
    new = applied(fail(record, 1, W1, make_error("auth.denied", "no"), T0 + 10))
    assert new.job.state == "discarded"


def test_fail_not_retryable_flag_discards() -> None:
    record = started(retry={"max_attempts": 10})
    transition = fail(record, 1, W1, make_error("Reject", "no"), T0 + 10, retryable=False)
    assert applied(transition).job.state == "discarded"
    assert event(transition, "job.failed")["error"]["retryable"] is False


def test_fail_with_timeout_emits_job_timeout() -> None:
    record = started(at=T0 + 1, timeout=10, grace_period=5)
    error = timeout_error("timeout", 10, 15.0004, "execution timeout")
    transition = fail(record, 1, W1, error, T0 + 16, delay=1.0)
    new = applied(transition)
    assert names(transition) == ["job.timeout", "job.failed", "job.retrying"]
    assert event(transition, "job.timeout") == {
        "job_id": new.job.id,
        "job_type": "email.send",
        "queue": "emails",
        "state": "active",
        "timeout_kind": "execution",
        "limit_seconds": 10,
        "elapsed_seconds": 15.0,
        "attempt": 1,
    }
    assert new.job.errors[-1]["code"] == "HANDLER_TIMEOUT"
    assert new.job.error == error


@pytest.mark.parametrize(
    ("type_", "event_name"), [("stalled", "job.stalled"), ("timeout", "job.timeout")]
)
def test_fail_timeout_kinds_events(type_: str, event_name: str) -> None:
    transition = fail(started(), 1, None, timeout_error(type_, 60, 61, "x"), T0 + 62, delay=1.0)
    assert names(transition)[0] == event_name
    assert applied(transition).job.state == "retryable"


def test_fail_retry_past_total_timeout_discards_with_total_timeout() -> None:
    record = started(at=T0 + 1, timeout=10, total_timeout=30)
    transition = fail(record, 1, W1, make_error("ValueError", "boom"), T0 + 19.5, delay=1.0)
    new = applied(transition)
    j = new.job
    assert j.state == "discarded"
    assert j.error is not None
    assert j.error["type"] == "total_timeout"
    assert j.error["timeout_kind"] == "total"
    assert j.error["limit_seconds"] == 30
    assert j.error["elapsed_seconds"] == 19.5
    assert [e["type"] for e in j.errors] == ["ValueError", "total_timeout"]
    assert names(transition) == ["job.failed", "job.total_timeout", "job.discarded"]
    assert event(transition, "job.failed")["error"]["retryable"] is False
    assert event(transition, "job.discarded")["last_error"] == {
        "code": "HANDLER_TIMEOUT", "type": "total_timeout", "message": j.error["message"]}
    assert transition.publish is None


def test_fail_fencing() -> None:
    record = started()
    error = make_error("E", "x")
    assert fail(record, 1, W2, error, T0 + 2).reason == "not_owner"
    assert fail(record, 2, W1, error, T0 + 2).reason == "stale_attempt"
    assert fail(created(), 1, W1, error, T0 + 2).reason == "not_active"
    # The sweeper (worker_id None) may fail the current active attempt only.
    assert applied(fail(record, 1, None, error, T0 + 2, delay=1.0)).job.state == "retryable"
    assert fail(record, 2, None, error, T0 + 2).reason == "stale_attempt"
    assert fail(created(), 0, None, error, T0 + 2).reason == "stale_attempt"


def test_attempt_counts_starts_only() -> None:
    r = created(retry={"max_attempts": 5})
    assert r.job.attempt == 0
    r = applied(start(r, 1, W1, T0 + 1, POLICY))
    assert r.job.attempt == 1
    r = applied(fail(r, 1, W1, make_error("E", "x"), T0 + 2, delay=1.0))
    assert r.job.attempt == 1
    r = applied(start(r, 2, W1, T0 + 3, POLICY))
    assert r.job.attempt == 2
    # A sweeper recovery records the failure of attempt 2 without counting another.
    r = applied(fail(r, 2, None, timeout_error("stalled", 60, 61, "x"), T0 + 70, delay=1.0))
    assert r.job.attempt == 2
    assert r.job.errors[-1]["attempt"] == 2
    assert start(r, 2, W1, T0 + 71, POLICY).reason == "stale"  # a duplicate of the old message
    r = applied(start(r, 3, W1, T0 + 71, POLICY))
    assert r.job.attempt == 3
    r = applied(heartbeat(r, 3, W1, T0 + 72, progress=0.5))
    r = applied(complete(r, 3, W1, "ok", T0 + 73))
    assert r.job.attempt == 3


# --------------------------------------------------------------------------- expire_* directly


def test_expire_ttl_rules() -> None:
    assert expire_ttl(created(), T0 + 999, POLICY).reason == "not_applicable"
    record = created(enqueue_ttl=30)
    assert expire_ttl(record, T0 + 29, POLICY).reason == "not_due"
    assert applied(expire_ttl(record, T0 + 30, POLICY)).job.state == "discarded"
    assert expire_ttl(started(enqueue_ttl=30), T0 + 60, POLICY).reason == "not_applicable"
    held = created(enqueue_ttl=30, scheduled_at=ts(T0 + 3600))
    assert applied(expire_ttl(held, T0 + 31, POLICY)).job.state == "discarded"


def test_expire_total_rules() -> None:
    assert expire_total(created(), T0 + 999, POLICY).reason == "not_applicable"
    record = started(timeout=10, total_timeout=60)
    assert expire_total(record, T0 + 59, POLICY).reason == "not_due"
    transition = expire_total(record, T0 + 60, POLICY)
    new = applied(transition)
    assert new.job.state == "discarded"
    assert new.worker_id is None
    assert new.job.errors[-1]["attempt"] == 1
    assert names(transition) == ["job.total_timeout", "job.discarded"]
    assert event(transition, "job.total_timeout")["elapsed_seconds"] == 60.0
    assert expire_total(new, T0 + 70, POLICY).reason == "not_applicable"


# --------------------------------------------------------------------------- deadlines


def test_deadlines_have_every_clock() -> None:
    assert tuple(deadlines(created(), POLICY)) == CLOCKS


def test_deadlines_available() -> None:
    record = created(timeout=10, total_timeout=600, enqueue_ttl=30)
    assert deadlines(record, POLICY) == {
        "total": T0 + 600,
        "enqueue_ttl": T0 + 30,
        "execution": None,
        "stall": None,
        "visibility": None,
        "dispatch": T0 + POLICY.dispatch_grace,
        "promote": None,
        "redispatch": T0 + POLICY.redispatch_after,
        "retention": None,
    }


def test_deadlines_without_optional_clocks() -> None:
    d = deadlines(created(), POLICY)
    assert d["total"] is None
    assert d["enqueue_ttl"] is None


def test_deadlines_scheduled_held() -> None:
    record = created(enqueue_ttl=7200, scheduled_at=ts(T0 + 3600))
    d = deadlines(record, POLICY)
    assert d["promote"] == T0 + 3600
    assert d["dispatch"] is None
    assert d["enqueue_ttl"] == T0 + 7200
    assert d["execution"] is None
    assert d["redispatch"] is None  # the promote clock owns it until it is published


def test_deadlines_pending_keeps_ttl() -> None:
    record = created(enqueue_ttl=30)
    record.job.state = "pending"
    assert deadlines(record, POLICY)["enqueue_ttl"] == T0 + 30


def test_deadlines_active() -> None:
    record = started(
        at=T0 + 5,
        timeout=100,
        grace_period=7,
        total_timeout=1000,
        enqueue_ttl=30,
        heartbeat_timeout=20,
        visibility_timeout=50,
    )
    assert deadlines(record, POLICY) == {
        "total": T0 + 1000,
        "enqueue_ttl": None,
        "execution": T0 + 5 + 100 + 7,
        "stall": T0 + 5 + 20,
        "visibility": T0 + 5 + 50,
        "dispatch": None,
        "promote": None,
        "redispatch": None,
        "retention": None,
    }
    beat = applied(heartbeat(record, 1, W1, T0 + 40))
    d = deadlines(beat, POLICY)
    assert d["stall"] == T0 + 60
    assert d["visibility"] == T0 + 90
    assert d["execution"] == T0 + 112  # never extended
    quiet = applied(heartbeat(record, 1, W1, T0 + 40, stall=False))
    assert deadlines(quiet, POLICY)["stall"] == T0 + 25
    assert deadlines(quiet, POLICY)["visibility"] == T0 + 90


def test_deadlines_execution_with_zero_grace() -> None:
    record = started(at=T0 + 5, timeout=100, grace_period=0)
    assert deadlines(record, POLICY)["execution"] == T0 + 105


def test_deadlines_retryable() -> None:
    record = started(at=T0 + 5, timeout=100, total_timeout=1000, enqueue_ttl=30)
    retrying = applied(fail(record, 1, W1, make_error("E", "x"), T0 + 10, delay=5.0))
    d = deadlines(retrying, POLICY)
    assert d == {
        "total": T0 + 1000,
        "enqueue_ttl": None,
        "execution": None,
        "stall": None,
        "visibility": None,
        "dispatch": T0 + 15 + POLICY.dispatch_grace,
        "promote": None,
        "redispatch": T0 + 15 + POLICY.redispatch_after,  # from the time the retry is due
        "retention": None,
    }
    held = applied(fail(record, 1, W1, make_error("E", "x"), T0 + 10, delay=500.0))
    assert deadlines(held, POLICY)["promote"] == T0 + 510
    assert deadlines(held, POLICY)["dispatch"] is None
    assert deadlines(held, POLICY)["redispatch"] is None


def _only_retention(d: dict[str, float | None]) -> float | None:
    others = {k: v for k, v in d.items() if k != "retention"}
    assert others == dict.fromkeys(others), others
    return d["retention"]


def test_deadlines_retention_by_terminal_state() -> None:
    custom = Policy(
        retention_completed=10.0,
        retention_cancelled=20.0,
        retention_discarded=30.0,
        retention_dead_letter=40.0,
    )
    fields: dict[str, Any] = {"timeout": 10, "total_timeout": 600, "enqueue_ttl": 30}
    done = applied(complete(started(**fields), 1, W1, None, T0 + 3))
    assert _only_retention(deadlines(done, POLICY)) == T0 + 3 + 7 * DAY
    assert _only_retention(deadlines(done, custom)) == T0 + 13

    cancelled = applied(cancel(created(**fields), T0 + 4))
    assert _only_retention(deadlines(cancelled, POLICY)) == T0 + 4 + 30 * DAY
    assert _only_retention(deadlines(cancelled, custom)) == T0 + 24

    cancelled_active = applied(cancel(started(**fields), T0 + 4))
    assert _only_retention(deadlines(cancelled_active, custom)) == T0 + 24

    exhausted: dict[str, Any] = {"retry": {"max_attempts": 1}}
    discarded = applied(fail(started(**fields, **exhausted), 1, W1, make_error("E", "x"), T0 + 5))
    assert _only_retention(deadlines(discarded, POLICY)) == T0 + 5 + 30 * DAY
    assert _only_retention(deadlines(discarded, custom)) == T0 + 35

    dead: dict[str, Any] = {"retry": {"max_attempts": 1, "on_exhaustion": "dead_letter"}}
    dead_lettered = applied(fail(started(**fields, **dead), 1, W1, make_error("E", "x"), T0 + 6))
    assert _only_retention(deadlines(dead_lettered, POLICY)) == T0 + 6 + 180 * DAY
    assert _only_retention(deadlines(dead_lettered, custom)) == T0 + 46

    ttl = applied(expire_ttl(created(**fields), T0 + 30, POLICY))
    assert _only_retention(deadlines(ttl, custom)) == T0 + 60


def test_deadlines_total_while_non_terminal_in_every_state() -> None:
    fields: dict[str, Any] = {"timeout": 10, "total_timeout": 600}
    records = [
        created(**fields),
        created(scheduled_at=ts(T0 + 30), **fields),
        created(scheduled_at=ts(T0 + 3600), timeout=10, total_timeout=7200),
        started(**fields),
        applied(fail(started(**fields), 1, W1, make_error("E", "x"), T0 + 2, delay=1.0)),
    ]
    pending = created(**fields)
    pending.job.state = "pending"
    records.append(pending)
    for record in records:
        assert deadlines(record, POLICY)["total"] == T0 + (record.job.total_timeout or 0), (
            record.job.state
        )


# --------------------------------------------------------------------------- cancel


def test_cancel_available() -> None:
    record = created()
    transition = cancel(record, T0 + 3, reason="user request")
    new = applied(transition)
    assert new.job.state == "cancelled"
    assert new.job.cancelled_at == from_epoch(T0 + 3)
    assert new.dispatch_due is None
    assert new.promote_at is None
    assert transition.publish is None
    assert transition.events == [
        (
            "job.cancelled",
            {
                "job_id": new.job.id,
                "job_type": "email.send",
                "queue": "emails",
                "state": "cancelled",
                "previous_state": "available",
                "reason": "user request",
            },
        )
    ]


def test_cancel_without_reason_has_no_reason_field() -> None:
    transition = cancel(created(scheduled_at=ts(T0 + 3600)), T0 + 3)
    data = event(transition, "job.cancelled")
    assert "reason" not in data
    assert data["previous_state"] == "scheduled"
    assert applied(transition).promote_at is None


def test_cancel_active_and_retryable() -> None:
    active = started()
    new = applied(cancel(active, T0 + 3))
    assert new.worker_id is None
    assert event(cancel(active, T0 + 3), "job.cancelled")["previous_state"] == "active"
    retrying = applied(fail(active, 1, W1, make_error("E", "x"), T0 + 2, delay=1.0))
    gone = applied(cancel(retrying, T0 + 3))
    assert gone.job.state == "cancelled"
    assert gone.job.next_retry_at is None
    assert gone.dispatch_due is None
    assert start(gone, 2, W1, T0 + 4, POLICY).reason == "cancelled"


@pytest.mark.parametrize("final", ["completed", "cancelled", "discarded"])
def test_cancel_terminal_rejected(final: str) -> None:
    record = created()
    record.job.state = final  # type: ignore[assignment]
    assert cancel(record, T0 + 3).reason == f"terminal:{final}"
    assert not cancel(record, T0 + 3).applied


def test_dispatch_failures_are_counted_in_a_row_and_the_limit_discards() -> None:
    from ojs_celery.lifecycle import dispatch_failed, dispatch_failures

    policy = Policy(dispatch_failure_limit=3)
    record = created()
    for count in (1, 2):
        record = applied(dispatch_failed(record, "QueueNotFound: nowhere", T0 + count, policy))
        assert record.job.state == "available" and dispatch_failures(record.job) == count
    record.job.errors = [*record.job.errors, make_error("timeout", "an attempt's error")]
    assert dispatch_failures(record.job) == 0  # another error ends the run
    for _ in range(2):
        record = applied(dispatch_failed(record, "QueueNotFound: nowhere", T0 + 5, policy))
    last = dispatch_failed(record, "QueueNotFound: nowhere", T0 + 6, policy)
    done = applied(last)
    assert done.job.state == "discarded" and done.dispatch_due is None
    assert done.job.error is not None and done.job.error["type"] == "dispatch_failed"
    assert names(last) == ["job.discarded"]
    assert not dispatch_failed(done, "again", T0 + 7, policy).applied


def test_a_job_waiting_too_long_for_its_message_gets_it_once_more() -> None:
    from ojs_celery.lifecycle import REDISPATCH, ack_dispatch, resend

    policy = Policy(redispatch_after=100.0)
    record = applied(ack_dispatch(created(policy=policy), 1))  # published and acknowledged
    assert REDISPATCH.deadline(record, policy) == T0 + 100
    assert resend(record, T0 + 99, policy).reason == "not_due"
    transition = resend(record, T0 + 100, policy)
    again = applied(transition)
    assert transition.publish == Publish(record.job.id, 1, None)  # same token: fencing dedups
    assert again.token == record.token and again.job.attempt == 0 and not again.job.errors
    assert again.dispatch_due == T0 + 100 + policy.dispatch_grace
    assert REDISPATCH.deadline(again, policy) == T0 + 200  # as long as it has waited
    assert resend(again, T0 + 150, policy).reason == "not_due"
    third = applied(resend(again, T0 + 200, policy))
    assert REDISPATCH.deadline(third, policy) == T0 + 400  # the wait doubles with each copy
    active = applied(start(again, 1, W1, T0 + 150, policy))
    assert REDISPATCH.deadline(active, policy) is None
    assert resend(active, T0 + 500, policy).reason == "not_waiting"


def _waiting_records() -> dict[str, Record]:
    from ojs_celery.lifecycle import ack_dispatch

    return {
        "total": created(timeout=10, total_timeout=600),
        "enqueue_ttl": created(enqueue_ttl=30),
        "execution": started(timeout=10, grace_period=5),
        "stall": started(heartbeat_timeout=20),
        "visibility": started(visibility_timeout=50),
        "dispatch": created(),
        "promote": created(scheduled_at=ts(T0 + 3600)),
        "redispatch": applied(ack_dispatch(created(), 1)),
    }


@pytest.mark.parametrize("name", list(_waiting_records()))
def test_each_clock_applies_its_rule_once_its_deadline_and_lag_have_passed(name: str) -> None:
    from ojs_celery.lifecycle import BY_NAME

    clock = BY_NAME[name]
    record = _waiting_records()[name]
    deadline = clock.deadline(record, POLICY)
    assert deadline is not None
    due_at = deadline + clock.lag(POLICY)
    assert clock.cutoff(due_at, POLICY) == deadline
    assert not clock.rule(due_at - 0.01, POLICY)(record).applied
    assert clock.rule(due_at, POLICY)(record).applied


def test_the_sweep_breaks_ties_in_the_documented_order() -> None:
    from ojs_celery.lifecycle import SWEEP

    assert [clock.name for clock in SWEEP] == [
        "total", "enqueue_ttl", "execution", "stall", "visibility", "worker", "dispatch",
        "promote", "redispatch", "retention",
    ]


@pytest.mark.parametrize(("meta", "trace"), [
    ({"trace_id": "abc"}, "abc"),
    ({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
     "4bf92f3577b34da6a3ce929d0e0e4736"),
    ({"traceparent": f"00-{'0' * 32}-00f067aa0ba902b7-01"}, None),  # W3C: invalid
    ({"traceparent": "garbage"}, None),
    ({}, None),
])
def test_the_trace_id_of_a_jobs_events(meta: dict[str, Any], trace: str | None) -> None:
    data = lifecycle.with_trace({}, make_job(meta=meta))
    assert data.get("trace_id") == trace
