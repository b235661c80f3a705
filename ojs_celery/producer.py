"""From a job to a Celery message: the publish options of every attempt, and the publish.

A message is only a request to run one attempt: it carries the job id as Celery task id (for
every attempt, so ``AsyncResult(job_id)`` follows the job) and the ``ojs`` header
(:mod:`ojs_celery.header`) with the dispatch token. OJS never uses Celery's
``expires`` or revoke-by-id for its jobs: both would make Celery drop every later message with
the same task id, retries included.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date, datetime
from typing import Any

from amqp.exceptions import MessageNacked
from celery import Celery, Task
from celery.app.task import Context
from celery.utils.time import maybe_iso8601, maybe_make_aware
from kombu.common import Broadcast
from kombu.entity import Queue
from kombu.exceptions import EncodeError, OperationalError, SerializerNotInstalled
from kombu.serialization import dumps as _kombu_dumps

from . import compat, header
from .conf import Settings, raw_settings
from .envelope import (
    CELERY_KWARGS_FIELD,
    CELERY_OPTIONS_FIELD,
    InvalidJob,
    Job,
    format_epoch,
    format_timestamp,
    from_epoch,
    typed_values,
    utf8_violations,
)
from .lifecycle import Publish, Record
from .lifecycle.rules import celery_retries, celery_semantics
from .runtime import Runtime, get_runtime

logger = logging.getLogger(__name__)

#: Publish retries: fail fast enough that ``enqueue`` can report a broker that is down.
PUBLISH_RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.5,
                        "interval_max": 1.0}
DEFAULT_QUEUE = "default"
#: The Celery options Python callers may give an OJS job (``.apply_async(link=...)``, canvas):
#: the callbacks, the rest of a chain, the chord body, group id and index, the job's parents
#: (see :mod:`ojs_celery.canvas`), the call's ``ignore_result``, ``reply_to``: where the
#: ``rpc://`` result backend sends the result (the caller's queue, for every attempt's message
#: as Celery's retry keeps it, not the queue of the worker that republishes it), and the call's
#: custom ``headers`` (:func:`custom_headers`), which Celery's retry keeps too; ``argsrepr``/
#: ``kwargsrepr``: what Celery's events, logs, ``inspect`` and Flower show in place of the
#: arguments (Celery's way to hide sensitive ones), kept for every attempt, retries included.
TRUSTED_OPTIONS = ("link", "link_error", "chain", "chord", "group_id", "group_index",
                   "parent_id", "root_id", "ignore_result", "reply_to", "headers", "argsrepr",
                   "kwargsrepr")

#: Message header names that are Celery's own (its protocol's, its request's) or OJS's: a
#: call's ``headers`` entry of such a name would rewrite the message's id, retries or token,
#: so it is not kept. Celery's worker shows the others, its "custom headers", in
#: ``self.request`` (an attribute each, and ``self.request.headers``).
RESERVED_HEADERS = frozenset(
    {name for name in vars(Context) if not name.startswith("_")}
    | {"lang", "task", "argsrepr", "kwargsrepr", "compression", header.NAME})


class BrokerUnavailable(RuntimeError):
    """The job is stored but its message could not be published (it stays in the outbox)."""


def celery_queue(app: Celery, ojs_queue: str) -> str:
    """OJS ``default`` is the app's default queue; other names are used as they are."""
    if ojs_queue == DEFAULT_QUEUE:
        return str(compat.celery_setting(app, "task_default_queue"))
    return ojs_queue


def ojs_queue_of(app: Celery, celery_queue_name: str | None) -> str:
    """The record's name of a Celery queue: ``default`` for the app's default queue, any other
    name as it is. A Celery queue named ``default`` that is not the app's default queue has no
    name in the record (``default`` means the app's default): refused, not misrouted."""
    if not celery_queue_name or celery_queue_name == compat.celery_setting(
            app, "task_default_queue"):
        return DEFAULT_QUEUE
    if celery_queue_name == DEFAULT_QUEUE:
        raise InvalidJob([("queue", (
            f'is the Celery queue "default", but the app\'s default queue is '
            f'{app.conf.task_default_queue!r} and "default" in an OJS record means that queue: '
            'rename the queue or set task_default_queue = "default"'))])
    return celery_queue_name


