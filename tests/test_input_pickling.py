"""Every exception the package raises survives pickling: a prefork child sends what its task
raised to the worker's main process, which must be able to rebuild it."""

from __future__ import annotations

import json
import pickle

import pytest
from celery import Celery

from ojs_celery import (
    BrokerUnavailable,
    DuplicateJob,
    InvalidJob,
    JobError,
    JobNotFound,
    NoCurrentJob,
    NotInstalled,
    StoreError,
)
from ojs_celery.outcome import RetryRequested
from ojs_celery.runtime import UnknownType
from ojs_celery.store import DuplicateJob as StoredDuplicate

EXCEPTIONS = [
    InvalidJob([("args[0]", "is bad"), ("queue", "is not declared")]),
    DuplicateJob("01a1fc00-0000-7000-8000-000000000001"),
    JobError("declined", type="billing.declined", retryable=False),
    StoreError("job store unavailable"),
    BrokerUnavailable("broker down"),
    JobNotFound("no job with id x"),
    NotInstalled("not installed"),
    NoCurrentJob("outside a job"),
    UnknownType("type: 'x' is not an OJS task"),
    StoredDuplicate("01a1fc00-0000-7000-8000-000000000001"),
    RetryRequested(ValueError("not yet"), 0.5),
]


@pytest.mark.parametrize("exc", EXCEPTIONS, ids=lambda e: type(e).__name__)
def test_round_trip(exc: BaseException) -> None:
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert {k: v for k, v in vars(back).items() if k != "exc"} == {
        k: v for k, v in vars(exc).items() if k != "exc"}


def test_round_trip_keeps_what_callers_read() -> None:
    invalid = pickle.loads(pickle.dumps(EXCEPTIONS[0]))
    assert isinstance(invalid, InvalidJob)
    assert invalid.violations == [("args[0]", "is bad"), ("queue", "is not declared")]
    duplicate = pickle.loads(pickle.dumps(EXCEPTIONS[1]))
    assert isinstance(duplicate, DuplicateJob)
    assert duplicate.job_id == "01a1fc00-0000-7000-8000-000000000001"
    assert duplicate.violations == EXCEPTIONS[1].violations  # type: ignore[attr-defined]
    job_error = pickle.loads(pickle.dumps(EXCEPTIONS[2]))
    assert (job_error.type, job_error.retryable) == ("billing.declined", False)
    retry = pickle.loads(pickle.dumps(EXCEPTIONS[-1]))
    assert isinstance(retry.exc, ValueError) and retry.delay == 0.5


@pytest.mark.parametrize("exc", EXCEPTIONS[:-1], ids=lambda e: type(e).__name__)
def test_celerys_json_results_rebuild_them(exc: BaseException) -> None:
    """A task's exception in a result backend with Celery's JSON serializer (its default) is
    rebuilt from its ``args``: ``AsyncResult.result`` is the same exception, not a bare
    ``Exception`` (RetryRequested, the last, never reaches a backend)."""
    backend = Celery(set_as_current=False).backend
    stored = json.loads(json.dumps(backend.prepare_exception(exc, serializer="json")))
    back = backend.exception_to_python(stored)
    assert type(back) is type(exc)
    assert str(back) == str(exc)
