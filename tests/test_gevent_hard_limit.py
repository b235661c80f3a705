"""A hard time limit that strikes after the store accepted the attempt's outcome (gevent raises
its ``Timeout`` at the first switch after the limit: for a handler that computed past it without
yielding, inside the outcome's own store write). The result backend must say what the store
says, not stay PENDING. Needs gevent (a test dependency)."""

from __future__ import annotations

import pathlib
import time

import pytest

from tests.conftest import start_env
from tests.test_task_events import task_events, terminal

pytest.importorskip("gevent")
pytestmark = pytest.mark.timeout(120)


def test_a_completion_stored_before_the_hard_limit_reads_success(tmp_path: pathlib.Path) -> None:
    with start_env("redis", tmp_path, pool="gevent", concurrency=5, extra=["-E"]) as env:
        app = env.app
        with task_events(app) as seen:
            result = app.tasks["e2e.busy_past_limit"].apply_async(
                (3.0,), link=app.tasks["e2e.callback"].s(tag="linked"))
            assert result.get(timeout=30) == "done"  # not PENDING for ever
            time.sleep(2.0)
            ended = terminal(seen, result.id)
        assert env.job(result.id).state == "completed"
        log = env.worker.log()
        assert f"job {result.id} completed in the store before its attempt was stopped" in log
        assert [e["type"] for e in ended] == ["task-succeeded"]
        # Celery's trace sends links before it stores the result: one it never finished may
        # have sent them, so they are not sent again (at most once per accepted outcome)
        assert env.lines("callbacks") == []