def broker_priority(app: Celery, priority: int, amqp_max: int) -> int | None:
    """Map OJS priority (−100..100, higher first, 0 normal) to the broker's; None: publish
    without one.

    Normal (0, the default) gets none: the message goes out as plain Celery sends a task
    without a priority (the broker's default), so migrated and plain tasks keep their order in
    a shared queue. That default is an end of each broker's range, so an OJS priority moves a
    job only the way its broker can still go. RabbitMQ (0..``amqp_max_priority``, higher first;
    the queue needs ``x-max-priority``; the default is 0, the lowest): a positive priority goes
    ahead, 1..``amqp_max``. Redis (0..9, 0 first; the default is 0, the first): a negative one
    goes behind, 1..9. Other transports ignore priorities.
    """
    if priority == 0:
        return None
    driver = broker_driver(app)
    if driver == "amqp" and priority > 0:
        return max(1, round(priority / 100 * amqp_max))
    if driver == "redis" and priority < 0:
        return max(1, round(-priority / 100 * 9))
    return None


def ojs_priority_of(app: Celery, priority: int, amqp_max: int) -> int | None:
    """A Celery caller's broker priority (``priority`` per call, task option, route) as the
    OJS priority that :func:`broker_priority` maps back to it: the message gets the priority
    it had under plain Celery. None: the broker has no priorities (the job keeps 0)."""
    driver = broker_driver(app)
    if driver == "amqp":
        return round(min(max(priority, 0), amqp_max) / amqp_max * 100)
    if driver == "redis":
        return -round(min(max(priority, 0), 9) / 9 * 100)
    return None


def broker_driver(app: Celery) -> str:
    """The broker's kind (``amqp``, ``redis``, ``filesystem``...), asked of kombu without
    connecting; kept by the app's OJS runtime."""
    return get_runtime(app).broker_driver


def time_limits(job: Job, start_at: float) -> tuple[float | None, float]:
    """``(soft, hard)`` for an attempt starting at ``start_at``, clamped to the total deadline;
    whole seconds as ints, as a Celery caller's ``time_limit=9`` travels (the worker's
    ``TimeLimitExceeded(9)``, ``self.request.timelimit`` ``[9, 5]``)."""
    hard = float(job.timeout + job.grace_period)
    soft: float | None = float(job.timeout) if job.grace_period > 0 else None
    if job.total_timeout is not None and job.created_at is not None:
        remaining = job.created_at.timestamp() + job.total_timeout - start_at
        hard = max(min(hard, remaining), 1.0)
        if soft is not None:
            soft = min(soft, hard)
    if soft is not None and soft >= hard:
        soft = None
    return (None if soft is None else _whole(soft)), _whole(hard)


def _whole(seconds: float) -> float:
    return int(seconds) if seconds.is_integer() else seconds


#: The serializers this process has encoded with (a failure is not kept: an app may register
#: its own serializer later).
_WORKING_SERIALIZERS: set[str] = set()
_encode: Any = _kombu_dumps  # kombu's registry: what Celery's publish encodes a body with
#: A body shaped as Celery's (protocol 2: args, kwargs, embed), for a serializer that reads it.
_CELERY_BODY: tuple[Any, ...] = ((), {}, {"callbacks": None, "errbacks": None, "chain": None,
                                          "chord": None})


