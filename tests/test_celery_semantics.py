"""Celery callers keep Celery's semantics (issue 11 item 1): a handler exception ends the job
unless ``autoretry_for`` or ``self.retry()`` asks for a retry, with Celery's delays, bounded by
``max_retries`` and counted in ``self.request.retries``; time limits and ``expires`` become the
job's ``timeout``/``grace_period`` and ``expires_at``. Envelopes keep the OJS defaults."""

from __future__ import annotations

import json
import time
from datetime import date, datetime, timedelta, timezone
from datetime import time as dt_time
from decimal import Decimal
from pathlib import Path
from uuid import UUID

import pytest
import redis
from celery import Celery, chain, chord, group
from celery.exceptions import MaxRetriesExceededError
from celery.result import AsyncResult
from kombu.exceptions import EncodeError

from ojs_celery import InvalidJob, OJSTask, enqueue, install
from ojs_celery.conf import Settings
from ojs_celery.embedded import embedded_settings
from ojs_celery.envelope import CELERY_SEMANTICS_FIELD, ERRORS_DROPPED_FIELD, Job, parse_envelope
from ojs_celery.lifecycle import ERRORS_KEPT, Policy, create, decide, fail, make_error, start
from ojs_celery.lifecycle.rules import celery_retries, recoveries
from ojs_celery.producer import (
    broker_priority,
    celery_expires_at,
    celery_semantics_of,
    celery_time_fields,
    ojs_priority_of,
    ojs_queue_of,
    scheduled_at_from,
    tasks_without_limit,
)
from ojs_celery.runtime import get_runtime
from ojs_celery.store.base import decode_job, encode_job
from tests.conftest import Env
from tests.services import redis_url
from tests.workers import unique, wait_for

# --------------------------------------------------------------------------- the mapping


@pytest.fixture()
def app() -> Celery:
    app = Celery("semantics", set_as_current=False)

    @app.task(shared=False, name="m.plain", base=OJSTask)
    def plain() -> None: ...

    @app.task(shared=False, name="m.limited", base=OJSTask, soft_time_limit=10, time_limit=25,
              max_retries=5, default_retry_delay=7, expires=60)
    def limited() -> None: ...

    @app.task(shared=False, name="m.hard", base=OJSTask, time_limit=12.5)
    def hard() -> None: ...

    @app.task(shared=False, name="m.ojs", base=OJSTask, ojs_semantics=True)
    def ojs() -> None: ...

    return app


def test_time_limits_give_timeout_and_grace(app: Celery) -> None:
    settings = Settings()
    limited, hard, plain = (app.tasks[n] for n in ("m.limited", "m.hard", "m.plain"))
    assert celery_time_fields(app, limited, {}, settings) == {"timeout": 10, "grace_period": 15}
    assert celery_time_fields(app, hard, {}, settings) == {"timeout": 13, "grace_period": 0}
    assert celery_time_fields(app, limited, {"soft_time_limit": 3, "time_limit": 4},
                              settings) == {"timeout": 3, "grace_period": 1}
    assert celery_time_fields(app, plain, {}, Settings(default_timeout=99)) == {"timeout": 99}
    assert tasks_without_limit(app) == ["m.ojs", "m.plain"]
    app.conf.task_soft_time_limit = 20
    assert celery_time_fields(app, plain, {}, settings) == {"timeout": 20}
    # the task's hard limit comes first, as on Celery's worker: the app's soft one is moot
    assert celery_time_fields(app, hard, {}, settings) == {"timeout": 13, "grace_period": 0}
    assert celery_time_fields(app, limited, {"soft_time_limit": 5, "time_limit": 5},
                              settings) == {"timeout": 5, "grace_period": 0}
    app.conf.task_time_limit = 26  # the app's limits fill what the call and the task leave
    assert celery_time_fields(app, plain, {}, settings) == {"timeout": 20, "grace_period": 6}
    assert celery_time_fields(app, limited, {}, settings) == {"timeout": 10, "grace_period": 15}
    assert tasks_without_limit(app) == []


def test_expires_becomes_expires_at(app: Celery) -> None:
    now = time.time()
    limited, plain = app.tasks["m.limited"], app.tasks["m.plain"]
    assert celery_expires_at(plain, {}, now) is None
    at = celery_expires_at(limited, {}, now)
    assert at is not None
    assert abs(utc_text(at).timestamp() - (now + 60)) < 0.01
    when = datetime(2031, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    assert utc_text(str(celery_expires_at(plain, {"expires": when}, now))) == when


def utc_text(text: str) -> datetime:
    """ISO 8601 text ending in ``Z``, as the envelope writes it (Python 3.10's
    ``fromisoformat`` does not read the ``Z``)."""
    return datetime.fromisoformat(text.removesuffix("Z") + "+00:00" if text.endswith("Z")
                                  else text)


def test_eta_schedules_the_job_and_a_naive_one_is_utc_as_celery_reads_it(tmp_path: Path) -> None:
    naive = datetime(2031, 1, 2, 3, 4, 5)
    assert scheduled_at_from(naive, None) == naive.replace(tzinfo=timezone.utc)
    offset = datetime(2031, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=2)))
    assert scheduled_at_from(offset, None) == offset
    app = Celery("eta", set_as_current=False)
    app.conf.update(embedded_settings(tmp_path))
    install(app)

    @app.task(shared=False, name="m.later", base=OJSTask)
    def later() -> None: ...

    due = datetime.now(timezone.utc).replace(tzinfo=None) + timedelta(hours=1)
    job = get_runtime(app).store.get(later.apply_async(eta=due).id)  # plain Celery accepts it
    assert job is not None and job.state == "scheduled"
    assert job.scheduled_at == due.replace(tzinfo=timezone.utc)


