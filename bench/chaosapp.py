"""The Celery app that ``bench/chaos.py`` runs in ``celery worker`` and ``ojs-celery sweep``
subprocesses (and builds in the driver to enqueue).

The driver passes its config as ``OJS_CHAOS_CONFIG`` (JSON). Every process that imports this
module appends what it did to its own file ``<dir>/log-<pid>.txt`` (O_APPEND, one short line per
``os.write``, so a kill -9 loses nothing already written):

- ``R job attempt pid worker time``: the handler started (the store let this attempt run);
- ``D job attempt time``: the handler returned (the next step is the store's complete);
- ``E type job attempt time``: an OJS event that ends a job (``job.completed``,
  ``job.discarded``, ``job.cancelled``), sent in the process that made the transition.

The handler ``chaos.work`` does what its arguments say: sleep, fail on early attempts, or fail
for good, so that both terminal states and retries happen under the chaos.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from benchapp import ProcessFile  # the bench folder is on the workers' PYTHONPATH
from celery import Celery

from ojs_celery import JobError, OJSTask, current_job, install
from ojs_celery.signals import ojs_event

TERMINAL_EVENTS = ("job.completed", "job.discarded", "job.cancelled")


def make_app(config: dict[str, Any]) -> Celery:
    app = Celery("chaos", set_as_current=False)
    app.conf.update(
        broker_url=config.get("broker_url", config["redis_url"]),
        result_backend=config["redis_url"],
        broker_transport_options=config.get("broker_transport_options", {}),
        task_default_queue=config["queue"],
        task_default_exchange=config["queue"],
        task_default_routing_key=config["queue"],
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=1,
        result_expires=3600,
        ojs=config["ojs"],
    )
    install(app)
    journal = ProcessFile(config["dir"], "log")

    @app.task(shared=False, name="chaos.work", base=OJSTask)  # type: ignore[untyped-decorator]
    def work(index: int, seconds: float, fail_before: int, fail: str) -> str:
        """Sleep ``seconds``; raise on attempts before ``fail_before``; ``fail`` = ``"retry"``
        fails every attempt (retryable), ``"final"`` fails at once for good."""
        ctx = current_job()
        journal.write(f"R {ctx.job_id} {ctx.attempt} {os.getpid()} {ctx.worker_id} "
                      f"{time.time():.3f}\n")
        time.sleep(seconds)
        if fail == "final":
            raise JobError("refused for good", type="chaos_refused", retryable=False)
        if fail == "retry" or ctx.attempt < fail_before:
            raise ConnectionError(f"attempt {ctx.attempt} fails")
        journal.write(f"D {ctx.job_id} {ctx.attempt} {time.time():.3f}\n")
        return f"done {index}"

    def on_event(sender: Any = None, event: Any = None, **_: Any) -> None:
        if not isinstance(event, dict) or event.get("type") not in TERMINAL_EVENTS:
            return
        data = event.get("data") or {}
        journal.write(f"E {event['type']} {event.get('subject') or data.get('job_id')} "
                      f"{data.get('attempt')} {time.time():.3f}\n")

    ojs_event.connect(on_event, weak=False)
    return app


app: Celery | None = None
if "OJS_CHAOS_CONFIG" in os.environ:
    app = make_app(json.loads(os.environ["OJS_CHAOS_CONFIG"]))