def check_serializer(app: Celery) -> None:
    """Raise kombu's ``SerializerNotInstalled``, as Celery's publish does at every call, when
    the app's ``task_serializer`` cannot encode in this process (``msgpack`` or ``yaml``
    without its library). Checked before a job is stored: such a job's message could not be
    published here, by the call or by a sweep, and the caller would be told it was taken."""
    name = compat.celery_setting(app, "task_serializer")
    if name in _WORKING_SERIALIZERS:
        return
    try:
        _encode(_CELERY_BODY, serializer=name)
    except SerializerNotInstalled as exc:
        raise SerializerNotInstalled(
            f"task_serializer {name!r} cannot encode in this process ({exc}): nothing was "
            "stored") from exc
    except EncodeError:  # installed, but particular about what it encodes: the publish decides
        return
    _WORKING_SERIALIZERS.add(name)


def publish(
    runtime: Runtime,
    job: Job,
    request: Publish,
    now: float | None = None,
    *,
    record: Record | None = None,
    producer: Any = None,
    acks: list[tuple[str, int]] | None = None,
) -> None:
    """Send the message for ``request`` and clear its outbox entry (in the background: see
    :mod:`ojs_celery.outbox`). Pass ``record``, the record the store write that owes this
    message returned, to put its snapshot in the header; ``producer``, a kombu producer held
    for many messages (``app.producer_or_acquire()``), to spare a pool acquire per message
    (otherwise one is acquired here, as Celery would);
    ``acks``, to collect the outbox acknowledgement for the caller to give once it knows
    there is an entry to clear (a batch of :func:`sent_together` really sent, the store write
    that owes the message confirmed), instead of giving it now.

    Raises :class:`BrokerUnavailable` if the broker cannot be reached; the outbox entry stays,
    so the sweeper publishes it later.
    """
    app = runtime.app
    at = time.time() if now is None else now
    start_at = max(at, request.eta or at)
    soft, hard = time_limits(job, start_at)
    kept = trusted_options(job)
    options: dict[str, Any] = {
        "task_id": job.id,
        # the call's custom headers (as Celery's retry keeps them), then the job's own
        "headers": {**kept.pop("headers", {}), header.NAME: header.build(job, request.token,
                                                                          record)},
        # Given even when None: Celery 5.7's send_task fills what is not given from the task's
        # options, and the job's own limits and expires_at are the only ones (a Celery
        # ``expires`` would have the worker drop the message without the job store knowing).
        "time_limit": hard,
        "soft_time_limit": soft,
        "expires": None,
        # The app's serializer and compression, the ones check_serializer checks: Celery 5.7's
        # send_task would otherwise take the task's own (README: ignored for OJS messages).
        "serializer": compat.celery_setting(app, "task_serializer"),
        "compression": compat.celery_setting(app, "task_compression"),
        "retry": True,
        "retry_policy": PUBLISH_RETRY_POLICY,
        # Only read by a channel in confirm mode (kombu's ``confirm_publish``): a publish the
        # broker does not confirm in time (a blocked connection: RabbitMQ's memory or disk
        # alarm) fails as a lost connection, is tried again per the policy, and then raises
        # BrokerUnavailable with the outbox entry kept, instead of waiting for ever.
        **compat.publish_confirm_limit(runtime.settings.publish_timeout),
    }
    priority = broker_priority(app, job.priority, runtime.settings.amqp_max_priority)
    if priority is not None:  # (a None costs Celery's send_task 1 % more: README, priority)
        options["priority"] = priority
    if request.eta is not None and request.eta > at:
        options["eta"] = from_epoch(request.eta)
    # self.request.retries in the handler: Celery's retries for a job that keeps Celery's
    # semantics (recoveries do not count), the attempts so far for the others.
    options["retries"] = celery_retries(job) if celery_semantics(job) is not None else job.attempt
    extensions = job.extensions
    # a tuple, as Celery's calls and retries send positional arguments: the arguments'
    # ``argsrepr`` (events, logs, ``inspect``) reads ``(1, 2)`` as under plain Celery
    args, kwargs = tuple(job.args), extensions.get(CELERY_KWARGS_FIELD) or {}
    name = runtime.task_name_for(job.type)
    # the handler's self.request.ignore_result: the call's (kept), else the task's, as Celery's
    # apply_async sends it (Celery 5.7's send_task would send None)
    options["ignore_result"] = getattr(app.tasks.get(name), "ignore_result", False)
    if options["serializer"] != "json":
        # the typed values a Celery caller's arguments and options may hold are kept as
        # kombu's typed JSON, which that serializer would carry as dicts: give it the values
        args, kwargs, kept = typed_values(args), typed_values(kwargs), typed_values(kept)
    options.update(kept)
    try:
        with app.producer_or_acquire(producer) as held:
            try:
                options["queue"] = queue = bound_queue(app, celery_queue(app, job.queue), held)
                if "eta" in options and compat.delays_natively(app, held, queue):
                    soonest = time.time() + compat.NATIVE_DELAY_LEAST
                    options["eta"] = from_epoch(max(request.eta or soonest, soonest))
                app.send_task(name, args=args,
                              kwargs=kwargs, producer=held, **options)
            except OperationalError:
                abandon_connection(held)
                raise
    except OperationalError as exc:
        limited = bool((app.conf.broker_transport_options or {}).get("confirm_publish")
                       and compat.publish_confirm_limit(runtime.settings.publish_timeout))
        reason = "broker: " + publish_failure(
            exc, runtime.settings.publish_timeout if limited else None)
        raise BrokerUnavailable(
            f"job {job.id} is stored but its message could not be published ({reason}); "
            "it stays in the outbox and the sweeper publishes it when the broker takes it"
        ) from exc
    if acks is None:
        runtime.acks.ack(job.id, request.token)
    else:
        acks.append((job.id, request.token))


