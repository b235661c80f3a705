"""A worker's logs: the sweep task's routine lines and OJS timeouts' tracebacks are quiet."""

from __future__ import annotations

import logging

import pytest
from billiard.exceptions import SoftTimeLimitExceeded
from celery import Celery
from celery.exceptions import Reject

from ojs_celery import OJSTask
from ojs_celery.logs import quiet_worker_logs
from ojs_celery.sweeper import SWEEP_TASK


def _raised(exc: BaseException) -> tuple[type[BaseException], BaseException, None]:
    return type(exc), exc, None


@pytest.fixture
def quiet_app() -> Celery:
    app = Celery("quiet_logs", set_as_current=False)

    @app.task(name="quiet.ojs", base=OJSTask, shared=False)
    def ojs_job() -> None:
        return None

    @app.task(name="quiet.plain", shared=False)
    def plain_job() -> None:
        return None

    quiet_worker_logs(app, SWEEP_TASK)
    quiet_worker_logs(app, SWEEP_TASK)  # idempotent
    return app


def test_sweep_lines_go_and_ojs_timeouts_lose_their_traceback(
    quiet_app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    trace = logging.getLogger("celery.app.trace")
    strategy = logging.getLogger("celery.worker.strategy")
    assert sum(isinstance(f, logging.Filter) for f in trace.filters) >= 1
    with caplog.at_level(logging.INFO):
        strategy.info("Task %(name)s[%(id)s] received", {"name": SWEEP_TASK, "id": "s1"})
        trace.info("Task %(name)s[%(id)s] succeeded", {"name": SWEEP_TASK, "id": "s1"})
        strategy.info("Task %(name)s[%(id)s] received", {"name": "quiet.ojs", "id": "j1"})
        timeout = _raised(SoftTimeLimitExceeded())
        trace.error("Task %(name)s[%(id)s] raised", {"name": "quiet.ojs", "id": "j1"},
                    exc_info=timeout)
        trace.error("Task %(name)s[%(id)s] raised", {"name": "quiet.plain", "id": "p1"},
                    exc_info=_raised(SoftTimeLimitExceeded()))
        trace.error("Task %(name)s[%(id)s] raised", {"name": "quiet.ojs", "id": "j2"},
                    exc_info=_raised(ValueError("boom")))
        # the Reject that sends an OJS message back: OJS said why already, in one line
        trace.warning("Task %(name)s[%(id)s] reject requeue=True", {"name": "quiet.ojs",
                      "id": "j3"}, exc_info=_raised(Reject("store unreachable", requeue=True)))
        trace.warning("Task %(name)s[%(id)s] reject requeue=True", {"name": "quiet.plain",
                      "id": "p2"}, exc_info=_raised(Reject("a plain task's", requeue=True)))
    seen = [(r.args["id"], r.exc_info is not None) for r in caplog.records  # type: ignore[index]
            if r.name in ("celery.app.trace", "celery.worker.strategy")]
    assert seen == [("j1", False), ("j1", False), ("p1", True), ("j2", True), ("j3", False),
                    ("p2", True)]
