"""``ctx.progress()`` emits ``job.progress`` with the progress extension's fields, rate-limited."""

from __future__ import annotations

import pathlib
import re
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import pytest
from celery import Celery

from ojs_celery import OJSTask, enqueue, install, signals
from ojs_celery.context import JobContext
from ojs_celery.embedded import embedded_settings
from ojs_celery.runtime import Runtime


@pytest.fixture
def started(tmp_path: pathlib.Path) -> tuple[JobContext, Runtime]:
    """The context of a started job (attempt 1 on ``worker_p``) and its runtime, on the
    embedded default."""
    app = Celery("progress_events", set_as_current=False)
    app.conf.update(embedded_settings(tmp_path))
    app.conf.ojs = {**app.conf.ojs, "events": False}
    runtime = install(app)

    @app.task(shared=False, name="progress.job", base=OJSTask)
    def progress_job() -> None:
        return None

    job = enqueue({"type": "progress.job", "args": []}, app=app)
    started = runtime.store.start(job.id, 1, "worker_p")
    assert started.record is not None
    return JobContext(runtime, started.record, "worker_p"), runtime


def test_progress_events_at_most_one_a_second_and_always_the_last(
    started: tuple[JobContext, Runtime],
) -> None:
    ctx, runtime = started
    seen: list[dict[str, Any]] = []

    def on_progress(sender: Any = None, event: dict[str, Any] | None = None, **_: Any) -> None:
        assert event is not None
        seen.append(event["data"])

    signals.job_progress.connect(on_progress)
    try:
        assert ctx.progress(0.25, data={"page": 1})
        assert ctx.progress(0.5)  # within a second of the last event: stored, no event
        assert ctx.progress(1.0)  # done: always reported
    finally:
        signals.job_progress.disconnect(on_progress)
    assert [(e["progress"], e["progress_percent"]) for e in seen] == [(0.25, 25.0), (1.0, 100.0)]
    assert seen[0]["data"] == {"page": 1} and seen[0]["attempt"] == 1
    assert seen[0]["worker_id"] == "worker_p" and seen[0]["job_type"] == "progress.job"
    stored = runtime.store.get(ctx.job.id)
    assert stored is not None and stored.progress is not None
    assert stored.progress["progress"] == 1.0


def test_progress_refuses_what_the_record_cannot_hold_and_writes_nothing(
    started: tuple[JobContext, Runtime],
) -> None:
    """A handler's mistake is named at the call, before anything is written: an object with no
    JSON form failed the write with pydantic's traceback, a number that is not finite made the
    record's JSON unreadable to strict parsers. What JSON writes as text or as an array is
    kept so."""
    ctx, runtime = started
    assert ctx.progress(Decimal("0.5"), data={"pages": (1, 2)},
                        checkpoint={"at": datetime(2026, 1, 1, tzinfo=timezone.utc)})
    for call, said in [
        (lambda: ctx.progress(0.6, data=[object()]), "data: must be JSON data"),
        (lambda: ctx.progress(float("nan")), "value: must be a number, not NaN or an infinity"),
        (lambda: ctx.progress(float("-inf")), "value: must be a number, not NaN or an infinity"),
        (lambda: ctx.progress("most"), "value: must be a number, not NaN"),
        (lambda: ctx.progress(0.6, checkpoint={"x": float("inf")}),
         "checkpoint: must hold only finite"),
    ]:
        with pytest.raises(ValueError, match=re.escape(said)):
            call()
    stored = runtime.store.get(ctx.job.id)
    assert stored is not None and stored.last_checkpoint == {"at": "2026-01-01T00:00:00Z"}
    assert stored.progress is not None and stored.progress["progress"] == 0.5
    assert stored.progress["data"] == {"pages": [1, 2]}
