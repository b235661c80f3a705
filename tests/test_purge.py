"""``ojs-celery purge``: ``celery purge`` for OJS jobs, on every broker.

``celery purge`` empties the broker's queues and leaves the job store as it was: a purged job
stayed ``available`` and the sweeper's backstop sent its message again ``redispatch_after``
later, so a purge in an incident came undone an hour after. ``purge`` cancels the waiting jobs
in the store, then empties the queues as Celery's command does.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
from celery.result import AsyncResult

from ojs_celery import enqueue, get_job, purge
from ojs_celery.envelope import parse_envelope
from ojs_celery.lifecycle import Record
from ojs_celery.lifecycle import purge as purge_rule
from tests.conftest import Env
from tests.workers import ROOT, unique

CLI = str(pathlib.Path(sys.executable).parent / "ojs-celery")


def run(env: Env, *args: str, stdin: str = "", config: dict[str, Any] | None = None
        ) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "OJS_E2E_CONFIG": json.dumps(config or env.config),
               "PYTHONPATH": str(ROOT)}
    return subprocess.run([CLI, "-A", "tests.e2eapp:app", *args], input=stdin,
                          capture_output=True, text=True, cwd=ROOT, env=environ, timeout=60)


def waiting_in(env: Env, queue: str, count: int) -> list[str]:
    """``count`` jobs enqueued on ``queue``, which no worker consumes."""
    return [enqueue({"type": "e2e.add", "args": [index, 1], "queue": queue}, app=env.app).id
            for index in range(count)]


def test_purge_cancels_the_waiting_jobs_of_its_queues_and_empties_them(env: Env) -> None:
    purged, kept = unique("purged"), unique("kept")
    gone = waiting_in(env, purged, 3)
    later = enqueue({"type": "e2e.add", "args": [1, 1], "queue": purged,
                     "scheduled_at": "2999-01-01T00:00:00Z"}, app=env.app).id  # held in the store
    spared = waiting_in(env, kept, 1)

    out = run(env, "purge", "-f", "-Q", f"{purged},{kept}", "-X", kept)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report == {"queues": [purged], "cancelled": 4, "messages": 3}

    for job_id in [*gone, later]:
        job = get_job(job_id, app=env.app)
        assert job is not None and job.state == "cancelled"
        assert AsyncResult(job_id, app=env.app).state == "REVOKED"  # a waiter does not hang
        assert env.wait_events(job_id, lambda types: "job.cancelled" in types)
    job = get_job(spared[0], app=env.app)
    assert job is not None and job.state == "available"

    again = run(env, "purge", "-f", "-Q", purged)  # nothing left: the same run is harmless
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == {"queues": [purged], "cancelled": 0, "messages": 0}
    assert run(env, "purge", "-f", "-Q", kept).returncode == 0


def test_a_queue_the_broker_does_not_have_counts_nothing(env: Env) -> None:
    """RabbitMQ answers a purge of a queue it does not have with a channel error (and closes
    the channel): the queues after it are emptied all the same."""
    never, then = unique("never"), unique("then")
    waiting_in(env, then, 2)
    out = run(env, "purge", "-f", "-Q", f"{never},{then}")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"queues": sorted([never, then]), "cancelled": 2,
                                      "messages": 2}


def test_purge_leaves_a_running_job_to_finish(env: Env) -> None:
    running = enqueue({"type": "e2e.sleep", "args": [2], "queue": env.config["queue"]},
                      app=env.app).id
    env.wait_state(running, "active")
    out = run(env, "purge", "-f", "-Q", env.config["queue"])
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["cancelled"] == 0
    assert env.wait_state(running, "completed").state == "completed"


def test_purge_asks_first_and_a_no_changes_nothing(env: Env) -> None:
    queue = unique("asked")
    waiting = waiting_in(env, queue, 1)
    out = run(env, "purge", "-Q", queue, stdin="n\n")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    job = get_job(waiting[0], app=env.app)
    assert job is not None and job.state == "available"
    assert run(env, "purge", "-f", "-Q", queue).returncode == 0


def test_a_broker_that_is_down_is_one_line_and_the_jobs_stay_cancelled(env: Env) -> None:
    if env.kind == "filesystem":
        pytest.skip("the embedded broker is a folder: it cannot be down")
    queue = unique("nobroker")
    waiting = waiting_in(env, queue, 2)
    down = {**env.config, "broker_url": "redis://127.0.0.1:1/0" if env.kind == "redis"
            else "amqp://guest:guest@127.0.0.1:1//"}
    out = run(env, "purge", "-f", "-Q", queue, config=down)
    assert out.returncode == 1, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "2 waiting job(s) were cancelled" in errors[0]  # (the event bus says it is down too)
    for job_id in waiting:
        job = get_job(job_id, app=env.app)
        assert job is not None and job.state == "cancelled"
    assert run(env, "purge", "-f", "-Q", queue).returncode == 0  # its messages go


def test_purge_in_code_counts_only_what_it_cancelled(env: Env) -> None:
    queue = unique("api")
    waiting_in(env, queue, 2)
    assert purge([queue], app=env.app) == 2
    assert purge([queue], app=env.app) == 0
    assert run(env, "purge", "-f", "-Q", queue).returncode == 0


@pytest.mark.parametrize("state", ["active", "completed", "cancelled", "discarded"])
def test_the_rule_leaves_what_does_not_wait(state: str) -> None:
    job = parse_envelope({"type": "t", "args": [], "queue": "q"})
    job.state = state  # type: ignore[assignment]
    done = purge_rule(Record(job=job), 0.0, frozenset({"q"}))
    assert done.record is None


@pytest.mark.parametrize("state", ["scheduled", "available", "retryable"])
def test_the_rule_cancels_a_waiting_job_of_its_queues_only(state: str) -> None:
    job = parse_envelope({"type": "t", "args": [], "queue": "q"})
    job.state = state  # type: ignore[assignment]
    assert purge_rule(Record(job=job), 0.0, frozenset({"other"})).record is None
    for queues in (frozenset({"q"}), None):
        done = purge_rule(Record(job=job), 0.0, queues)
        assert done.record is not None and done.record.job.state == "cancelled"



@pytest.mark.parametrize("before", ["promote", "dispatch", "redispatch"])
def test_a_job_the_sweeper_moves_on_during_the_purge_is_cancelled(app: Any, before: str
                                                                  ) -> None:
    """A held job that comes due while a purge runs moves from the promote clock to the
    redispatch clock (the sweeper publishes it), whichever clock the purge reads then: the
    purge reads the clocks in that order, so that a job moved on is found in a clock read
    later. (Read the other way round, a job promoted once the redispatch clock was read was
    in none of the clocks read after it, and its message ran.)"""
    from ojs_celery.runtime import get_runtime
    from ojs_celery.sweeper import sweep

    runtime = get_runtime(app)
    held = enqueue({"type": "e2e.add", "args": [1, 1], "queue": "held",
                    "scheduled_at": "2999-01-01T00:00:00Z"}, app=app).id
    due = runtime.store._load(held)
    assert due is not None and due.promote_at is not None
    scan, swept = runtime.store.scan, []

    def scan_with_a_sweep_before(clock: str, cursor: str | None, limit: int) -> Any:
        if clock == before and not swept:  # a pass, as the purge runs
            swept.append(sweep(runtime, now=due.promote_at + 1))
        return scan(clock, cursor, limit)

    runtime.store.scan = scan_with_a_sweep_before  # type: ignore[method-assign]
    try:
        assert purge(["held"], app=app) == 1
    finally:
        del runtime.store.scan
    job = get_job(held, app=app)  # None: cancelled first, then pruned by the pass (year 2999)
    assert swept and (job is None or job.state == "cancelled"), job


def test_a_store_error_half_way_through_a_page_still_carries_out_what_was_cancelled(
        app: Any) -> None:
    """A page's batch wrote some cancellations and left one to decide again (a worker started
    it first, or the batch's reply was lost half way), and the store failed for that one: the
    cancellations written are still carried out (their results read REVOKED, or a waiter
    waits for ever, and no later purge finds them: they no longer wait), then the error is
    raised."""
    from ojs_celery.runtime import get_runtime
    from ojs_celery.store import StoreError

    runtime = get_runtime(app)
    ids = [enqueue({"type": "e2e.add", "args": [n, 1], "queue": "half"}, app=app).id
           for n in range(3)]
    store = runtime.store
    apply_many = store.apply_many

    def first_left_to_decide_again(job_ids: list[str], rule: Any) -> list[Any]:
        written = iter(apply_many([job_id for job_id in job_ids if job_id != ids[0]], rule))
        return [None if job_id == ids[0] else next(written) for job_id in job_ids]

    def down(job_id: str, rule: Any) -> Any:
        raise StoreError("the store went away")

    store.apply_many = first_left_to_decide_again  # type: ignore[method-assign]
    store.apply = down  # type: ignore[method-assign]
    try:
        with pytest.raises(StoreError, match="purge again"):
            purge(["half"], app=app)
    finally:
        del store.apply_many, store.apply
    for job_id in ids[1:]:
        job = get_job(job_id, app=app)
        assert job is not None and job.state == "cancelled"
        assert AsyncResult(job_id, app=app).state == "REVOKED"
    assert purge(["half"], app=app) == 1  # what the error left waiting


def test_purge_in_code_of_one_queue_named_as_text(app: Any) -> None:
    """``purge("emails")``: text is one queue's name, not the queues of its letters (which
    cancelled nothing and said 0, or cancelled the jobs of a queue called ``e``)."""
    waiting = [enqueue({"type": "e2e.add", "args": [1, 1], "queue": name}, app=app).id
               for name in ("emails", "e")]
    assert purge("emails", app=app) == 1
    first, other = (get_job(job_id, app=app) for job_id in waiting)
    assert first is not None and first.state == "cancelled"
    assert other is not None and other.state == "available"
