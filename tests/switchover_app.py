"""A Celery app for the switch-over tests (``tests/test_switchover.py``), run in real worker
and beat subprocesses; its config comes as JSON in ``OJS_SWITCH_CONFIG``.

``make_app(config, ojs=False)`` builds the same app as it was before the switch: the same
tasks on plain Celery (``install`` not called), whose messages carry no ``ojs`` header.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from celery import Celery, Task
from kombu import Queue

from ojs_celery import OJSTask, install


def make_app(config: dict[str, Any], ojs: bool = True) -> Celery:
    app = Celery(f"switch_{config['queue']}", set_as_current=False)
    app.conf.update(
        broker_url=config["broker_url"],
        result_backend=config["result_backend"],
        broker_transport_options=config.get("broker_transport_options", {}),
        task_default_queue=config["queue"],
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=1,
        ojs=config["ojs"],
        **config.get("celery", {}),
    )
    if config.get("declared_queues"):
        app.conf.task_queues = [Queue(name) for name in config["declared_queues"]]
    if ojs:
        install(app)
    base = OJSTask if ojs else Task
    directory = pathlib.Path(config["dir"])

    @app.task(shared=False, name="switch.flaky", base=base, bind=True, max_retries=3)
    def flaky(self: Any, fail_times: int) -> str:
        with open(directory / "runs", "a") as handle:
            handle.write(f"flaky {self.request.id} retries={self.request.retries}\n")
        if self.request.retries < fail_times:
            raise self.retry(exc=ValueError("not yet"), countdown=0.2)
        return f"ok after {self.request.retries}"

    @app.task(shared=False, name="switch.add", base=base)
    def add(a: int, b: int) -> int:
        return a + b

    return app


if "OJS_SWITCH_CONFIG" in os.environ:
    app = make_app(json.loads(os.environ["OJS_SWITCH_CONFIG"]))


def _record_sweeps() -> None:
    """Each sweep message's outcome, one JSON line in ``<dir>/sweeps`` (a pass or a skip)."""
    from celery import signals

    from ojs_celery.sweeper import SWEEP_TASK

    def on_postrun(sender: Any = None, retval: Any = None, **_: Any) -> None:
        if getattr(sender, "name", None) == SWEEP_TASK and "OJS_SWITCH_CONFIG" in os.environ:
            directory = json.loads(os.environ["OJS_SWITCH_CONFIG"])["dir"]
            with open(pathlib.Path(directory) / "sweeps", "a") as handle:
                handle.write(json.dumps(retval, default=str) + "\n")

    signals.task_postrun.connect(on_postrun, weak=False)


_record_sweeps()
