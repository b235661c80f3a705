"""Per-app OJS state: validated settings, the job store, the event bus and the outbox acker.

``install(app)`` attaches one :class:`Runtime` to the Celery app; everything else finds it with
:func:`get_runtime`. The store is opened lazily so that importing a project never connects.

Settings are read when Celery configures the app (its ``on_after_configure`` signal, sent again
when ``config_from_object`` replaces the configuration), or at first use, never at ``install``
time: a Django settings module that imports the Celery app, which calls ``install``, before
``config_from_object`` runs must not freeze the defaults. Celery logs and swallows exceptions
raised by signal receivers, so an invalid setting found there is kept and raised at first use
(enqueue, worker start), never replaced by a default.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from celery import Celery, current_app
from celery.exceptions import ImproperlyConfigured

from . import compat, unacked
from .conf import Settings, raw_settings, read_settings
from .events import EventBus
from .outbox import DispatchAcker
from .store import JobStore, open_store

if TYPE_CHECKING:
    from .broker_mark import BrokerMarker
    from .lifecycle import Transition
    from .store.redis import RedisStore

logger = logging.getLogger(__name__)

_ATTR = "_ojs_runtime"


class NotInstalled(RuntimeError):
    """The app was not set up with ``ojs_celery.install(app)``."""


class UnknownType(ValueError):
    """An OJS type that no OJS task or ``type_map`` entry handles."""


class Runtime:
    """What ``ojs_celery`` keeps for one Celery app."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._settings: Settings | None = None
        self._settings_error: ImproperlyConfigured | None = None
        self._store: JobStore | None = None
        self._lock = threading.RLock()  # the store opens under it and may configure the app
        self.bus = EventBus(app)
        self.acks = DispatchAcker(lambda: self.store)
        self._task_names: dict[str, str] = {}  # OJS type -> task name, found by task_name_for
        self._modules_imported = False  # see import_task_modules
        self._broker_driver: str | None = None
        self._joint: RedisStore | None = None
        self._joint_known = False  # whether _joint was decided for the current store
        self._reserved: dict[str, str] | None = None  # see reserved_queues
        self._runs: dict[str, str] = {}  # OJS type -> task name, as runs() last found it
        self._marker: BrokerMarker | None = None  # see broker_marker

    @property
    def settings(self) -> Settings:
        """The validated ``ojs`` settings of the app as Celery has configured it."""
        if self._settings is None and self._settings_error is None:
            self.configure(self.app.conf)  # configures the app if nothing has yet
        if self._settings_error is not None:
            raise self._settings_error
        assert self._settings is not None
        return self._settings

    def configure(self, conf: Any) -> Settings | None:
        """(Re)read the settings from Celery's configuration ``conf``; returns them, or None
        when they are invalid (the error is raised by :attr:`settings`)."""
        try:
            settings = read_settings(raw_settings(conf))
            _require_extras(conf)
        except ImproperlyConfigured as exc:
            self._settings, self._settings_error = None, exc
            return None
        with self._lock:
            previous, self._settings, self._settings_error = self._settings, settings, None
            if previous is not None and self._store is not None and (
                previous.store_url, previous.store_prefix, previous.policy,
                previous.store_synchronous_commit,
            ) != (settings.store_url, settings.store_prefix, settings.policy,
                  settings.store_synchronous_commit):
                self._store.close()  # opened on an earlier configuration: reopen on next use
                self._store = None
        self.bus.enabled = settings.events
        self._broker_driver = None  # the configuration may name another broker
        self._drop_marker()
        self._joint_known = False
        self._reserved = None
        self._runs = {}
        for warning in settings.warnings():
            logger.warning("ojs_celery: %s", warning)
        return settings

    @property
    def reserved_queues(self) -> dict[str, str]:
        """Queue names no job may be published to, with what each is: OJS's sweep queue, and
        the exchanges of Celery's event bus and remote control (a job's queue of that name
        would declare an exchange of another type over theirs)."""
        if self._reserved is None:
            conf = self.app.conf
            control = conf.control_exchange
            self._reserved = {
                self.settings.sweep_queue: "the sweep queue",
                conf.event_exchange: "Celery's event exchange",
                f"{control}.pidbox": "Celery's remote-control exchange",
                f"reply.{control}.pidbox": "Celery's remote-control reply exchange",
            }
        return self._reserved

    @property
    def store(self) -> JobStore:
        if self._store is None:
            with self._lock:
                if self._store is None:
                    self._store = open_store(
                        self.settings.store_url,
                        policy=self.settings.policy,
                        prefix=self.settings.store_prefix,
                        synchronous_commit=self.settings.store_synchronous_commit,
                        timeout=self.settings.store_timeout,
                    )
                    self._joint_known = False
        return self._store

    @property
    def joint_store(self) -> RedisStore | None:
        """The job store when it is the broker's Redis: a new job's record and message are then
        written in one step (:mod:`ojs_celery.joint`); None otherwise."""
        if not self._joint_known:
            store = self.store
            found: RedisStore | None = None
            # a Redis broker (so kombu's Redis transport and redis-py import), and Celery's
            # message protocol 2, whose headers name the task id that kombu's _put looks for
            if self.broker_driver == "redis" and int(self.app.conf.task_protocol) == 2:
                from .joint import joint_store

                with self.app.connection_for_write() as connection:
                    found = joint_store(store, connection)
            self._joint, self._joint_known = found, True
        return self._joint

    def emit(self, transition: Transition) -> None:
        self.bus.emit_all(transition.events)

    def runs(self, task: Any, ojs_type: str) -> bool:
        """Whether ``task`` is the one that runs ``ojs_type`` here (see :meth:`task_name_for`).
        A yes is kept until the settings change (tasks are only added, so the first match
        stays the first): every start asks it."""
        if self._runs.get(ojs_type) == task.name:
            return True
        try:
            found = self.task_name_for(ojs_type)
        except UnknownType:
            return False
        self._runs[ojs_type] = found
        return bool(found == task.name)

    def task_name_for(self, ojs_type: str) -> str:
        """The Celery task that runs ``ojs_type``; raises :class:`UnknownType` otherwise.

        Only OJS tasks and explicit ``type_map`` entries qualify, so that an envelope can never
        invoke an arbitrary Celery task. A type not found is looked for once more after the
        app's task modules are imported (see :meth:`import_task_modules`).
        """
        try:
            return self._task_name_for(ojs_type)
        except UnknownType:
            self.import_task_modules()
        return self._task_name_for(ojs_type)

    def import_task_modules(self) -> None:
        """Import the app's task modules (its ``include`` and ``imports``, and what
        ``autodiscover_tasks`` finds), as a worker, beat and ``ojs-celery`` do at their start;
        once per process, at the first type (or ``send_task`` name) not found. Celery imports
        them lazily, so a process that never starts a worker (a web view calling ``enqueue``)
        registers only the tasks it imported itself, and would refuse every envelope of the
        others as "not an OJS task"."""
        if self._modules_imported:  # the common case, without the lock
            return
        with self._lock:
            if not self._modules_imported:
                self._modules_imported = True
                try:
                    self.app.loader.import_default_modules()
                except Exception as exc:  # a task module that does not import: it names none
                    logger.warning("ojs_celery: could not import the task modules of app %r "
                                   "(an envelope of their types is refused as not an OJS "
                                   "task): %s: %s", self.app.main, type(exc).__name__, exc)

    def _task_name_for(self, ojs_type: str) -> str:
        mapped = self.settings.type_map.get(ojs_type)
        tasks = self.app.tasks
        if mapped is not None:
            target = tasks.get(mapped)
            if target is not None and not getattr(target, "__ojs_task__", False):
                # a plain task would run the message and never write the job's outcome: the
                # job would stay available, and the redispatch backstop run the task again
                raise UnknownType(
                    f"type: {ojs_type!r} maps to {mapped!r} (ojs.type_map), which is not an "
                    "OJS task: give it base=OJSTask"
                )
            return mapped
        known = self._task_names.get(ojs_type)
        if known is not None and _handles(tasks.get(known), known, ojs_type):
            return known  # the first match found before is still the first (tasks only append)
        for name, task in tasks.items():
            if _handles(task, name, ojs_type):
                self._task_names[ojs_type] = str(name)
                return str(name)
        named = tasks.get(ojs_type)
        if named is not None and getattr(named, "__ojs_task__", False):
            # the task's Celery name, where its ojs_type gives it another OJS type
            raise UnknownType(
                f"type: {ojs_type!r} is no OJS type: it is the name of the OJS task whose "
                f"type is {named.ojs_type!r} (its ojs_type); name that type"
            )
        raise UnknownType(
            f"type: {ojs_type!r} is not an OJS task (register it with "
            f"@app.task(name={ojs_type!r}, base=OJSTask) or map it in ojs.type_map)"
        )

    @property
    def broker_driver(self) -> str:
        """The broker's kind (``amqp``, ``redis``, ``filesystem``...), asked of kombu once
        without connecting (``unknown`` when the transport's client library is missing). On a
        Redis broker, learning it installs the hooks that spare kombu's per-command client for
        OJS messages in this process."""
        if self._broker_driver is None:
            try:
                with self.app.connection_for_write() as connection:
                    self._broker_driver = str(connection.transport.driver_type)
            except ImportError:
                self._broker_driver = "unknown"
            if self._broker_driver == "redis":  # known at a first OJS publish, a worker's start
                from .joint import install_put
                from .kept_client import install_qos

                install_put()  # kombu's Redis _put for OJS messages (see ojs_celery.joint)
                install_qos(self.app)  # and its QoS bookkeeping of them (ojs_celery.kept_client)
        return self._broker_driver

    @property
    def broker_marker(self) -> BrokerMarker | None:
        """The sweepers' mark in the broker, on a Redis broker (one that loses its queued
        messages with its data: see :mod:`ojs_celery.broker_mark`); None on any other."""
        if self._marker is None and self.broker_driver == "redis":
            from .broker_mark import BrokerMarker

            self._marker = BrokerMarker(self.app, self.settings.store_prefix)
        return self._marker

    def _drop_marker(self) -> None:
        marker, self._marker = self._marker, None
        if marker is not None:
            marker.close()

    def flush(self) -> None:
        """Wait for this process's pending outbox acknowledgements, bus events and removals
        of acknowledged deliveries from kombu's Redis record (:mod:`ojs_celery.unacked`)."""
        self.acks.flush()
        self.bus.flush()
        unacked.flush()

    def close(self) -> None:
        self.acks.flush()
        self._drop_marker()
        if self._store is not None:
            self._store.close()
            self._store = None


def _require_extras(conf: Any) -> None:
    """The broker and result backend Celery is configured with have their packages (kombu
    imports a transport only at the first connection, in the middle of a publish)."""
    try:
        compat.require_broker_extra(conf.get("broker_url"))
        compat.require_backend_extra(conf.get("result_backend"))
    except compat.MissingExtra as exc:
        raise ImproperlyConfigured(str(exc)) from None


def _handles(task: Any, name: str, ojs_type: str) -> bool:
    """Is ``task`` (registered as ``name``) the OJS task of ``ojs_type``?"""
    if task is None or not getattr(task, "__ojs_task__", False):
        return False
    return bool((getattr(task, "ojs_type", None) or name) == ojs_type)


def attach(app: Celery) -> Runtime:
    runtime = getattr(app, _ATTR, None)
    if runtime is None:
        runtime = Runtime(app)
        setattr(app, _ATTR, runtime)
    return runtime


def get_runtime(app: Celery | None = None) -> Runtime:
    target: Any = app or current_app
    runtime = getattr(target, _ATTR, None)
    if runtime is None:
        raise NotInstalled(
            f"the Celery app {target.main!r} has no OJS runtime: call ojs_celery.install(app)"
        )
    return runtime  # type: ignore[no-any-return]
