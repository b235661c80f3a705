"""What a handler's return comes to: a result must be JSON data, as the job's JSON holds it, or
a typed value of Celery's JSON serializer (kept as its JSON)."""

from __future__ import annotations

import json
import logging
import math
import time
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from uuid import UUID

import pytest
from kombu.utils.json import loads as kombu_loads

from ojs_celery import task as task_module
from ojs_celery.envelope import Job
from ojs_celery.lifecycle import Transition
from ojs_celery.outcome import Completed, Failed, run_handler
from ojs_celery.store import StoreError, open_store
from tests.test_store_faults import unanswered_once


@pytest.mark.parametrize("value", [1.5, -0.0, 1e308, [1, {"a": None}], "x", None])
def test_a_json_result_completes_the_attempt(value: Any) -> None:
    assert run_handler(lambda: value) == Completed(value)


def test_a_value_celerys_json_serializer_types_completes_with_its_typed_json() -> None:
    """A datetime, Decimal, UUID or bytes result (which Celery's JSON serializer writes as
    ``{"__type__": ..., "__value__": ...}`` and reads back): Celery gets the value, the record
    keeps that JSON; a plain Celery task may return one, so a migrated one may too."""
    at = datetime(2030, 1, 2, tzinfo=timezone.utc)
    value = {"at": at, "amount": Decimal("1.50"), "id": UUID(int=5), "raw": b"ab"}
    outcome = run_handler(lambda: value)
    assert isinstance(outcome, Completed) and outcome.value is value
    assert outcome.result == {
        "at": {"__type__": "datetime", "__value__": "2030-01-02T00:00:00+00:00"},
        "amount": {"__type__": "decimal", "__value__": "1.50"},
        "id": {"__type__": "uuid", "__value__": {"hex": "0" * 31 + "5"}},
        "raw": {"__type__": "bytes", "__value__": "ab"}}
    assert kombu_loads(json.dumps(outcome.result)) == value


@pytest.mark.parametrize("value", [math.inf, [1, {"a": -math.inf}], math.nan,
                                   [datetime.now(timezone.utc), math.nan], {1, 2}, object(),
                                   "report-\udcff.csv", {"k\udcff": 1}, ["\ud800"]])
def test_a_result_json_cannot_carry_fails_the_attempt_naming_why(value: Any) -> None:
    outcome = run_handler(lambda: value)
    assert isinstance(outcome, Failed)
    assert isinstance(outcome.exc, TypeError)
    assert str(outcome.exc).startswith("result is not JSON-serialisable: ")


@pytest.mark.parametrize(("refused_for", "written"), [(600.0, True), (1000.0, False)])
def test_an_outcome_the_store_refuses_is_retried_up_to_the_attempts_end(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, refused_for: float,
    written: bool, tmp_path: Path,
) -> None:
    """A finished attempt's outcome is retried while the store refuses it, up to the end of
    the attempt's timeout and grace period (here 900 s from its start): giving up after 30 s
    acknowledged the message and left the job active until a clock ran it a second time (a
    read-only failover of 45 s did that). Past the attempt's end it gives up, so that a pool
    without a hard time limit does not wait for ever. The wait is said once a minute, not at
    every try. The clock is simulated."""
    clock = [0.0]
    monkeypatch.setattr(task_module, "time", SimpleNamespace(
        monotonic=lambda: clock[0], time=time.time,
        sleep=lambda seconds: clock.__setitem__(0, clock[0] + seconds)))
    ctx = SimpleNamespace(started=0.0, job=SimpleNamespace(timeout=870, grace_period=30))
    taken = Transition(record=None, reason="written")
    store = open_store(f"sqlite:///{tmp_path / 'store.sqlite3'}")  # never written here

    def write() -> Transition:
        if clock[0] < refused_for:
            raise StoreError("job store error: ReadOnlyError: You can't write against a replica")
        return taken

    with caplog.at_level(logging.WARNING, logger="ojs_celery.task"):
        done = task_module._write(store, write, ctx)  # type: ignore[arg-type]
    assert (done is taken) is written
    said = [r.getMessage() for r in caplog.records if r.name == "ojs_celery.task"]
    if written:
        assert 10 <= len(said) <= 12 and all("retrying" in line for line in said)
    else:
        assert clock[0] == 900 and "giving up writing an outcome after 900s" in said[-1]


def test_an_outcome_retried_after_no_answer_is_known_as_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """The outcome's first try is done by the store but its reply is lost to a timeout; the
    retry (``_write``) finds the job completed by that very write and returns its completion,
    rather than a refusal that would keep the result from Celery."""
    monkeypatch.setattr(task_module, "time", SimpleNamespace(
        monotonic=time.monotonic, time=time.time, sleep=lambda seconds: None))
    store = open_store(f"sqlite:///{tmp_path / 'store.sqlite3'}")
    job = Job.model_validate({"type": "outcome.job", "args": []})
    store.create(job)
    started = store.start(job.id, 1, "w1").record
    assert started is not None
    ctx = SimpleNamespace(started=time.monotonic(), job=started.job)
    unanswered_once(store)
    done = task_module._write(  # type: ignore[arg-type]
        store, lambda: store.complete(job.id, 1, "w1", "the result", hint=started), ctx)
    assert done is not None and done.record is not None, done
    assert done.record.job.result == "the result"
    store.close()
