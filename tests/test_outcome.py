"""What a handler's return comes to: a result must be JSON data, as the job's JSON holds it."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any

import pytest

from ojs_celery.outcome import Completed, Failed, run_handler


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