def test_eta_and_expires_as_iso_text_are_read_as_celery_reads_them(tmp_path: Path) -> None:
    """Celery takes ``eta`` and ``expires`` as ISO 8601 text too (``send_task`` parses them
    with dateutil's ``isoparse``, a naive one is UTC): the call must not fail with an
    ``AttributeError``/``ValueError`` from inside OJS, and text that is no date names the
    option."""
    app = Celery("isotext", set_as_current=False)
    app.conf.update(embedded_settings(tmp_path))
    install(app)

    @app.task(shared=False, name="m.later", base=OJSTask)
    def later() -> None: ...

    store = get_runtime(app).store
    due = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(hours=1)
    gone = due + timedelta(hours=2)
    job = store.get(later.apply_async(eta=due.isoformat(), expires=gone.isoformat()).id)
    assert job is not None and job.state == "scheduled"
    assert job.scheduled_at == due and job.expires_at == gone
    naive = store.get(later.apply_async(eta=due.replace(tzinfo=None).isoformat()).id)
    assert naive is not None and naive.scheduled_at == due
    assert scheduled_at_from(due.isoformat(), None) == due
    day = due.date()  # a date is its midnight (UTC), as Celery sends its isoformat()
    dated = store.get(later.apply_async(eta=day, expires=day + timedelta(days=2)).id)
    midnight = datetime(day.year, day.month, day.day, tzinfo=timezone.utc)
    assert dated is not None and dated.scheduled_at == midnight
    assert dated.expires_at == midnight + timedelta(days=2)
    for option in ("eta", "expires"):
        with pytest.raises(InvalidJob) as raised:
            later.apply_async(**{option: "next tuesday"})
        assert [path for path, _ in raised.value.violations] == [option]


def test_a_call_with_nan_or_an_infinity_is_refused_before_anything_is_stored(
        tmp_path: Path) -> None:
    """Celery's JSON serializer would send ``Infinity``; a job's JSON may not hold it (every
    strict parser, other languages' included, refuses it), so the call is refused, like one
    with any other value JSON cannot carry, naming the field."""
    app = Celery("finite", set_as_current=False)
    app.conf.update(embedded_settings(tmp_path))
    install(app)

    @app.task(shared=False, name="m.add", base=OJSTask)
    def add(a: float, b: float = 0.0) -> float: ...

    for call, field in [(lambda: add.delay(float("inf"), 1), "args"),
                        (lambda: add.delay(1, b=float("nan")), "x_celery_kwargs"),
                        (lambda: add.apply_async(([1, [float("-inf")]],)), "args")]:
        with pytest.raises(InvalidJob) as refused:
            call()
        assert refused.value.violations == [
            (field, "must hold only finite numbers (JSON has no NaN or Infinity; a number such "
                    "as 1e400 is beyond a double's range)")]
    assert not list((tmp_path / "broker").glob("*.msg"))  # nothing published
    assert get_runtime(app).store.due("dispatch", 1e12, 10) == []  # nothing stored


def test_a_call_with_python_objects_json_cannot_carry_is_refused_in_args_and_kwargs(
        tmp_path: Path) -> None:
    """What Celery's JSON serializer cannot write either (an ``object()``, a ``set``, a
    ``bytearray``) is refused in ``args`` and kwargs alike. The refusal is also kombu's
    ``EncodeError``, which plain Celery raises for them: a migrated caller's
    ``except EncodeError`` still catches it. (A ``datetime`` or ``bytes`` is carried as a
    typed value, as in Celery: see test_typed_arguments_*.)"""
    app = Celery("pyobjects", set_as_current=False)
    app.conf.update(embedded_settings(tmp_path))
    install(app)

    @app.task(shared=False, name="m.at", base=OJSTask)
    def at(a: object = None, when: object = None) -> None: ...

    rule = "input was not a valid JSON value"
    now = datetime.now(timezone.utc)
    for call, field in [(lambda: at.delay({b"raw"}), "args[0]"),
                        (lambda: at.delay(object()), "args[0]"),
                        (lambda: at.delay(now, when=bytearray(b"x")), "x_celery_kwargs.when"),
                        (lambda: at.apply_async(kwargs={"when": [now, {1}]}),
                         "x_celery_kwargs.when[1]"),
                        (lambda: at.apply_async(link=at.si(object())), "link[0].args[0]")]:
        with pytest.raises(EncodeError) as refused:
            call()
        assert isinstance(refused.value, InvalidJob)
        assert refused.value.violations == [(field, rule)]
    # a custom header Celery's JSON serializer cannot encode either (kept for every attempt)
    with pytest.raises(EncodeError) as refused:
        at.apply_async(headers={"x_tenant": object()})
    assert isinstance(refused.value, InvalidJob)
    assert refused.value.violations == [
        ("headers", "must be data Celery's JSON serializer can encode")]
    assert not list((tmp_path / "broker").glob("*.msg"))  # nothing published
    assert get_runtime(app).store.due("dispatch", 1e12, 10) == []  # nothing stored