def publish_failure(exc: OperationalError, publish_timeout: float | None) -> str:
    """What kombu's error for a failed publish means, in words: its text is empty for a
    RabbitMQ nack, and a bare "timed out" for a broker that did not answer (``publish_timeout``:
    the confirmation's limit, when the app has publisher confirms on)."""
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, MessageNacked):
        return ("RabbitMQ refused the message (a nack: its queue is full with "
                "x-overflow reject-publish, or the broker could not store it)")
    text = str(exc) or type(cause or exc).__name__
    if isinstance(cause, TimeoutError):
        text += (" (the broker did not answer in time: blocked by a RabbitMQ memory or disk "
                 "alarm, or not responding")
        if publish_timeout is not None:
            text += (f"; each try waits up to ojs.publish_timeout, {publish_timeout:g}s, for "
                     "its confirmation")
        text += ")"
    return text


def abandon_connection(producer: Any) -> None:
    """Drop ``producer``'s broker connection without the closing handshake, after a publish
    that failed as a lost connection. The pool then closes it when the producer leaves, and
    py-amqp's close waits without a limit for the broker's reply, which a blocked connection
    (RabbitMQ's memory or disk alarm) never sends: ``.delay()`` would hang there after all.
    A message written to it and not confirmed may still arrive: its job's outbox entry stays,
    and fencing drops the copy the sweeper sends."""
    connection = getattr(producer, "connection", None)
    if connection is None:
        return
    try:
        connection.collect()
    except Exception as exc:  # best effort: the publish's own error is what the caller hears
        logger.debug("ojs_celery: could not drop a failed broker connection: %r", exc)


#: Queues bound to a broker channel: (id of the channel, queue name) -> (the channel, the
#: app's queue, its bound copy). A bound queue holds its channel, so the cache is a plain dict
#: that forgets everything when it grows past :data:`_MAX_BOUND` (after reconnects, or an app
#: with very many queues) rather than a weak one that the values would keep alive.
_bound_queues: dict[tuple[int, str], tuple[Any, Queue, Queue]] = {}
_MAX_BOUND = 256
_KEEPS_BOUND_QUEUES = compat.keeps_bound_queues()


