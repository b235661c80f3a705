"""``install(app)``: wire OJS into a Celery app (idempotent)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from celery import Celery, signals
from celery.exceptions import ImproperlyConfigured

from . import control
from .conf import Settings
from .embedded import register_transport
from .identity import assign_worker_id
from .logs import quiet_worker_logs
from .runtime import Runtime, attach, get_runtime
from .sweeper import SWEEP_TASK, FaultLog, last_sweep, sweep
from .worker import children
from .worker.steps import STEPS

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
    """Make ``app`` an OJS job system (idempotent).

    ``app.conf.ojs`` is read and validated when Celery configures the app, so ``install`` may
    come before or after ``config_from_object``. On an app that is configured already, a bad
    setting raises ``celery.exceptions.ImproperlyConfigured`` here, naming every bad key;
    otherwise at first use (an enqueue, the worker's start).
    """
    existing = getattr(app, "_ojs_runtime", None)
    if existing is not None:
        return existing  # type: ignore[no-any-return]
    runtime = attach(app)
    register_transport()

    def on_worker_init(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        _settings_or_exit()
        quiet_worker_logs(app, SWEEP_TASK)
        worker_id = assign_worker_id()
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

    _add_sweep_task(app)

    def on_configured(sender: Any = None, source: Any = None, **_: Any) -> None:
        conf = app.conf if source is None else source
        settings = runtime.configure(conf)
        if settings is not None:
            _add_beat_entry(conf, settings)

    def _settings_or_exit() -> None:
        """Read the settings as the app module left them (it may have changed them after
        Celery configured the app) before a worker or beat starts; exit naming a bad one
        (Celery's signals log and swallow other exceptions)."""
        on_configured()
        try:
            runtime.settings  # noqa: B018
        except ImproperlyConfigured as exc:
            raise SystemExit(f"ojs_celery: {exc}") from None

    def on_beat_init(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is app:
            _settings_or_exit()  # before the scheduler reads beat_schedule

    app.on_after_configure.connect(on_configured, weak=False)
    signals.beat_init.connect(on_beat_init, weak=False)
    if app.configured:
        on_configured(app, app.conf)
        runtime.settings  # noqa: B018 - raises ImproperlyConfigured naming the bad settings
    control.register()
    signals.worker_init.connect(on_worker_init, weak=False)
    signals.worker_process_init.connect(on_child_start, weak=False)
    signals.worker_process_shutdown.connect(on_child_shutdown, weak=False)
    for step in STEPS:
        app.steps["consumer"].add(step)
    return runtime


def _add_sweep_task(app: Celery) -> None:
    """The ``ojs_celery.sweep`` task (see :func:`_add_beat_entry` for its schedule)."""

    faults = FaultLog()

    @app.task(name=SWEEP_TASK, ignore_result=True, shared=False)  # type: ignore[untyped-decorator]
    def ojs_sweep() -> dict[str, Any]:
        return sweep(get_runtime(app), faults=faults).as_dict()



def _add_beat_entry(conf: Any, settings: Settings) -> None:
    """The sweep's beat entry in Celery's configuration ``conf`` (own queue, expiring within
    the interval so that a backlog of sweeps never piles up). Added each time Celery
    (re)configures the app, since a new configuration replaces ``beat_schedule``."""
    schedule = dict(conf.get("beat_schedule") or {})
    schedule["ojs-sweep"] = {
        "task": SWEEP_TASK,
        "schedule": settings.sweep_interval,
        "options": {"expires": settings.sweep_interval, "queue": settings.sweep_queue},
    }
    conf.beat_schedule = schedule


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