def test_a_callback_or_later_link_json_cannot_carry_is_refused_at_the_call(
        tmp_path: Path) -> None:
    """Published by the worker once the job completes, it would fail there: the job completed
    in the store, FAILURE in the result backend, the callback never run."""
    app = Celery("laterlinks", set_as_current=False)
    app.conf.update(embedded_settings(tmp_path))
    install(app)

    @app.task(shared=False, name="m.add", base=OJSTask)
    def add(a: object, b: object = 0) -> None: ...

    @app.task(shared=False, name="m.plain")
    def plain(a: object, b: object = 0) -> None: ...

    rule = "input was not a valid JSON value"
    now = datetime.now(timezone.utc)
    for call, field in [
        (lambda: add.apply_async((1,), link=add.s({now})), "link[0].args[0]"),
        (lambda: add.apply_async((1,), link_error=[add.si(now), add.s(b={b"raw"})]),
         "link_error[1].x_celery_kwargs.b"),
        (lambda: chain(add.s(1), add.s(2), add.s(object())).apply_async(), "chain[0].args[0]"),
    ]:
        with pytest.raises(InvalidJob) as refused:
            call()
        assert refused.value.violations == [(field, rule)]
    assert get_runtime(app).store.due("dispatch", 1e12, 10) == []  # nothing stored
    add.apply_async((1,), link=plain.s(now))  # a plain task's callback: Celery's freedom
    add.apply_async((1,), link=add.s(now))  # a typed value, carried as in Celery


def test_arguments_that_do_not_fit_raise_at_the_call_as_in_celery(tmp_path: Path) -> None:
    """Celery's own argument check (``Task.typing``) runs before anything is stored, so a
    wrong call raises ``TypeError`` where it is made, not later in the worker."""
    app = Celery("typing", set_as_current=False)
    app.conf.update(embedded_settings(tmp_path))
    install(app)

    @app.task(shared=False, name="m.pair", base=OJSTask)
    def pair(a: int, b: int) -> None: ...

    @app.task(shared=False, name="m.loose", base=OJSTask, typing=False)
    def loose(a: int) -> None: ...

    for call in (lambda: pair.delay(1), lambda: pair.apply_async((1, 2, 3)),
                 lambda: pair.s(1).delay(), lambda: pair.delay(1, 2, c=3)):
        with pytest.raises(TypeError):
            call()
    assert not list((tmp_path / "broker").glob("*.msg"))
    assert get_runtime(app).store.due("dispatch", 1e12, 10) == []
    assert loose.delay().id  # typing=False: Celery does not check, nor does OJS
    assert pair.delay(1, 2).id


def test_semantics_marker_from_the_task_and_the_settings(app: Celery) -> None:
    assert celery_semantics_of(app.tasks["m.limited"], Settings()) == {
        "max_retries": 5, "default_retry_delay": 7.0}
    assert celery_semantics_of(app.tasks["m.plain"], Settings()) == {
        "max_retries": 3, "default_retry_delay": 180.0}
    assert celery_semantics_of(app.tasks["m.ojs"], Settings()) is None
    assert celery_semantics_of(app.tasks["m.plain"], Settings(celery_callers="ojs")) is None


@pytest.mark.parametrize("url,top", [("redis://localhost:1/0", 9), ("amqp://localhost:1//", 10)])
def test_a_celery_priority_round_trips_through_the_ojs_priority(url: str, top: int) -> None:
    app = Celery("priorities", broker=url, set_as_current=False)
    install(app)
    for priority in range(top + 1):
        ojs = ojs_priority_of(app, priority, 10)
        assert ojs is not None and -100 <= ojs <= 100
        assert (broker_priority(app, ojs, 10) or 0) == priority  # None: Celery's default, 0


def test_a_migrated_task_keeps_its_place_among_plain_ones_on_redis(tmp_path: Path) -> None:
    """Normal OJS priority (0) is sent as plain Celery sends a task without one: an OJS task's
    message waits in the same Redis priority bucket as an unmigrated task's, where both are
    served first; a negative OJS priority waits behind them (bucket 9)."""
    queue = unique("prioq")
    app = Celery(unique("prio"), broker=redis_url(), set_as_current=False)
    app.conf.update(task_default_queue=queue)
    app.conf.ojs = {"store_url": f"sqlite:///{tmp_path / 'store.sqlite3'}", "events": False}
    install(app)

    @app.task(shared=False, name="prio.ojs", base=OJSTask)
    def migrated() -> None: ...

    @app.task(shared=False, name="prio.plain")
    def unmigrated() -> None: ...

    client = redis.Redis.from_url(redis_url())
    try:
        unmigrated.delay()
        migrated.delay()
        enqueue({"type": "prio.ojs", "args": [], "priority": -100}, app=app)
        get_runtime(app).flush()
        first = [json.loads(raw)["headers"]["task"] for raw in client.lrange(queue, 0, -1)]
        assert sorted(first) == ["prio.ojs", "prio.plain"]
        behind = client.lrange(f"{queue}\x06\x169", 0, -1)  # kombu's bucket 9
        assert [json.loads(raw)["headers"]["task"] for raw in behind] == ["prio.ojs"]
    finally:
        get_runtime(app).close()
        app.close()
        client.delete(queue, *client.keys(f"{queue}\x06\x16*"), f"_kombu.binding.{queue}",
                      f"_kombu.binding_permanent.{queue}")
        client.close()


