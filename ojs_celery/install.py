"""``install(app)``: wire OJS into a Celery app (idempotent)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from celery import Celery, signals

from . import control  # noqa: F401 - registers the ojs_terminate remote-control command
from .identity import assign_worker_id
from .runtime import Runtime, attach, get_runtime
from .sweeper import SWEEP_TASK, FaultLog, last_sweep, sweep
from .worker import children
from .worker.step import OJSWorkerStep

logger = logging.getLogger(__name__)

#: Pools whose time limits Celery does not enforce, and what is missing there.
_WEAK_POOLS = {
    "solo": "soft and hard time limits",
    "threads": "soft and hard time limits",
    "thread": "soft and hard time limits",
    "gevent": "the soft time limit (and the hard one for blocking code)",
    "eventlet": "soft and hard time limits",
}


def pool_name(pool_cls: Any) -> str:
    text = pool_cls if isinstance(pool_cls, str) else getattr(pool_cls, "__module__", "")
    return str(text).rsplit(".", 1)[-1].rsplit(":", 1)[0]


def install(app: Celery) -> Runtime:
    """Make ``app`` an OJS job system; reads and validates ``app.conf.ojs``.

    Raises ``celery.exceptions.ImproperlyConfigured`` naming the first bad setting.
    """
    existing = getattr(app, "_ojs_runtime", None)
    if existing is not None:
        return existing  # type: ignore[no-any-return]
    runtime = attach(app)

    def on_worker_init(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        worker_id = assign_worker_id()
        children.prepare()
        name = pool_name(getattr(sender, "pool_cls", ""))
        logger.info("ojs_celery: worker id %s (pool %s)", worker_id, name)
        _watch_sweeps(runtime)
        missing = _WEAK_POOLS.get(name)
        if missing:
            logger.warning(
                "ojs_celery: the %s pool does not enforce %s: OJS execution timeouts on this "
                "worker are enforced only by the sweeper (run `celery beat` or "
                "`ojs-celery sweep --loop`), and a timed-out handler is not interrupted. "
                "Use the prefork pool for worker-side timeouts.",
                name, missing,
            )

    def on_child_start(**_: Any) -> None:
        children.protect_child()

    def on_child_shutdown(**_: Any) -> None:
        get_runtime(app).flush()

    _add_sweeper(app, runtime)
    signals.worker_init.connect(on_worker_init, weak=False)
    signals.worker_process_init.connect(on_child_start, weak=False)
    signals.worker_process_shutdown.connect(on_child_shutdown, weak=False)
    app._ojs_signal_receivers = (on_worker_init, on_child_start, on_child_shutdown)
    app.steps["consumer"].add(OJSWorkerStep)
    return runtime


def _add_sweeper(app: Celery, runtime: Runtime) -> None:
    """The ``ojs_celery.sweep`` task and its beat entry (own queue, expiring within the
    interval so that a backlog of sweeps never piles up)."""
    settings = runtime.settings

    faults = FaultLog()

    @app.task(name=SWEEP_TASK, ignore_result=True, shared=False)  # type: ignore[untyped-decorator]
    def ojs_sweep() -> dict[str, Any]:
        return sweep(get_runtime(app), faults=faults).as_dict()

    schedule = dict(app.conf.beat_schedule or {})
    schedule["ojs-sweep"] = {
        "task": SWEEP_TASK,
        "schedule": settings.sweep_interval,
        "options": {"expires": settings.sweep_interval, "queue": settings.sweep_queue},
    }
    app.conf.beat_schedule = schedule


#: A worker warns when no sweep has run for this many intervals.
STALE_SWEEP_INTERVALS = 5


def _watch_sweeps(runtime: Runtime) -> None:
    """Warn (at most once a minute) when no sweep has run for several intervals: without one,
    timeouts of crashed or frozen workers and TTLs of unconsumed queues are not enforced."""
    interval = runtime.settings.sweep_interval
    stale_after = interval * STALE_SWEEP_INTERVALS

    def check() -> None:
        time.sleep(stale_after)
        warned = 0.0
        while True:
            try:
                last = last_sweep(runtime)
            except Exception:
                last = None
            now = time.time()
            if (last is None or now - last > stale_after) and now - warned > 60:
                warned = now
                logger.warning(
                    "ojs_celery: no OJS sweep has run for %.0fs (interval %ss): run `celery "
                    "beat` with a worker consuming queue %r, or `ojs-celery sweep --loop`",
                    (now - last) if last else stale_after, interval,
                    runtime.settings.sweep_queue,
                )
            time.sleep(max(interval, 1.0))

    threading.Thread(target=check, name="ojs-sweep-watch", daemon=True).start()
