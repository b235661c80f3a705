"""``install(app)``: wire OJS into a Celery app (idempotent)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import celery
from celery import Celery, Task, signals
from celery.exceptions import ImproperlyConfigured
from kombu import entity
from kombu.exceptions import KombuError

from . import compat, control
from .callers import wrap_send_task
from .conf import Settings
from .identity import assign_worker_id, note_worker
from .logs import quiet_worker_logs
from .ojsfs import register_transport
from .producer import warn_default_timeouts
from .request import cancel_revoked
from .runtime import Runtime, attach, get_runtime
from .store import StoreError, preload_store
from .sweeper import SWEEP_TASK, last_sweep, sweep, sweep_faults
from .task import publish_a_retry_left_owed, publish_the_retry
from .worker import children
from .worker.gate import start_gate
from .worker.pools import WEAK_POOLS, pool_name
from .worker.steps import STEPS

logger = logging.getLogger(__name__)

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
    compat.hide_setting("store_url")  # `celery report` masks ojs.store_url's password

    def on_worker_init(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        _settings_or_exit()
        try:  # imports only: the pool forks after this
            preload_store(runtime.settings.store_url)
        except Exception as exc:  # a driver SQLAlchemy cannot load: no job could ever start
            raise SystemExit(f"ojs_celery: store_url: the job store's driver cannot be loaded "
                             f"({type(exc).__name__}: {exc})") from None
        start_gate.prepare()  # shared with the pool processes it forks next
        quiet_worker_logs(app, SWEEP_TASK)
        worker_id = assign_worker_id()
        note_worker(str(getattr(sender, "hostname", "") or ""),
                    bool(getattr(sender, "task_events", False)))
        name = pool_name(getattr(sender, "pool_cls", ""))
        logger.info("ojs_celery: worker id %s (pool %s)", worker_id, name)
        _watch_sweeps(runtime)
        missing = WEAK_POOLS.get(name)
        if missing:
            logger.warning(
                "ojs_celery: the %s pool does not enforce %s: OJS execution timeouts on this "
                "worker are enforced by the sweeper (run `celery beat` or "
                "`ojs-celery sweep --loop`), and a timed-out handler is not interrupted "
                "(on gevent: only at its next switch). "
                "Use the prefork pool for worker-side timeouts.",
                name, missing,
            )
        if compat.stalls_on_green_amqp(name, runtime.broker_driver, sender.app.conf,
                                       getattr(sender, "options", None) or {}):
            logger.warning(
                "ojs_celery: on the %s pool with an AMQP broker, Celery %s's worker loop waits "
                "up to 0.1s after every message (for AMQP heartbeats on its event connection): "
                "this worker will take about 10 tasks a second. Set broker_heartbeat = 0 (as "
                "Celery 5.6 had it on this pool), or start the worker with --without-heartbeat "
                "--without-gossip and without task events (-E).", name, celery.__version__,
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
            _add_to_built_queues(app, conf, settings.sweep_queue)

    def _settings_or_exit() -> None:
        """Read the settings as the app module left them (it may have changed them after
        Celery configured the app) before a worker or beat starts; exit naming a bad one
        (Celery's signals log and swallow other exceptions)."""
        on_configured()
        try:
            settings = runtime.settings
        except ImproperlyConfigured as exc:
            raise SystemExit(f"ojs_celery: {exc}") from None
        problem = check_sweep_queue(app, settings.sweep_queue)
        if problem:
            raise SystemExit(f"ojs_celery: {problem}")

    def on_beat_init(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is app:
            _settings_or_exit()  # before the scheduler reads beat_schedule
            _beat_thread.ticks = True  # beat's scheduler runs in this thread

    app.on_after_configure.connect(on_configured, weak=False)
    signals.beat_init.connect(on_beat_init, weak=False)
    if app.configured:
        on_configured(app, app.conf)
        runtime.settings  # noqa: B018 - raises ImproperlyConfigured naming the bad settings
    control.register()
    signals.worker_init.connect(on_worker_init, weak=False)
    signals.worker_process_init.connect(on_child_start, weak=False)
    signals.worker_process_shutdown.connect(on_child_shutdown, weak=False)
    signals.worker_ready.connect(warn_default_timeouts, weak=False,
                                 dispatch_uid="ojs-default-timeouts")
    signals.task_revoked.connect(cancel_revoked, weak=False, dispatch_uid="ojs-cancel-revoked")
    signals.task_retry.connect(publish_the_retry, weak=False, dispatch_uid="ojs-retry-publish")
    signals.task_postrun.connect(publish_a_retry_left_owed, weak=False,
                                 dispatch_uid="ojs-retry-publish-late")
    wrap_send_task(app)
    for step in STEPS:
        app.steps["consumer"].add(step)
    return runtime


#: The header in which every sweep message carries the time it was published.
SENT_AT_HEADER = "ojs_sweep_sent_at"


def _stamp_sweep(sender: Any = None, headers: Any = None, **_: Any) -> None:
    """``before_task_publish``: stamp a sweep message with its publish time, whoever publishes
    it (celery beat, django-celery-beat's ``DatabaseScheduler``, which drops the entry's
    ``expires``, or a hand-sent task), so that the worker can tell a stale one."""
    if sender == SWEEP_TASK and isinstance(headers, dict):
        headers.setdefault(SENT_AT_HEADER, time.time())


def sweep_sent_at(request: Any) -> float | None:
    """The publish time of the sweep message ``request`` (None: sent without the stamp)."""
    headers = getattr(request, "headers", None) or {}
    value = headers.get(SENT_AT_HEADER) if isinstance(headers, dict) else None
    if value is None:
        value = getattr(request, SENT_AT_HEADER, None)
    return float(value) if isinstance(value, (int, float)) else None


def is_stale_sweep(runtime: Runtime, sent_at: float | None, now: float) -> bool:
    """A sweep message older than one interval, published before a sweep that has already
    started, would only repeat that sweep late: a backlog (a sweep worker that was down, a
    scheduler that does not expire its messages) collapses into one pass. A late message with
    no sweep since it was sent still runs, so that a slow sweep worker is never starved."""
    if sent_at is None or now - sent_at <= runtime.settings.sweep_interval:
        return False
    try:
        last = last_sweep(runtime)
    except Exception:  # the store is down: the pass itself reports it
        return False
    return last is not None and last >= sent_at


#: ``ticks`` is set in the thread that runs celery beat's scheduler (``beat_init``, in
#: ``celery beat`` and in the beat process of ``celery worker -B``).
_beat_thread = threading.local()


class _BeatSaysPublishFailures:
    """The sweep task's publish from celery beat's scheduler: a broker failure (the embedded
    broker folder missing or its disk full, a broker down) is one ERROR line naming the cause,
    and beat sends the sweep again at its next tick. Beat logged each failed tick with the
    whole traceback, and its stack on top (its ``Message Error``)."""

    def apply_async(self, *args: Any, **kwargs: Any) -> Any:
        if not getattr(_beat_thread, "ticks", False):
            return super().apply_async(*args, **kwargs)  # type: ignore[misc]
        try:
            return super().apply_async(*args, **kwargs)  # type: ignore[misc]
        except (KombuError, OSError) as exc:
            logger.error("ojs_celery: celery beat could not send the sweep (%s) to the broker, "
                         "and sends it again at its next tick: %s", SWEEP_TASK, exc)
            return None  # beat then takes it as sent (a DEBUG line), and goes on


def _add_sweep_task(app: Celery) -> None:
    """The ``ojs_celery.sweep`` task (see :func:`_add_beat_entry` for its schedule)."""

    faults = sweep_faults()
    # never an OJS task, also where the app's task class (task_cls) is one: beat's sweeps
    # would be OJS jobs, refused on the sweep queue
    plain = Task if getattr(app.Task, "__ojs_task__", False) else app.Task
    base = type("OJSSweepTask", (_BeatSaysPublishFailures, plain), {})
    signals.before_task_publish.connect(_stamp_sweep, weak=False, dispatch_uid="ojs-sweep-stamp")

    # send_events=False: a pass every sweep_interval would fill Celery's task events (Flower
    # keeps 10,000 tasks: a day of an idle app's sweeps pushes its own tasks out)
    @app.task(name=SWEEP_TASK, ignore_result=True, shared=False,  # type: ignore[untyped-decorator]
              bind=True, send_events=False, base=base)
    def ojs_sweep(self: Any) -> dict[str, Any]:
        runtime = get_runtime(app)
        sent_at = sweep_sent_at(self.request)
        if is_stale_sweep(runtime, sent_at, time.time()):
            logger.debug("ojs_celery: stale sweep message (sent %.1fs ago) dropped",
                         time.time() - (sent_at or 0))
            return {"skipped": "stale", "sent_at": sent_at}
        return sweep(runtime, faults=faults).as_dict()


def _add_beat_entry(conf: Any, settings: Settings) -> None:
    """The sweep's beat entry in Celery's configuration ``conf`` (own queue; a backlog of
    sweeps collapses into one pass in :func:`is_stale_sweep`). Added each time Celery
    (re)configures the app, since a new configuration replaces ``beat_schedule``; so is the
    sweep queue (:func:`_declare_sweep_queue`)."""
    schedule = dict(conf.get("beat_schedule") or {})
    schedule["ojs-sweep"] = {
        "task": SWEEP_TASK,
        "schedule": settings.sweep_interval,
        # no ``expires``: Celery would compare it, stamped by beat's clock, with the sweep
        # worker's, and a worker whose clock is ahead by more than an interval would discard
        # every sweep (none would ever run); a backlog collapses in :func:`is_stale_sweep`.
        # ``expiration`` is the broker's own TTL, kept by its clock: RabbitMQ drops a sweep
        # nobody took within the interval, so a beat without a sweep worker piles none up
        # (kombu's Redis transport ignores it).
        "options": {"queue": settings.sweep_queue, "expiration": settings.sweep_interval},
    }
    compat.set_celery_setting(conf, "beat_schedule", schedule)
    _declare_sweep_queue(conf, settings.sweep_queue)


def _declare_sweep_queue(conf: Any, name: str) -> None:
    """Declare the sweep queue where the app declares its queues: in ``task_queues`` when the
    app lists them, or when ``task_create_missing_queues`` is off (Celery then knows only the
    queues listed, and a worker's ``-Q ojs.sweep`` or beat's publish would fail)."""
    queues = conf.get("task_queues")
    if not queues and conf.get("task_create_missing_queues", True):
        return  # Celery creates the sweep queue on first use
    if isinstance(queues, dict):
        if name not in queues:
            compat.set_celery_setting(
                conf, "task_queues", {**queues, name: {"exchange": name, "routing_key": name}})
        return
    declared = list(queues or [_default_queue(conf)])
    if any(getattr(q, "name", None) == name for q in declared):
        return
    compat.set_celery_setting(
        conf, "task_queues", [*declared, _queue(name, name, "direct", name, None)])


def _default_queue(conf: Any) -> Any:
    """The queue Celery declares when ``task_queues`` is empty (``app.amqp.Queues``)."""
    default = conf.get("task_default_queue") or "celery"
    arguments = ({"x-queue-type": "quorum"}
                 if conf.get("task_default_queue_type") == "quorum" else None)
    return _queue(default, conf.get("task_default_exchange") or default,
                  conf.get("task_default_exchange_type") or "direct",
                  conf.get("task_default_routing_key") or default, arguments)


def _queue(name: str, exchange: str, kind: str, routing_key: str,
           arguments: dict[str, Any] | None) -> Any:
    queue_cls: Any = entity.Queue
    exchange_cls: Any = entity.Exchange
    return queue_cls(name, exchange_cls(exchange, kind), routing_key=routing_key,
                     queue_arguments=arguments)


def _add_to_built_queues(app: Celery, conf: Any, name: str) -> None:
    """``app.amqp.queues`` is built once from ``task_queues``: when it was built before this
    configuration, the sweep queue declared in ``conf`` is added to it too."""
    amqp = app.__dict__.get("amqp")
    built = getattr(amqp, "__dict__", {}).get("queues")
    if built is None or name in built:
        return
    for queue in conf.get("task_queues") or ():
        if getattr(queue, "name", None) == name:
            built.add(queue)


def check_sweep_queue(app: Celery, name: str) -> str | None:
    """Why beat or a worker of ``app`` cannot use the sweep queue ``name``, or None."""
    if app.conf.task_create_missing_queues or name in app.amqp.queues:
        return None
    return (f"the sweep queue {name!r} is not declared and task_create_missing_queues is off: "
            f"add Queue({name!r}) to task_queues (or set ojs.sweep_queue to a declared queue)")


#: A worker warns when no sweep has run for this many intervals.
STALE_SWEEP_INTERVALS = 5


class SweepWatch:
    """Whether sweeps are overdue, as a worker can tell from the store's record of the last
    one. While the store fails to answer, or answers late, no sweep could run either (and what
    failed is logged where it failed): sweeps are overdue only ``stale_after`` seconds after it
    answers again, not at once because the last one is old."""

    def __init__(self, read_last: Callable[[], float | None], interval: float,
                 stale_after: float, clock: Callable[[], float] = time.time) -> None:
        self._read_last = read_last
        self._interval = interval
        self._stale_after = stale_after
        self._clock = clock
        self._excused = 0.0

    def overdue(self) -> float | None:
        """Seconds without a sweep when that is more than ``stale_after``, else None."""
        asked = self._clock()
        last: float | None
        try:
            last = self._read_last()
        except StoreError:
            last = None
            self._excused = self._clock()
        except Exception:  # an unreadable record of the last sweep: as if none ran
            last = None
        now = self._clock()
        if now - asked > self._interval:  # answered late
            self._excused = now
        since = max(last or 0.0, self._excused)
        if not since:
            return self._stale_after  # no sweep ever ran
        return now - since if now - since > self._stale_after else None


def _watch_sweeps(runtime: Runtime) -> None:
    """Warn (at most once a minute) when no sweep has run for several intervals: without one,
    timeouts of crashed or frozen workers and TTLs of unconsumed queues are not enforced."""
    interval = runtime.settings.sweep_interval
    stale_after = interval * STALE_SWEEP_INTERVALS
    watch = SweepWatch(lambda: last_sweep(runtime), interval, stale_after)

    def check() -> None:
        time.sleep(stale_after)
        warned = 0.0
        while True:
            late = watch.overdue()
            now = time.time()
            if late is not None and now - warned > 60:
                warned = now
                logger.warning(
                    "ojs_celery: no OJS sweep has completed for %.0fs (interval %ss): if none "
                    "runs, run `celery beat` with a worker consuming queue %r, or `ojs-celery "
                    "sweep --loop`; if they run, the sweep worker's log says why they fail (and a "
                    "worker of another app consuming that queue on this broker takes its sweeps: "
                    "give each app its own ojs.sweep_queue)",
                    late, interval, runtime.settings.sweep_queue,
                )
            time.sleep(max(interval, 1.0))

    threading.Thread(target=check, name="ojs-sweep-watch", daemon=True).start()