def test_queue_names_in_the_record(app: Celery) -> None:
    assert ojs_queue_of(app, "celery") == "default"  # the app's default queue
    assert ojs_queue_of(app, "proj:high_Priority") == "proj:high_Priority"
    with pytest.raises(InvalidJob, match="task_default_queue"):
        ojs_queue_of(app, "default")  # would be read back as the app's default queue
    app.conf.task_default_queue = "default"
    assert ojs_queue_of(app, "default") == "default"


def test_an_envelope_cannot_set_the_marker() -> None:
    with pytest.raises(ValueError, match=CELERY_SEMANTICS_FIELD):
        parse_envelope({"type": "a", "args": [], CELERY_SEMANTICS_FIELD: {"max_retries": 9}})


def _celery_job(errors: list[str], attempt: int) -> Job:
    job = parse_envelope({"type": "a", "args": []}).model_copy(update={
        CELERY_SEMANTICS_FIELD: {"max_retries": 3, "default_retry_delay": 180.0}})
    job.errors = [{"type": t, "message": "m"} for t in errors]
    job.attempt = attempt
    return job


def test_decide_for_a_celery_callers_job() -> None:
    now = time.time()
    job = _celery_job(["ValueError", "worker_death"], attempt=3)
    assert celery_retries(job) == 1  # the recovery does not count
    # a requested retry: the handler's delay, else default_retry_delay; attempts do not bound it
    assert decide(job, "ValueError", now, delay=2.0).delay == 2.0
    assert decide(job, "ValueError", now).delay == 180.0
    # an execution timeout ends the job, as in Celery
    assert not decide(job, "timeout", now).retry
    # recoveries: the OJS policy, on their own budget (max_attempts 3: two recoveries retried)
    assert decide(job, "stalled", now).retry
    assert not decide(_celery_job(["worker_death", "stalled"], 3), "shutdown", now).retry
    # Reject(requeue=True): a redelivery at once, no Celery retry, on the recoveries' budget
    rejected = _celery_job(["Reject", "ValueError"], attempt=3)
    assert celery_retries(rejected) == 1
    assert decide(rejected, "Reject", now, delay=0.0) == decide(job, "Reject", now, delay=0.0)
    assert decide(rejected, "Reject", now, delay=0.0).delay == 0.0
    assert not decide(_celery_job(["Reject", "stalled"], 3), "Reject", now, delay=0.0).retry


# --------------------------------------------------------------------------- end to end


def _runs(env: Env, tag: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in env.lines("celery") if line.split(" ")[0] == tag]


def _failure(env: Env, job_id: str) -> AsyncResult:
    result = AsyncResult(job_id, app=env.app)
    wait_for(lambda: result.state == "FAILURE", 20, f"FAILURE of {job_id}")
    return result


def test_exception_without_retry_options_ends_the_job(env: Env) -> None:
    tag = unique("fails")
    result = env.app.tasks["e2e.celery_fails"].delay(tag)
    job = env.wait_state(result.id, "discarded")
    assert job.attempt == 1
    assert job.error is not None and job.error["type"] == "ValueError"
    assert isinstance(_failure(env, result.id).result, ValueError)
    assert _runs(env, tag) == ["retries=0"]
    assert (job.model_extra or {})[CELERY_SEMANTICS_FIELD]["max_retries"] == 3


def test_self_retry_uses_countdown_and_max_retries(env: Env) -> None:
    tag = unique("retry")
    result = env.app.tasks["e2e.celery_self_retry"].delay(tag)
    job = env.wait_state(result.id, "discarded", timeout=40)
    assert job.attempt == 3
    assert _runs(env, tag) == ["retries=0", "retries=1", "retries=2"]
    assert isinstance(_failure(env, result.id).result, ValueError)
    # task_retry's reason, which the worker logs ("retry: Retry in 1s: ValueError(...)"), is
    # the Retry Celery's own retry makes
    assert [line.split(" ", 1)[1] for line in env.lines("retry_signal")
            if line.startswith(result.id)] == [f"Retry in 1s: ValueError('{tag} not yet')"] * 2


def test_a_retry_past_max_retries_raises_celery_s_error_naming_the_retry_s_arguments(
    env: Env
) -> None:
    """``self.retry(args=...)`` past ``max_retries`` without ``exc`` ends the job with Celery's
    ``MaxRetriesExceededError``, worded as Celery words it: the arguments the retry would have
    had (it named the attempt's own)."""
    tag = unique("limit")
    result = env.app.tasks["e2e.celery_retry_past_limit"].delay(tag)
    env.wait_state(result.id, "discarded", timeout=40)
    error = _failure(env, result.id).result
    assert isinstance(error, MaxRetriesExceededError)
    assert str(error) == (f"Can't retry e2e.celery_retry_past_limit[{result.id}] "
                          f"args:('{tag}', 'next') kwargs:{{}}")  # a tuple, as Celery's


