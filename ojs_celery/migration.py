"""The migration report (``ojs-celery -A APP inspect``): what each registered task becomes under
OJS, and what in the app's configuration works against OJS.

It only reads the app (its tasks, routes and settings); it connects to nothing, so it can run
in CI against a project before the switch. What the broker's server enforces (RabbitMQ's
``consumer_timeout``) is taken from the queue's ``x-consumer-timeout`` argument, else from
RabbitMQ's default (30 minutes).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from celery import Celery, Task

from .envelope import CELERY_SEMANTICS_FIELD, QUEUE_PATTERN, TYPE_PATTERN, Job, RetryPolicy
from .install import check_sweep_queue
from .producer import (
    broker_driver,
    celery_semantics_of,
    celery_time_fields,
    ojs_queue_of,
    tasks_without_limit,
)
from .runtime import get_runtime
from .sweeper import SWEEP_TASK
from .worker.pools import WEAK_POOLS, pool_name

#: Kombu's Redis transport redelivers an unacknowledged message after this (seconds).
REDIS_VISIBILITY_DEFAULT = 3600.0
#: RabbitMQ closes a channel whose delivery stays unacknowledged this long (since 3.8.15).
RABBITMQ_CONSUMER_TIMEOUT_DEFAULT = 1800.0

#: Task options without an OJS equivalent, with what happens to them (only reported when set
#: to something other than Celery's default).
NO_EQUIVALENT = {
    "rate_limit": "no OJS equivalent: Celery's worker still applies it to OJS tasks",
    "reject_on_worker_lost": "no effect: OJS recovers the job of a lost pool process "
                             "(error WorkerLostError) or worker (worker_death) itself, "
                             "retried per its OJS retry policy",
    "acks_on_failure_or_timeout": "no effect: OJS tasks always ack late and record failures",
    "track_started": "no effect on OJS state: the job store records `active` itself",
    "store_errors_even_if_ignored": "no effect on OJS state: errors are always in the job record",
    "resultrepr_maxsize": "no OJS equivalent",
}
#: Task classes an app may have (Celery's ``task_cls``) whose additions ``OJSTask`` has itself:
#: Celery's Django task class (the Django fixup's default since Celery 5.4) adds
#: ``delay_on_commit`` and ``apply_async_on_commit``, which ``OJSTask`` has too.
COVERED_TASK_CLASSES = ("celery.contrib.django.task.DjangoTask",)
_CELERY_DEFAULTS: dict[str, Any] = {
    "rate_limit": None, "reject_on_worker_lost": None, "acks_on_failure_or_timeout": True,
    "track_started": False, "store_errors_even_if_ignored": False, "resultrepr_maxsize": 1024,
}


@dataclass
class TaskReport:
    name: str
    ojs: bool
    ojs_type: str | None
    queue: str
    ojs_queue: str | None
    envelope: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    #: how ``self.retry``/``autoretry_for`` retry a Celery call's job (its Celery semantics,
    #: kept in the record's ``x_celery_semantics``) in OJS terms; None when the job follows
    #: the OJS retry policy (``ojs_semantics``, ``celery_callers: "ojs"``)
    celery_retry: dict[str, Any] | None = None


@dataclass
class Report:
    tasks: list[TaskReport]
    warnings: list[str]

    def as_dict(self) -> dict[str, Any]:
        return {"tasks": [asdict(t) for t in self.tasks], "warnings": self.warnings}


def build_report(app: Celery) -> Report:
    """The report for every registered task of ``app`` except Celery's and OJS's own."""
    runtime = get_runtime(app)
    settings = runtime.settings
    conf = app.conf
    driver = broker_driver(app)
    warnings: list[str] = list(settings.warnings())  # also logged when they are read
    pool = pool_name(conf.get("worker_pool") or "prefork")
    if pool in WEAK_POOLS:
        warnings.append(f"worker_pool {pool!r} does not enforce {WEAK_POOLS[pool]}: OJS "
                        "timeouts there are the sweeper's to enforce (use prefork)")
    for name in ("task_serializer", "result_serializer"):
        if conf.get(name) == "pickle":
            warnings.append(f"{name} is pickle: OJS jobs travel as JSON (envelopes from other "
                            "languages), and pickle lets whoever can publish run code")
    if "pickle" in (conf.get("accept_content") or ()):
        warnings.append("accept_content includes pickle: a worker would unpickle what anyone "
                        "who can publish sends")
    problem = check_sweep_queue(app, settings.sweep_queue)
    if problem:
        warnings.append(problem)
    unlimited = tasks_without_limit(app)
    if unlimited:
        warnings.append(
            f"{len(unlimited)} OJS task(s) have no time limit (time_limit/soft_time_limit or "
            f"task_time_limit): jobs from their Celery callers get the OJS default timeout of "
            f"{settings.default_timeout}s (setting default_timeout): {', '.join(unlimited)}")
    mapped = {task: ojs_type for ojs_type, task in settings.type_map.items()}
    # each task's warnings name it too, a task not migrated yet included (the report runs
    # before the switch: "once migrated" it gets the default timeout)
    unlimited_any = set(tasks_without_limit(app, ojs_only=False))
    for ojs_type, task_name in settings.type_map.items():
        target = app.tasks.get(task_name)
        if target is not None and not getattr(target, "__ojs_task__", False):
            warnings.append(
                f"ojs.type_map: {ojs_type!r} maps to {task_name!r}, which is not an OJS task "
                "(base=OJSTask): envelopes of that type are refused")
    tasks = []
    for name in sorted(app.tasks):
        if name.startswith("celery.") or name == SWEEP_TASK:
            continue
        tasks.append(_task_report(app, app.tasks[name], name, mapped.get(name), driver,
                                  settings.default_timeout if name in unlimited_any else None))
    return Report(tasks, warnings)


def _task_report(app: Celery, task: Any, name: str, mapped_type: str | None,
                 driver: str, default_timeout: int | None) -> TaskReport:
    """One task's report; ``default_timeout``: the timeout it gets for want of a Celery time
    limit (see :func:`~ojs_celery.producer.tasks_without_limit`), None if it has one."""
    conf = app.conf
    is_ojs = bool(getattr(task, "__ojs_task__", False))
    ojs_type = (getattr(task, "ojs_type", None) or name) if is_ojs else mapped_type
    queue = _routed_queue(app, name)
    report = TaskReport(name=name, ojs=is_ojs, ojs_type=ojs_type,
                        queue=queue, ojs_queue=ojs_queue_of(app, queue) if is_ojs else None)
    envelope = report.envelope
    settings = get_runtime(app).settings
    envelope.update(celery_time_fields(app, task, {}, settings))  # as a call's job gets them
    envelope.setdefault("grace_period", Job.model_fields["grace_period"].default)
    if default_timeout is not None:
        report.warnings.append(
            f"no time limit under plain Celery: OJS gives it the default timeout of "
            f"{default_timeout}s (setting default_timeout; set time_limit/soft_time_limit "
            "to choose)")
    max_retries = getattr(task, "max_retries", 3)
    retry: dict[str, Any] = {"max_attempts": None if max_retries is None else max_retries + 1}
    delay = getattr(task, "default_retry_delay", 180)
    backoff = getattr(task, "retry_backoff", False)
    if backoff:
        # Celery's autoretry: countdown = int(max(1, retry_backoff)) * 2 ** retries, capped
        retry["initial_interval"] = _duration(int(max(1.0, float(backoff))))
        retry["backoff_coefficient"] = 2.0
        retry["max_interval"] = _duration(getattr(task, "retry_backoff_max", 600))
        retry["jitter"] = bool(getattr(task, "retry_jitter", True))
    else:
        retry["initial_interval"] = _duration(delay)
        retry["backoff_coefficient"] = 1.0
    autoretry = getattr(task, "autoretry_for", ()) or ()
    if autoretry:
        retry["x_celery_autoretry_for"] = [getattr(e, "__name__", str(e)) for e in autoretry]
    # the job's record: the OJS retry policy (for a Celery caller's job, that of the
    # recoveries: a lost worker, a shutdown) and, with Celery's semantics, what bounds its
    # Celery retries; the record has no translation of them (README, "Celery callers")
    envelope["retry"] = RetryPolicy().model_dump(
        mode="json", exclude={"non_retryable_errors", "on_exhaustion"})
    semantics = celery_semantics_of(task, settings)
    if semantics is not None:
        envelope[CELERY_SEMANTICS_FIELD] = semantics
        report.celery_retry = retry
    expires = getattr(task, "expires", None)
    if expires is not None:
        envelope["expires_at"] = f"enqueue time + {expires}s" if not hasattr(
            expires, "isoformat") else expires.isoformat()
    priority = getattr(task, "priority", None)
    if priority is not None:
        envelope["priority"] = priority
    own = _own_task_class(app)
    # an OJS task without it lost it; a plain task with it would lose it once migrated
    if own is not None and is_ojs != isinstance(task, own):
        # a class made in a function (Flask's make_celery) has "<locals>" in its qualname
        own_name, where = own.__name__, f"{own.__module__}.{own.__qualname__}"
        if getattr(own, "__ojs_task__", False):  # Flask's FlaskTask(OJSTask) as task_cls
            report.warnings.append(
                f"base=OJSTask takes the place of the app's task class "
                f"{where} (task_cls), an OJS task class itself: what it "
                f"adds (its __call__, methods, hooks such as on_failure) is not on this task; "
                f"leave out base=OJSTask (or give base={own_name})")
        else:
            report.warnings.append(
                f"base=OJSTask takes the place of the app's task class "
                f"{where} (task_cls): what it adds (methods, hooks such as "
                f"on_failure) is not on an OJS task; give it a base with both: "
                f"class OJS{own_name}(OJSTask, {own_name})")
    asked = getattr(task, "ojs_acks_late_asked", None) if is_ojs else None
    if asked is not None:
        report.warnings.append(f"acks_late={asked!r}: ignored: OJS tasks always ack late (a "
                               "message is acknowledged when its attempt's outcome is written)")
    for option, what in NO_EQUIVALENT.items():
        # an OJS task's track_started is kept in ojs_track_started (OJSTask.on_bound)
        value = getattr(task, "ojs_track_started" if is_ojs and option == "track_started"
                        else option, _CELERY_DEFAULTS[option])
        if value != _CELERY_DEFAULTS[option]:
            report.warnings.append(f"{option}={value!r}: {what}")
    if getattr(task, "serializer", None) == "pickle" and conf.get("task_serializer") != "pickle":
        report.warnings.append("serializer='pickle': OJS jobs travel as JSON")
    if report.ojs_type is not None and not re.fullmatch(TYPE_PATTERN, report.ojs_type):
        report.warnings.append(f"{report.ojs_type!r} is not a valid OJS type: envelopes cannot "
                               "name it (give the task an ojs_type, or map one in type_map)")
    if is_ojs and report.ojs_queue is not None and not _valid_ojs_queue(report.ojs_queue):
        report.warnings.append(f"queue {queue!r} is not a valid OJS queue name: envelopes "
                               "cannot name it")
    held = envelope["timeout"] + envelope.get("grace_period", 0)
    if driver == "redis":
        visibility = float((conf.get("broker_transport_options") or {}).get(
            "visibility_timeout", REDIS_VISIBILITY_DEFAULT))
        if visibility < held:
            report.warnings.append(
                f"Redis visibility_timeout {visibility:g}s is shorter than the task's "
                f"timeout and grace period ({held:g}s): Redis redelivers it while it runs "
                "(the copy is dropped by fencing, but raise broker_transport_options"
                "['visibility_timeout'])")
    if driver == "amqp":
        limit = _consumer_timeout(app, queue)
        if limit < held:
            report.warnings.append(
                f"RabbitMQ consumer_timeout {limit:g}s is shorter than the task's timeout "
                f"and grace period ({held:g}s): RabbitMQ closes the channel of a worker "
                "still running it (raise consumer_timeout, or x-consumer-timeout on the queue; "
                "and set broker_channel_error_retry, or Celery's worker stops there)")
    return report


def _own_task_class(app: Celery) -> type | None:
    """The app's task class (Celery's ``task_cls``, or a class set as ``app.Task`` as Flask's
    older ``make_celery`` pattern does: the base of every task given no ``base=``) when it is
    the project's own: ``base=OJSTask`` takes its place, so an OJS task loses what it adds
    unless its base has both (``class ProjectTask(OJSTask, Base)``). None for Celery's own
    classes, whose additions ``OJSTask`` has, and for one that cannot be imported."""
    try:
        bound = app.Task
    except Exception:  # the report reads the app; Celery names that error itself
        return None
    # Celery's app.Task is its subclass of task_cls that holds the app (its own ``_app``)
    cls = next((klass for klass in bound.__mro__ if "_app" not in vars(klass)), Task)
    if not isinstance(cls, type) or cls is Task or not issubclass(cls, Task):
        return None
    if f"{cls.__module__}.{cls.__qualname__}" in COVERED_TASK_CLASSES:
        return None
    return cls


def _duration(seconds: float) -> str:
    """Seconds as an ISO 8601 duration (fractions kept: ``PT0.2S``)."""
    return f"PT{float(seconds):g}S"


def _routed_queue(app: Celery, name: str) -> str:
    try:
        options = app.amqp.router.route({}, name, (), {})
    except Exception:  # a router function that needs real arguments
        return str(app.conf.task_default_queue)
    queue = options.get("queue")
    return str(getattr(queue, "name", queue) or app.conf.task_default_queue)


def _consumer_timeout(app: Celery, queue_name: str) -> float:
    try:
        queue = app.amqp.queues[queue_name]
    except KeyError:
        return RABBITMQ_CONSUMER_TIMEOUT_DEFAULT
    arguments = getattr(queue, "queue_arguments", None) or {}
    value = arguments.get("x-consumer-timeout")
    return float(value) / 1000 if value else RABBITMQ_CONSUMER_TIMEOUT_DEFAULT


def _valid_ojs_queue(name: str) -> bool:
    return re.fullmatch(QUEUE_PATTERN, name) is not None and len(name) <= 128
