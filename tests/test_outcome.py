"""What a handler's return comes to: a result must be JSON data, as the job's JSON holds it."""

from __future__ import annotations

import logging
import math
import time
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

import pytest

from ojs_celery import task as task_module
from ojs_celery.lifecycle import Transition
from ojs_celery.outcome import Completed, Failed, run_handler
from ojs_celery.store import StoreError


@pytest.mark.parametrize("value", [1.5, -0.0, 1e308, [1, {"a": None}], "x", None])
def test_a_json_result_completes_the_attempt(value: Any) -> None:
    assert run_handler(lambda: value) == Completed(value)


@pytest.mark.parametrize("value", [math.inf, [1, {"a": -math.inf}], math.nan,
                                   datetime.now(timezone.utc), {1, 2}])
def test_a_result_json_cannot_carry_fails_the_attempt_naming_why(value: Any) -> None:
    outcome = run_handler(lambda: value)
    assert isinstance(outcome, Failed)
    assert isinstance(outcome.exc, TypeError)
    assert str(outcome.exc).startswith("result is not JSON-serialisable: ")


def test_an_outcome_is_written_however_long_the_store_refuses_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A finished attempt's outcome is retried until the store takes it: giving up (it did
    after 30 s) acknowledged the message and left the job active until a clock ran it a second
    time (a read-only failover of 45 s did that). The wait is said once a minute, not at every
    try. The clock is simulated: ten minutes of refusals, then the write goes through."""
    clock = [0.0]
    monkeypatch.setattr(task_module, "time", SimpleNamespace(
        monotonic=lambda: clock[0], time=time.time,
        sleep=lambda seconds: clock.__setitem__(0, clock[0] + seconds)))
    written = Transition(record=None, reason="written")

    def write() -> Transition:
        if clock[0] < 600:
            raise StoreError("job store error: ReadOnlyError: You can't write against a replica")
        return written

    with caplog.at_level(logging.WARNING, logger="ojs_celery.task"):
        assert task_module._write(write) is written
    said = [r.getMessage() for r in caplog.records if r.name == "ojs_celery.task"]
    assert 10 <= len(said) <= 12 and all("retrying until it is taken" in line for line in said)