def test_retry_replaces_args_and_kwargs(env: Env) -> None:
    tag = unique("args")
    result = env.app.tasks["e2e.celery_retry_args"].delay(0, tag=tag)
    job = env.wait_state(result.id, "completed", timeout=40)
    assert job.result == "done at 2"
    assert _runs(env, tag) == ["step=0 retries=0", "step=1 retries=1", "step=2 retries=2"]


def test_autoretry_for_with_backoff_and_max_retries(env: Env) -> None:
    tag = unique("auto")
    result = env.app.tasks["e2e.celery_autoretry"].delay(tag)
    job = env.wait_state(result.id, "discarded", timeout=40)
    assert job.attempt == 2
    runs = _runs(env, tag)
    assert [r.split(" ")[0] for r in runs] == ["retries=0", "retries=1"]
    first, second = (float(r.split("at=")[1]) for r in runs)
    assert second - first >= 0.9  # retry_backoff: 1 * 2**0 seconds before the retry
    assert isinstance(_failure(env, result.id).result, ValueError)


def test_time_limits_end_the_job_as_in_celery(env: Env) -> None:
    tag = unique("limit")
    result = env.app.tasks["e2e.celery_time_limit"].delay(tag)
    job = env.wait_state(result.id, "discarded", timeout=40)
    assert (job.timeout, job.grace_period) == (1, 1)
    assert job.attempt == 1
    assert job.error is not None and job.error["type"] == "timeout"
    assert "TimeLimitExceeded" in type(_failure(env, result.id).result).__name__
    assert _runs(env, tag) == ["attempt=1"]


def test_an_envelope_without_a_grace_period_gets_no_soft_limit_from_its_task(env: Env) -> None:
    """An envelope's ``timeout`` of 3 s with ``grace_period`` 0, for a task whose own
    ``soft_time_limit`` is 1 s: the job's limits are its only ones, so the attempt runs to its
    timeout (Celery's worker would fall back to the task's soft limit, at 1 s)."""
    tag = unique("nograce")
    job = enqueue({"type": "e2e.celery_time_limit", "args": [tag], "timeout": 3,
                   "grace_period": 0, "retry": {"max_attempts": 1}}, app=env.app)
    done = env.wait_state(job.id, "discarded", timeout=40)
    assert done.error is not None and done.error["type"] == "timeout", done.error
    assert float(done.error["elapsed_seconds"]) >= 2.9, done.error
    assert _runs(env, tag) == ["attempt=1"]


def test_an_envelope_without_a_grace_period_is_not_cancelled_at_its_timeout(env: Env) -> None:
    """A job with ``grace_period`` 0 has no soft limit at all: at its timeout the pool ends
    it, and its handler never sees a ``SoftTimeLimitExceeded`` (one that catches it, as this
    one does, records it and saves a checkpoint). Celery's prefork pool sends the soft limit
    first whenever it is given one, even one equal to the hard limit (its event loop arms the
    hard limit only once the soft one fires)."""
    job = enqueue({"type": "e2e.resumable", "args": [30], "timeout": 2, "grace_period": 0,
                   "retry": {"max_attempts": 1}}, app=env.app)
    done = env.wait_state(job.id, "discarded", timeout=40)
    assert done.error is not None and done.error["type"] == "timeout", done.error
    assert [line for line in env.lines("cancelled") if line.startswith(job.id)] == []
    assert done.last_checkpoint is None


def test_a_hard_time_limit_ends_the_job_as_in_celery(env: Env) -> None:
    tag = unique("hard")
    result = env.app.tasks["e2e.celery_hard_limit"].delay(tag)
    job = env.wait_state(result.id, "discarded", timeout=40)
    assert (job.timeout, job.grace_period) == (1, 0)
    assert job.attempt == 1
    assert job.error is not None and job.error["type"] == "timeout"
    assert type(_failure(env, result.id).result).__name__ == "TimeLimitExceeded"
    assert _runs(env, tag) == ["attempt=1"]


def test_eta_and_expires_given_as_iso_text_run_and_expire_as_in_celery(env: Env) -> None:
    """``apply_async(eta="...", expires="...")`` with ISO 8601 text, as plain Celery takes it:
    the job runs at its ETA, and one whose ``expires`` passed before its ETA is revoked
    (``expired``) without running."""
    now = datetime.now(timezone.utc)
    task = env.app.tasks["e2e.celery_fails"]
    ran = unique("isoeta")
    result = env.app.tasks["e2e.add"].apply_async(
        (2, 3), eta=(now + timedelta(seconds=1)).isoformat(),
        expires=(now + timedelta(seconds=60)).replace(tzinfo=None).isoformat())
    assert result.get(timeout=30) == 5
    late = task.apply_async((ran,), countdown=2, expires=(now + timedelta(seconds=1)).isoformat())
    job = env.wait_state(late.id, "discarded", timeout=30)
    assert job.error is not None and job.error["type"] == "expired"
    assert _runs(env, ran) == []
    tag = unique("retryeta")
    retried = env.app.tasks["e2e.celery_retry_eta_text"].delay(tag)
    assert retried.get(timeout=30) == 1
    assert _runs(env, tag) == ["retries=0", "retries=1"]
    # as Celery's own retry says it ("Retry at <eta>"), not as the seconds left until it
    [reason] = [line.split(" ", 1)[1] for line in env.lines("retry_signal")
                if line.startswith(retried.id)]
    assert reason.startswith("Retry at 20") and reason.endswith("+00:00"), reason


