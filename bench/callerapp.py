"""The Celery app that ``bench/caller.py`` runs in a real ``celery worker`` subprocess.

One task, ``caller.task``, that does one small Redis write (``INCR`` of the trial's counter key
on the shared Redis), the kind of tiny task users call with ``.apply_async()``. ``kind`` in the
config picks how it is built: ``plain`` is a Celery app without ``install`` and a plain task,
``ojs`` is the same app with ``install(app)`` and ``base=OJSTask``. Both ignore results and have
no result backend, so the only difference is OJS.

The driver builds the same app with :func:`make_app` and passes its config to the worker as
``CALLER_BENCH_CONFIG`` (JSON). In the worker, ``CALLER_BENCH_STAMPS`` names a folder: the
main process writes ``ready`` there at ``worker_ready`` (at loglevel WARNING the worker prints
nothing when it is ready), and every pool child appends its ``task_prerun``/``task_postrun``
stamps (``benchapp``'s stamp writer).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import redis
from celery import Celery, signals

from ojs_celery import OJSTask, install
from ojs_celery.ojsfs import SCHEME, register_transport

TASK_NAME = "caller.task"


class _Counter:
    """A Redis client per process (pool children must not share the parent's sockets)."""

    def __init__(self, url: str, key: str) -> None:
        self.url = url
        self.key = key
        self.pid = -1
        self.client: redis.Redis | None = None

    def incr(self) -> None:
        if self.client is None or self.pid != os.getpid():
            self.pid = os.getpid()
            self.client = redis.Redis.from_url(self.url)
        self.client.incr(self.key)


def make_app(config: dict[str, Any]) -> Celery:
    """config: kind, broker_url, broker_transport_options, queue, event_exchange, counter_url,
    counter_key, and ``ojs`` (the ``ojs`` settings, for kind ``ojs``)."""
    if config["broker_url"].startswith(SCHEME + "://"):
        register_transport()
    app = Celery(f"caller_{config['queue']}", set_as_current=False)
    app.conf.update(
        broker_url=config["broker_url"],
        broker_transport_options=config.get("broker_transport_options") or {},
        result_backend=None,
        task_ignore_result=True,
        task_default_queue=config["queue"],
        task_default_exchange=config["queue"],
        task_default_routing_key=config["queue"],
        event_exchange=config["event_exchange"],
        broker_connection_retry_on_startup=True,
    )
    counter = _Counter(config["counter_url"], config["counter_key"])
    if config["kind"] == "ojs":
        app.conf.ojs = config["ojs"]
        install(app)

        @app.task(  # type: ignore[untyped-decorator]
            shared=False, name=TASK_NAME, base=OJSTask, ignore_result=True)
        def ojs_task() -> None:
            counter.incr()
    else:

        @app.task(  # type: ignore[untyped-decorator]
            shared=False, name=TASK_NAME, ignore_result=True)
        def plain_task() -> None:
            counter.incr()

    return app


def _connect_ready(directory: str) -> None:
    def ready(**_: Any) -> None:
        (pathlib.Path(directory) / "ready").write_text(str(os.getpid()))

    signals.worker_ready.connect(ready, weak=False)


app: Celery | None = None
if "CALLER_BENCH_CONFIG" in os.environ:
    from benchapp import _connect_stamps

    app = make_app(json.loads(os.environ["CALLER_BENCH_CONFIG"]))
    _connect_stamps(os.environ["CALLER_BENCH_STAMPS"])
    _connect_ready(os.environ["CALLER_BENCH_STAMPS"])
