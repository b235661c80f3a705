"""The Celery app that ``bench/throughput.py`` runs in a real ``celery worker`` subprocess.

The driver builds the same app with :func:`make_app` and passes its config to the worker as
``OJS_BENCH_CONFIG`` (JSON). Two no-op tasks: ``bench.plain`` (plain Celery) and ``bench.ojs``
(``base=OJSTask``), both ``ignore_result`` with no result backend, so the only difference is OJS.

In the worker, ``OJS_BENCH_STAMPS`` names a folder: every pool child appends one line per task
there, from Celery's ``task_prerun`` and ``task_postrun`` signals. Those fire in the child right
around the task's ``__call__`` (so around OJS's store start/complete and event emission too),
cost a few microseconds and touch neither Redis nor the broker. ``OJS_BENCH_PROFILE`` names a
folder where every pool child writes a cProfile dump at exit (profiling runs only).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery, signals

from ojs_celery import OJSTask, install


def make_app(config: dict[str, Any]) -> Celery:
    app = Celery(f"bench_{config['queue']}", set_as_current=False)
    app.conf.update(
        broker_url=config["broker_url"],
        result_backend=None,
        task_ignore_result=True,
        task_default_queue=config["queue"],
        task_default_exchange=config["queue"],
        task_default_routing_key=config["queue"],
        event_exchange=config["event_exchange"],
        broker_connection_retry_on_startup=True,
        ojs=config["ojs"],
    )
    install(app)

    @app.task(shared=False, name="bench.plain", ignore_result=True)
    def plain() -> None:
        return None

    @app.task(shared=False, name="bench.ojs", base=OJSTask, ignore_result=True)
    def ojs() -> None:
        return None

    return app


class ProcessFile:
    """A per-process append-only file ``<prefix>-<pid>.txt`` in ``directory`` (reopened after
    a fork: pool children get their own, so no two processes interleave their writes)."""

    def __init__(self, directory: str, prefix: str) -> None:
        self.directory = directory
        self.prefix = prefix
        self.pid = -1
        self.fd = -1

    def write(self, text: str) -> None:
        if self.pid != os.getpid():
            self.pid = os.getpid()
            path = os.path.join(self.directory, f"{self.prefix}-{self.pid}.txt")
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(self.fd, text.encode())


def _connect_stamps(directory: str) -> None:
    stamps = ProcessFile(directory, "stamps")

    def prerun(task_id: str = "", **_: Any) -> None:
        stamps.write(f"S {task_id} {time.time()!r}\n")

    def postrun(task_id: str = "", state: str | None = None, **_: Any) -> None:
        stamps.write(f"E {task_id} {time.time()!r} {state}\n")

    signals.task_prerun.connect(prerun, weak=False)
    signals.task_postrun.connect(postrun, weak=False)


def _connect_profiler(directory: str) -> None:
    import cProfile

    profiles: dict[int, cProfile.Profile] = {}

    def child_init(**_: Any) -> None:
        profile = cProfile.Profile()
        profiles[os.getpid()] = profile
        profile.enable()

    def child_shutdown(**_: Any) -> None:
        profile = profiles.pop(os.getpid(), None)
        if profile is not None:
            profile.disable()
            profile.dump_stats(os.path.join(directory, f"child-{os.getpid()}.prof"))

    signals.worker_process_init.connect(child_init, weak=False)
    signals.worker_process_shutdown.connect(child_shutdown, weak=False)


app: Celery | None = None
if "OJS_BENCH_CONFIG" in os.environ:
    app = make_app(json.loads(os.environ["OJS_BENCH_CONFIG"]))
    if os.environ.get("OJS_BENCH_STAMPS"):
        _connect_stamps(os.environ["OJS_BENCH_STAMPS"])
    if os.environ.get("OJS_BENCH_PROFILE"):
        _connect_profiler(os.environ["OJS_BENCH_PROFILE"])