def test_a_countdown_wins_over_an_eta_given_with_it_as_in_celery(env: Env) -> None:
    """Celery makes a message's ETA from the ``countdown`` when a call (or ``self.retry``)
    gives both: the job runs after the countdown, not at the ``eta``."""
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    assert env.app.tasks["e2e.add"].apply_async((1, 1), eta=later, countdown=1).get(
        timeout=30) == 2
    tag = unique("etacountdown")
    retried = env.app.tasks["e2e.celery_retry_eta_and_countdown"].delay(tag)
    assert retried.get(timeout=30) == 1
    assert _runs(env, tag) == ["retries=0", "retries=1"]
    assert [line.split(" ", 1)[1] for line in env.lines("retry_signal")
            if line.startswith(retried.id)] == ["Retry in 1s"]


def test_expires_is_checked_at_a_retry(env: Env) -> None:
    tag = unique("expires")
    result = env.app.tasks["e2e.celery_retry_later"].apply_async(args=[tag, 6], expires=4)
    job = env.wait_state(result.id, "discarded", timeout=40)
    assert job.error is not None and job.error["type"] == "expired"
    assert job.expires_at is not None
    assert _runs(env, tag) == ["retries=0"]
    # as Celery's worker announces an expired message (the signal comes from the pool child)
    wait_for(lambda: f"{result.id} terminated=False expired=True" in env.lines("revoked"), 10,
             "task_revoked(expired=True)")


def test_a_calls_custom_headers_and_expires_reach_every_attempt_as_in_celery(env: Env) -> None:
    """``apply_async(headers={...})`` (tenant ids, request ids): Celery's worker shows each
    custom header in ``self.request`` and its retry keeps them; ``self.request.expires`` is
    the call's ``expires``. Both used to be dropped (None). A header of Celery's own name
    (``retries``) cannot rewrite the message."""
    tag = unique("headers")
    result = env.app.tasks["e2e.celery_headers"].apply_async(
        (tag,), headers={"x_tenant": "acme", "retries": 7}, expires=600)
    assert result.get(timeout=30) == "acme"
    expires_at = env.job(result.id).expires_at
    assert expires_at is not None
    seen = f"tenant=acme headers=acme expires={expires_at.isoformat()}"
    assert _runs(env, tag) == [f"retries=0 {seen}", f"retries=1 {seen}"]


def test_a_call_made_in_a_task_keeps_that_parent_at_its_retries_as_in_celery(env: Env) -> None:
    """A task called from inside another has it as ``parent_id`` and ``root_id``, and Celery's
    retry keeps them; the retry used to name the retrying job itself as its parent."""
    tag = unique("lineage")
    parent = env.app.tasks["e2e.celery_spawns"].delay(tag)
    child = AsyncResult(parent.get(timeout=30), app=env.app)
    assert child.get(timeout=30) == 1
    seen = f"parent={parent.id} root={parent.id}"
    assert _runs(env, tag) == [f"retries=0 {seen}", f"retries=1 {seen}"]


def test_the_same_task_id_called_from_other_tasks_is_the_same_call(env: Env) -> None:
    """A task id chosen to keep one job pending (a dispatcher task run by beat, a web
    request) names one call wherever it is made from: the parent a call inside a task keeps
    is not part of it, so the later calls get the first job back, as plain Celery's never
    fail there (they used to raise DuplicateJob)."""
    child_id = unique("once")
    spawner = env.app.tasks["e2e.celery_spawns_once"]
    first, second = spawner.delay(child_id), spawner.delay(child_id)
    assert first.get(timeout=30) == second.get(timeout=30) == child_id
    assert env.app.tasks["e2e.noop"].apply_async(task_id=child_id).id == child_id
    assert env.wait_state(child_id, "completed").attempt == 1


def test_a_datetime_or_decimal_result_reaches_the_caller_as_in_celery(env: Env) -> None:
    """Celery's JSON serializer carries a ``datetime`` or ``Decimal`` result as a typed value:
    the caller gets it back, and the job's record keeps that JSON. Such a result used to fail
    the job (``TypeError``)."""
    result = env.app.tasks["e2e.celery_returns_typed"].delay(2030)
    assert result.get(timeout=30) == {"at": datetime(2030, 1, 2, tzinfo=timezone.utc),
                                      "amount": Decimal("1.50")}
    assert env.job(result.id).result == {
        "at": {"__type__": "datetime", "__value__": "2030-01-02T00:00:00+00:00"},
        "amount": {"__type__": "decimal", "__value__": "1.50"}}