def bound_queue(app: Celery, name: str, producer: Any) -> Queue | str:
    """The app's queue ``name`` bound to the channel of ``producer``'s connection, made once
    per channel; ``name`` itself when that connection is not up yet (Celery connects it, with
    its retries), the app has no such queue (Celery raises as it would) or it is a
    ``Broadcast`` queue (which Celery does not declare).

    Celery's publish declares the queue of every message (kombu caches the declaration, not
    the binding): for a queue given by name, kombu binds a fresh copy of it, its exchange and
    its bindings to the channel for each message, about a twentieth of a publish's
    instructions. A queue bound already is used as it is; the declaration, its cache and the
    routing stay kombu's and Celery's (kombu rebinds the queue itself after a reconnect; on
    kombu 5.5 and 5.6, which cannot, the name is returned: see ``compat.keeps_bound_queues``)."""
    if not _KEEPS_BOUND_QUEUES:
        return name
    connection = getattr(producer, "connection", None)
    if connection is None or not connection.connected:
        return name
    try:
        queue = app.amqp.queues[name]
    except KeyError:
        return name
    if isinstance(queue, Broadcast):  # never declared by Celery; a copy may rename it
        return name
    channel = connection.default_channel
    key = (id(channel), name)
    known = _bound_queues.get(key)
    if known is None or known[0] is not channel or known[1] is not queue:
        if len(_bound_queues) >= _MAX_BOUND:
            _bound_queues.clear()
        known = _bound_queues[key] = (channel, queue, queue.bind(channel))
    return known[2]


@contextmanager
def sent_together(producer: Any) -> Iterator[None]:
    """Messages published through ``producer`` inside are sent together at the exit where
    kombu can (``Producer.batch``, kombu 5.7 and later: one pipeline on Redis; AMQP, older
    kombu and a Redis connection with retries configured send each at once, as kombu decides).
    The exit raises if they could not all be sent: delivery is then uncertain for each, so
    none of them may be acknowledged (the sweeper publishes them again, fencing drops the
    duplicates). Nothing is flushed before the exit: the caller bounds how many it sends."""
    batch = getattr(producer, "batch", None)
    if batch is None:
        yield
        return
    with batch(max_size=sys.maxsize):
        yield


def with_celery_options(job: Job, options: dict[str, Any]) -> Job:
    """``job`` carrying the Celery options that trusted Python code gave (see
    :data:`TRUSTED_OPTIONS`), kept in the stored record for every attempt's message."""
    kept = {name: options[name] for name in TRUSTED_OPTIONS if options.get(name) is not None}
    if "headers" in kept:
        kept["headers"] = custom_headers(kept["headers"])
        if not kept["headers"]:
            del kept["headers"]
    if not kept:
        return job
    bad = utf8_violations(kept)  # a plain callback's arguments: nothing else checks them
    if bad:
        raise InvalidJob(bad)
    return job.model_copy(update={CELERY_OPTIONS_FIELD: kept})


def custom_headers(headers: Any) -> dict[str, Any]:
    """A call's ``headers`` without the names Celery or OJS set themselves
    (:data:`RESERVED_HEADERS`); raises :class:`~ojs_celery.InvalidJob` for what is no dict
    (Celery's publish would fail on it)."""
    if not isinstance(headers, dict):
        raise InvalidJob([("headers", "must be a dict of message headers")])
    return {name: value for name, value in headers.items() if name not in RESERVED_HEADERS}


def trusted_options(job: Job) -> dict[str, Any]:
    """The Celery options stored with ``job`` by :func:`with_celery_options` (never from an
    envelope: :func:`~ojs_celery.envelope.parse_envelope` refuses the field)."""
    stored = (job.model_extra or {}).get(CELERY_OPTIONS_FIELD)
    if not isinstance(stored, dict):
        return {}
    return {name: stored[name] for name in TRUSTED_OPTIONS if stored.get(name) is not None}


