"""The sweeper's terminal outcomes reach Celery's result backend as Celery's worker would write
them (:func:`ojs_celery.effects.report_outcome`), and never for a rejected transition or a
caller that leaves the report to the worker's Celery trace."""

from __future__ import annotations

import pathlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import TimeLimitExceeded
from celery.result import AsyncResult

from ojs_celery import OJSTask, install
from ojs_celery.effects import JobDiscarded, carry_out
from ojs_celery.embedded import embedded_settings
from ojs_celery.envelope import Job
from ojs_celery.lifecycle import Record, Transition, make_error
from ojs_celery.runtime import get_runtime


@pytest.fixture
def app(tmp_path: pathlib.Path) -> Iterator[Celery]:
    app = Celery("report_test", set_as_current=False)
    app.conf.update(embedded_settings(tmp_path))
    install(app)

    @app.task(shared=False, name="report.work", base=OJSTask)
    def work() -> None:
        return None

    yield app
    get_runtime(app).store.close()


def ended(state: str, **fields: Any) -> Transition:
    job = Job.model_validate({"id": str(uuid.uuid4()), "type": "report.work", "args": [],
                              "state": state, **fields})
    return Transition(record=Record(job=job))


@pytest.mark.parametrize(("state", "fields", "celery_state", "exception"), [
    ("completed", {"result": 7}, "SUCCESS", None),
    ("discarded", {"error": make_error("timeout", "execution timeout of 1s exceeded")},
     "FAILURE", TimeLimitExceeded),
    ("discarded", {"error": make_error("stalled", "no heartbeat")}, "FAILURE", JobDiscarded),
    ("discarded", {"error": make_error("expired", "job expired")}, "REVOKED", None),
    ("cancelled", {}, "REVOKED", None),
])
def test_a_terminal_outcome_is_written_as_celery_would(
    app: Celery, state: str, fields: dict[str, Any], celery_state: str, exception: Any
) -> None:
    done = ended(state, **fields)
    carry_out(get_runtime(app), done, publish_message=False, report_result=True)
    assert done.record is not None
    result = AsyncResult(done.record.job.id, app=app)
    assert result.state == celery_state
    if exception is not None:
        assert isinstance(result.result, exception)
    elif celery_state == "SUCCESS":
        assert result.result == 7


def test_nothing_is_written_when_rejected_or_left_to_the_worker(app: Celery) -> None:
    runtime = get_runtime(app)
    carry_out(runtime, Transition(record=None, reason="stale"), report_result=True)
    done = ended("discarded", error=make_error("timeout", "late"))
    carry_out(runtime, done, publish_message=False)  # the worker's own outcome: Celery reports
    assert done.record is not None
    assert AsyncResult(done.record.job.id, app=app).state == "PENDING"
    retrying = ended("retryable", error=make_error("timeout", "retried"))
    carry_out(runtime, retrying, publish_message=False, report_result=True)
    assert retrying.record is not None
    assert AsyncResult(retrying.record.job.id, app=app).state == "PENDING"