def test_typed_arguments_reach_the_handler_and_its_retries_as_in_celery(env: Env) -> None:
    """A ``datetime``, ``date``, ``time``, ``Decimal``, ``UUID`` or ``bytes`` argument (in args
    or kwargs, nested too) arrives in the handler as that value, as Celery's JSON serializer
    carries it, in every attempt; ``self.retry(args=..., kwargs=...)`` may give new ones. The
    record keeps them as that serializer's JSON. Such a call used to raise ``InvalidJob``."""
    tag = unique("typed")
    at = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
    values = (at, [Decimal("1.10"), b"\xff", b"text"])
    named = {"ref": UUID(int=7), "day": {"d": date(2030, 1, 1), "t": dt_time(3, 4, 5)}}
    result = env.app.tasks["e2e.celery_typed_retries"].delay(tag, *values, **named)
    assert result.get(timeout=30) == {"values": [date(2031, 1, 1)],
                                      "named": {"amount": Decimal("2.5")}}
    assert [line for line in env.lines("typed") if line.startswith(tag + " ")] == [
        f"{tag} retries=0 {values!r} {named!r}",
        f"{tag} retries=1 {values!r} {named!r}",
        f"{tag} retries=2 {(date(2031, 1, 1),)!r} {{'amount': Decimal('2.5')}}"]
    job = env.job(result.id)
    assert job.args == [tag, {"__type__": "date", "__value__": "2031-01-01"}]
    assert (job.model_extra or {})["x_celery_kwargs"] == {
        "amount": {"__type__": "decimal", "__value__": "2.5"}}


def test_typed_arguments_survive_autoretry_and_the_ojs_retry_policy(env: Env) -> None:
    """The attempts Celery's ``autoretry_for`` and the OJS retry policy publish from the
    record get the arguments back as the values the call gave."""
    tag = unique("typedretry")
    at = datetime(2030, 1, 2, tzinfo=timezone(timedelta(hours=5, minutes=30)))
    auto = env.app.tasks["e2e.celery_typed_autoretry"].delay(tag + "a", when=at)
    ojs = env.app.tasks["e2e.ojs_typed"].delay(tag + "o", Decimal("-0.5"))
    assert auto.get(timeout=30) == at
    assert ojs.get(timeout=30) == Decimal("-0.5")
    assert env.job(auto.id).model_extra["x_celery_kwargs"] == {  # type: ignore[index]
        "when": {"__type__": "datetime", "__value__": "2030-01-02T00:00:00+05:30"}}
    assert env.job(ojs.id).args == [tag + "o", {"__type__": "decimal", "__value__": "-0.5"}]
    runs = [line for line in env.lines("typed") if line.startswith(tag)]
    assert sorted(runs) == sorted([f"{tag}a retries=0 {at!r}", f"{tag}a retries=1 {at!r}",
                                   f"{tag}o attempt=1 Decimal('-0.5')",
                                   f"{tag}o attempt=2 Decimal('-0.5')"])


def test_typed_arguments_by_name_and_in_canvas_as_in_celery(env: Env) -> None:
    """``send_task`` by name, a chain's later links, a group, a chord's members and body and
    a ``link`` callback carry typed arguments to their handlers, as in plain Celery."""
    tag = unique("typedcanvas")
    echo = env.app.tasks["e2e.typed_echo"]
    at = datetime(2030, 1, 2, tzinfo=timezone.utc)
    by_name = env.app.send_task("e2e.typed_echo", args=[tag + "n", at],
                                kwargs={"amount": Decimal("1.5")})
    assert by_name.get(timeout=30) == {"values": [tag + "n", at],
                                       "named": {"amount": Decimal("1.5")}}
    chained = chain(echo.si(tag + "c1", at), echo.si(tag + "c2", UUID(int=3))).apply_async()
    assert chained.get(timeout=30) == {"values": [tag + "c2", UUID(int=3)], "named": {}}
    grouped = group(echo.si(tag + "g", date(2030, 1, day)) for day in (1, 2)).apply_async()
    assert grouped.get(timeout=30) == [{"values": [tag + "g", date(2030, 1, day)], "named": {}}
                                       for day in (1, 2)]
    chorded = chord([echo.si(tag + "m", b"raw")], echo.s(tag + "b", when=at)).apply_async()
    member = {"values": [tag + "m", b"raw"], "named": {}}
    assert chorded.get(timeout=30) == {"values": [[member], tag + "b"], "named": {"when": at}}
    linked = echo.apply_async((tag + "l",), link=echo.si(tag + "k", dt_time(1, 2)))
    assert linked.get(timeout=30) == {"values": [tag + "l"], "named": {}}
    wait_for(lambda: any(tag + "k" in line for line in env.lines("typed")), 30, "the link ran")
    assert f"echo ({tag + 'k'!r}, datetime.time(1, 2)) {{}}" in env.lines("typed")