def celery_datetime(value: datetime | date | str, option: str) -> datetime:
    """A Celery caller's ``eta`` or ``expires`` given as a datetime or, as Celery also takes
    them, as ISO 8601 text (``send_task`` parses it with dateutil's ``isoparse``; the worker
    with ``maybe_iso8601``), made aware: a naive one is UTC, as Celery's worker reads it
    (``maybe_make_aware``); a ``date`` is its midnight, as Celery sends its ``isoformat()``.
    Text that is no such date raises :class:`~ojs_celery.InvalidJob` naming the option (a
    ``ValueError``, as Celery's own)."""
    if isinstance(value, date) and not isinstance(value, datetime):
        value = datetime(value.year, value.month, value.day)
    if isinstance(value, str):
        try:
            parsed = maybe_iso8601(value)
        except (ValueError, OverflowError) as exc:
            parsed, problem = None, str(exc)
        else:
            problem = "empty"
        if parsed is None:
            raise InvalidJob([(option, f"must be a datetime or ISO 8601 text ({problem})")])
        value = parsed
    aware: datetime = maybe_make_aware(value)
    return aware


def scheduled_at_from(eta: datetime | date | str | None,
                      countdown: float | None) -> datetime | None:
    """When a Celery caller's ``eta``/``countdown`` schedules the job. A ``countdown`` wins
    over an ``eta`` given with it, as in Celery (its message's ETA is made from the countdown).
    A naive ``eta`` is UTC, as Celery's worker reads it (``maybe_make_aware``), like a naive
    ``expires``; ISO 8601 text is read as Celery reads it (:func:`celery_datetime`)."""
    if countdown:
        return from_epoch(time.time() + float(countdown))
    if eta:  # Celery sends an empty ``eta`` as none
        return celery_datetime(eta, "eta")
    return None


# --------------------------------------------------------------------------- Celery callers


def call_mismatch(task: Task, args: Any, kwargs: Any) -> TypeError | None:
    """The ``TypeError`` Celery's own argument check (``Task.typing``, on by default) raises
    for calling ``task`` with ``args`` and ``kwargs``: a missing or unexpected argument. None
    when they fit, or when the task does not check (``typing=False``)."""
    check = getattr(task, "__header__", None) if getattr(task, "typing", True) else None
    if check is None:
        return None
    try:
        check(*(args or ()), **(kwargs or {}))
    except TypeError as exc:
        return exc
    return None


def celery_route(app: Celery, task: Task, args: Any, kwargs: Any, options: dict[str, Any]) -> str:
    """The Celery queue a Celery caller's message goes to, decided by Celery's own router
    (``task_routes``: dicts, globs, router functions; the task's ``queue``; a per-call
    ``queue``, which wins), as ``Task.apply_async`` would."""
    given = {**task._get_exec_options(), **options}
    try:
        routed = app.amqp.router.route({k: v for k, v in given.items() if v is not None},
                                       task.name, args or (), kwargs or {}, task_type=task)
    except KeyError:  # QueueNotFound (task_create_missing_queues off): enqueue names it
        queue = given.get("queue")
        return str(getattr(queue, "name", queue) or app.conf.task_default_queue)
    queue = routed.get("queue")
    name = getattr(queue, "name", queue)
    return str(name or app.conf.task_default_queue)


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def celery_time_fields(
    app: Celery, task: Task, options: dict[str, Any], settings: Settings
) -> dict[str, int]:
    """``timeout`` and ``grace_period`` from Celery's time limits (per call, task option, then
    ``task_soft_time_limit``/``task_time_limit``): the soft limit (or the hard one) is the
    timeout, hard − soft the grace; a soft limit at or past the hard one is dropped: the hard
    one is the timeout, with no grace (Celery 5.5+ refuses such a task's own limits at the call;
    its prefork pool on an event loop, given such a call's or app's limits, arms the hard limit
    only once the soft one fired, so it sends that late soft limit and kills the task just after
    it: OJS keeps the hard one, as billiard's own timeout thread does). No limit at all:
    ``settings.default_timeout`` (the worker warns at start for such tasks, see
    :func:`tasks_without_limit`)."""
    soft = _time_limit(app, task, options, "soft_time_limit")
    hard = _time_limit(app, task, options, "time_limit")
    if soft is not None and (hard is None or float(soft) < float(hard)):
        timeout = max(math.ceil(float(soft)), 1)
        if hard is None:
            return {"timeout": timeout}
        return {"timeout": timeout, "grace_period": max(math.ceil(float(hard)) - timeout, 0)}
    if hard is not None:
        return {"timeout": max(math.ceil(float(hard)), 1), "grace_period": 0}
    return {"timeout": settings.default_timeout}


