"""A Celery app on the embedded default: filesystem broker, SQLite job store, no server.

Used by ``examples/demo.py``; ``OJS_DEMO_DIR`` says where its files go.
"""

from __future__ import annotations

import os
import pathlib
import time

from billiard.exceptions import SoftTimeLimitExceeded
from celery import Celery

from ojs_celery import OJSTask, install
from ojs_celery.embedded import embedded_settings

BASE = pathlib.Path(os.environ.get("OJS_DEMO_DIR", ".ojs-demo"))

app = Celery("demo")
app.conf.update(embedded_settings(BASE))
install(app)

# Each job's envelope sets its own timeout; the tasks' limits are for Celery callers (a task
# without one gets ojs.default_timeout, and the worker warns at start).
LIMITS = {"time_limit": 120, "soft_time_limit": 100}


@app.task(name="demo.greet", base=OJSTask, **LIMITS)
def greet(name: str) -> str:
    """Completes at once."""
    return f"hello, {name}"


@app.task(name="demo.report", base=OJSTask, bind=True, **LIMITS)
def report(self: OJSTask, pages: int) -> int:
    """Too slow for its timeout: saves a checkpoint when cancelled, then overruns its grace."""
    ctx = self.ojs
    assert ctx is not None
    page = int((ctx.last_checkpoint or {}).get("page", 0))  # type: ignore[union-attr]
    try:
        while page < pages:
            time.sleep(0.5)
            page += 1
            ctx.progress(page / pages)
    except SoftTimeLimitExceeded:
        ctx.progress(page / pages, checkpoint={"page": page})
        print(f"    [handler] cancelled at page {page}, checkpoint saved", flush=True)
        time.sleep(60)  # cleanup that overruns the grace period: the worker stops it
    return page


@app.task(name="demo.flaky", base=OJSTask, bind=True, **LIMITS)
def flaky(self: OJSTask, succeed_on: int) -> str:
    """Fails until attempt ``succeed_on``."""
    ctx = self.ojs
    assert ctx is not None
    if ctx.attempt < succeed_on:
        raise ConnectionError(f"upstream unavailable (attempt {ctx.attempt})")
    return f"succeeded on attempt {ctx.attempt}"