@pytest.mark.parametrize("value", ["set", "object"])
def test_a_retry_with_arguments_json_cannot_carry_ends_the_job_naming_them(
        env: Env, value: str) -> None:
    """``self.retry(kwargs=...)`` is checked as the call is: a set or an object (which
    Celery's JSON serializer cannot write either) would fail the outcome's write. The retry
    raises InvalidJob, which ends the job."""
    tag = unique("retrybad")
    result = env.app.tasks["e2e.celery_retry_with"].delay(tag, value)
    job = env.wait_state(result.id, "discarded", timeout=30)
    assert job.error is not None and job.error["type"] == "InvalidJob"
    assert "x_celery_kwargs.extra: input was not a valid JSON value" in str(job.error["message"])
    assert type(_failure(env, result.id).result).__name__ == "InvalidJob"
    assert _runs(env, tag) == ["retries=0"]


def test_an_envelope_keeps_the_ojs_defaults(env: Env) -> None:
    tag = unique("envelope")
    job = enqueue({"type": "e2e.celery_fails", "args": [tag],
                   "retry": {"max_attempts": 2, "initial_interval": "PT0.1S"}}, app=env.app)
    done = env.wait_state(job.id, "discarded", timeout=30)
    assert done.attempt == 2
    assert CELERY_SEMANTICS_FIELD not in (done.model_extra or {})
    assert _runs(env, tag) == ["retries=0", "retries=1"]


def test_ojs_semantics_option_gives_a_celery_caller_the_ojs_policy(env: Env) -> None:
    tag = unique("ojs")
    result = env.app.tasks["e2e.ojs_semantics"].delay(tag)
    job = env.wait_state(result.id, "discarded", timeout=40)
    assert job.attempt == 3  # the OJS default policy: three attempts
    assert _runs(env, tag) == ["attempt=1", "attempt=2", "attempt=3"]


def test_a_recovery_retries_on_its_own_budget_and_is_no_celery_retry(env: Env) -> None:
    tag = unique("dies")
    result = env.app.tasks["e2e.celery_dies_once"].delay(tag)
    job = env.wait_state(result.id, "completed", timeout=60)
    assert [e["type"] for e in job.errors] == ["WorkerLostError", "Retry"]
    assert _runs(env, tag) == ["attempt=1 retries=0", "attempt=2 retries=0",
                               "attempt=3 retries=1"]
    assert job.result == 1
    # the worker's log names the job whose pool process was lost, as Celery's does a failure
    assert (f"job {result.id} (e2e.celery_dies_once) lost its pool process"
            in env.worker.log())


def test_reject_with_requeue_is_a_redelivery_not_a_celery_retry(env: Env) -> None:
    tag = unique("reject")
    result = env.app.tasks["e2e.celery_rejects_once"].delay(tag)
    job = env.wait_state(result.id, "completed", timeout=40)
    assert [e["type"] for e in job.errors] == ["Reject", "Retry"]
    assert _runs(env, tag) == ["attempt=1 retries=0", "attempt=2 retries=0",
                               "attempt=3 retries=1"]  # max_retries=1 still allowed the retry
    assert AsyncResult(result.id, app=env.app).get(timeout=10) == 1


def test_a_handler_that_always_rejects_ends_on_the_recoveries_budget(env: Env) -> None:
    result = env.app.tasks["e2e.reject"].delay(True)
    job = env.wait_state(result.id, "discarded", timeout=40)
    assert job.attempt == 3  # the OJS policy's max_attempts, where Celery redelivers for ever
    assert [e["type"] for e in job.errors] == ["Reject", "Reject", "Reject"]


def test_a_job_retried_for_ever_keeps_its_last_errors_and_every_count() -> None:
    """``max_retries=None`` retries for ever: the error history keeps its last
    ``ERRORS_KEPT`` entries, so the record, and every write and message of it, stays bounded;
    ``self.request.retries`` and the recoveries' budget still count every failure, also after
    the record went through the store's encoding."""
    now = time.time()
    policy = Policy()
    job = parse_envelope({"type": "a", "args": [], "retry": {"max_attempts": 1000}})
    job = job.model_copy(update={
        CELERY_SEMANTICS_FIELD: {"max_retries": None, "default_retry_delay": 0.0}})
    record = create(job, now, policy).record
    for n in range(250):
        assert record is not None
        record = start(record, record.token, "w", now, policy).record
        assert record is not None and record.job.state == "active"
        kind = "stalled" if n % 5 == 4 else "ValueError"
        record = fail(record, record.job.attempt, "w", make_error(kind, "m"), now,
                      delay=0.0).record
        assert record is not None and record.job.state == "retryable"
        record.job = decode_job(encode_job(record.job))  # as the store keeps it
    assert record is not None
    errors = record.job.errors
    assert len(errors) == ERRORS_KEPT
    assert [entry["attempt"] for entry in errors] == list(range(151, 251))
    assert celery_retries(record.job) == 200 and recoveries(record.job) == 50
    assert (record.job.model_extra or {})[ERRORS_DROPPED_FIELD] == {
        "retries": 120, "recoveries": 30, "dispatch": 0}
    assert record.job.same_request(job)  # the same call again finds its job, not a duplicate


def test_an_envelope_cannot_set_the_dropped_errors_counts() -> None:
    with pytest.raises(ValueError, match=ERRORS_DROPPED_FIELD):
        parse_envelope({"type": "a", "args": [], ERRORS_DROPPED_FIELD: {"retries": 9}})