def _time_limit(app: Celery, task: Task, options: dict[str, Any], name: str) -> Any:
    """Celery's ``name`` limit of a call: the call's, else the task's, else the app's setting
    (``task_<name>``), which is read only when needed (a settings lookup costs a few µs)."""
    given = _first(options.get(name), getattr(task, name))
    return given if given is not None else compat.celery_setting(app, f"task_{name}")


def celery_expires_at(task: Task, options: dict[str, Any], now: float) -> str | None:
    """Celery's ``expires`` (per call or task option; seconds, a datetime or ISO 8601 text, as
    Celery takes it) as the job's ``expires_at``: checked at every start, retries included;
    never given to Celery."""
    expires = _first(options.get("expires"), getattr(task, "expires", None))
    if expires is None:
        return None
    if isinstance(expires, (date, str)):  # a datetime is a date
        return format_timestamp(celery_datetime(expires, "expires"))
    return format_epoch(now + float(expires))


def celery_semantics_of(task: Task, settings: Settings) -> dict[str, Any] | None:
    """The Celery semantics a Celery caller's job keeps (written into its record), or None
    when the task (``ojs_semantics = True``) or the settings (``celery_callers: "ojs"``)
    choose the OJS policy."""
    chosen = getattr(task, "ojs_semantics", None)
    ojs = settings.celery_callers == "ojs" if chosen is None else bool(chosen)
    if ojs:
        return None
    max_retries = task.max_retries
    return {
        "max_retries": None if max_retries is None else int(max_retries),
        "default_retry_delay": float(task.default_retry_delay or 0),
    }


def tasks_without_limit(app: Celery, *, ojs_only: bool = True) -> list[str]:
    """OJS tasks that have no Celery time limit (no task option, no ``task_time_limit``/
    ``task_soft_time_limit``): their Celery callers' jobs get ``default_timeout``.
    ``ojs_only=False``: every task, those not migrated yet too (the migration report)."""
    if _first(app.conf.task_soft_time_limit, app.conf.task_time_limit) is not None:
        return []
    return sorted(
        str(name) for name, task in app.tasks.items()
        if (not ojs_only or getattr(task, "__ojs_task__", False))
        and _first(task.soft_time_limit, task.time_limit) is None
    )


_warned: set[str] = set()


def warn_default_timeouts(sender: Any = None, **_: Any) -> None:
    """When a worker is ready, say loudly which OJS tasks run their Celery callers' jobs under
    the OJS default timeout because they have no Celery time limit (once per task name).

    ``worker_ready``, not ``worker_init``: before the pool has forked, nothing may touch the
    app's tasks or its OJS runtime (the prefork children would inherit what that opens); the
    setting is read from the configuration as it is. Connected by ``install``."""
    app = getattr(sender, "app", None)
    if app is None or not hasattr(app, "_ojs_runtime"):
        return
    raw = raw_settings(app.conf) or {}
    timeout = raw.get("default_timeout", Settings.model_fields["default_timeout"].default)
    for name in tasks_without_limit(app):
        if name in _warned:
            continue
        _warned.add(name)
        logger.warning(
            "ojs_celery: task %s has no time limit (time_limit/soft_time_limit or "
            "task_time_limit): jobs from its Celery callers get the OJS default timeout of "
            "%ss (setting default_timeout); set a time limit to choose another", name, timeout)
