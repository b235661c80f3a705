"""The registration bootstep: the worker's record in the store, from start to exit."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from celery import bootsteps
from celery.worker import state as worker_state

from ..runtime import Runtime, get_runtime
from ..store import StoreMisconfigured
from ..store.sql import sqlite_file
from .node import WorkerNode

logger = logging.getLogger(__name__)


class RegistrationStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Creates the worker's :class:`~.node.WorkerNode`, registers it and emits
    ``worker.started``; deregisters on a shutdown that did not go through the drain."""

    requires = ("celery.worker.consumer.tasks:Tasks",)
    label = "OJS registration"

    def start(self, parent: Any) -> None:
        if getattr(parent, "ojs", None) is not None:
            return  # consumer restarts (broker reconnects) start steps again
        runtime = get_runtime(parent.app)
        # learning the broker's kind installs, on Redis, kombu's hooks for OJS messages
        runtime.broker_driver  # noqa: B018 - (Runtime.broker_driver, ojs_celery.kept_client)
        node = WorkerNode(runtime, parent)
        parent.ojs = node
        info = node.info()
        try:
            node.registry.register(info)
        except StoreMisconfigured as exc:  # no beat can mend store_url: exit, naming it
            node.left = True  # never registered: nothing to leave
            raise SystemExit(f"ojs_celery: {exc}") from None
        except Exception as exc:  # any store fault: the next beat registers it
            logger.warning("ojs_celery: could not register worker %s (will retry with the "
                           "next beat): %r", node.worker_id, exc)
        else:
            node.registered = True
            logger.info("ojs_celery: worker %s registered (queues %s)", node.worker_id,
                        info.queues)
        node.runtime.bus.emit("worker.started", {
            "worker_id": node.worker_id, "queues": info.queues,
            "concurrency": info.concurrency, "hostname": info.hostname, "pid": info.pid,
        }, subject=node.worker_id)
        _check_broker(runtime)
        _check_store_path(runtime)

    def stop(self, parent: Any) -> None:
        if worker_state.should_stop or worker_state.should_terminate:
            self._leave(parent)

    def shutdown(self, parent: Any) -> None:
        self._leave(parent)
        # Send this process's queued background work now: on a restart (SIGHUP) Celery's
        # atexit handler execs the new worker before the batchers' own atexit flushes run.
        get_runtime(parent.app).flush()

    def _leave(self, parent: Any) -> None:
        """A shutdown that did not go through the drain (Celery's own, e.g. the ``shutdown``
        remote-control command): deregister so that nobody declares this worker dead."""
        node: WorkerNode | None = getattr(parent, "ojs", None)
        if node is None or node.left:
            return
        drain = getattr(node, "drain", None)
        if drain is not None and drain.started:
            return
        deregister(node, "shutdown")


def _check_broker(runtime: Runtime) -> None:
    """Warn when the last worker to start on this job store had another broker: another app
    or environment sharing the store (see :meth:`MetaArea.note_broker`)."""
    with runtime.app.connection_for_write() as connection:  # not connected: only its URL
        broker = connection.as_uri()
        prefix = (connection.transport_options or {}).get("global_keyprefix")
    if prefix:
        broker = f"{broker} (global_keyprefix {prefix!r})"
    try:
        other = runtime.store.meta.note_broker(broker)
    except Exception as exc:  # any store fault: the check is advice, the worker goes on
        logger.warning("ojs_celery: could not compare this store's brokers: %r", exc)
        return
    if other is not None:
        logger.warning(
            "ojs_celery: the job store %s was last used by a worker on another broker, %s "
            "(this one: %s). If that is another app or environment, each one's sweepers publish "
            "the other's jobs to their own broker, where its workers run them: give each its own "
            "store (ojs.store_prefix or store_url). The same broker under another name is "
            "harmless.", runtime.store, other, broker)


def _check_store_path(runtime: Runtime) -> None:
    """Warn when the job store is a SQLite file named relative to the working directory (as
    the default ``sqlite:///ojs.sqlite3`` is): a producer, beat or the CLI started in another
    directory, or on another host, has a store of its own, and this worker drops their jobs'
    messages as orphans."""
    from sqlalchemy.engine import make_url

    store_url = runtime.settings.store_url
    if not store_url.lower().startswith("sqlite"):
        return  # (SQLAlchemy cannot parse every Redis URL)
    url = make_url(store_url)
    if not url.database:
        return
    path = sqlite_file(url)
    if path is None or os.path.isabs(url.database):
        return
    logger.warning(
        "ojs_celery: the job store is the SQLite file %s, named relative to this worker's "
        "working directory (ojs.store_url %r): producers, beat and the CLI started in another "
        "directory or on another host have stores of their own, and their jobs never run "
        "here. Give an absolute path (sqlite:////var/lib/proj/ojs.sqlite3), or a PostgreSQL "
        "or Redis store for more than one host.", path, runtime.settings.store_url)


def deregister(node: WorkerNode, reason: str) -> None:
    """Leave the registry (once); no beat writes the record back after this."""
    beat = getattr(node, "beat", None)
    with node.state_lock:
        if node.left:
            return
        node.left = True
    if beat is not None:
        beat.stop()
    try:
        node.registry.deregister()
    except Exception as exc:  # any store fault: the sweeper removes the record when it ages
        logger.warning("ojs_celery: could not deregister worker %s: %r", node.worker_id, exc)
    node.runtime.bus.emit("worker.stopped", {
        "worker_id": node.worker_id, "reason": reason,
        "uptime_ms": round((time.time() - node.started_at) * 1000),
    }, subject=node.worker_id)
    node.runtime.bus.flush()
