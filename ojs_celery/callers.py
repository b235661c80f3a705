"""Celery callers: a call through Celery's own API becomes an OJS job, the same way whichever
entry point it took.

``OJSTask.apply_async`` (``.delay()``, signatures, canvas, beat with the task registered) and
``app.send_task`` by name (beat or django-celery-beat without the task module, producers that
only know the name) both build the job with :func:`enqueue_call`: Celery's routing, time limits,
``expires`` and priority become the job's fields, the job keeps the task's Celery semantics, and
it is stored (with its outbox entry) before its message is published, like any OJS job (or
with its message in one step when the store is the broker's Redis: :mod:`ojs_celery.joint`).

``send_task`` is wrapped per app by :func:`wrap_send_task` (``install``). It takes over only a
call by name for a task that the calling app registers as an OJS task and whose message has no
``ojs`` header: the OJS producer's own publishes carry the header, and ``Task.apply_async``
(plain Celery tasks, and the plain re-publish of a message sent before ``install``, see
``task._plain_republish``) passes ``task_type``. A name the calling app does not register cannot
be known to be an OJS task there: it is published as Celery would, and runs as a plain message
(README, the switch-over).
"""

from __future__ import annotations

import functools
import time
from typing import Any, NoReturn

from celery import Celery, Task
from celery.backends.rpc import RPCBackend
from celery.result import AsyncResult
from kombu import serialization
from kombu.exceptions import EncodeError

from . import compat, header
from .api import enqueue_job
from .canvas import canvas_options
from .envelope import (
    ARGUMENT_RULES,
    CELERY_KWARGS_FIELD,
    CELERY_SEMANTICS_FIELD,
    InvalidJob,
    Job,
    json_native,
    parse_input,
    typed_leaves,
)
from .producer import (
    TRUSTED_OPTIONS,
    celery_expires_at,
    celery_route,
    celery_semantics_of,
    celery_time_fields,
    ojs_priority_of,
    ojs_queue_of,
    scheduled_at_from,
)
from .runtime import get_runtime

#: ``app.send_task``'s parameters after ``kwargs``, in order (for positional calls).
_SEND_TASK_POSITIONAL = ("countdown", "eta", "task_id", "producer", "connection", "router",
                         "result_cls", "expires")


def enqueue_call(task: Task, args: Any, kwargs: Any, options: dict[str, Any]) -> str:
    """Store and publish the OJS job of a Celery call of ``task`` (``apply_async``'s
    ``options``); returns the job id. Celery's routing, time limits and ``expires`` become the
    job's queue, ``timeout``/``grace_period`` and ``expires_at``, and the job keeps Celery's
    retry semantics (README, "Celery callers") unless the task or the settings choose OJS
    semantics."""
    runtime = get_runtime(task.app)
    envelope = call_arguments(task, args, kwargs)
    if options.get("task_id"):
        envelope["id"] = options["task_id"]
    envelope["queue"] = ojs_queue_of(
        task.app, celery_route(task.app, task, args, kwargs, options))
    when = scheduled_at_from(options.get("eta"), options.get("countdown"))
    if when is not None:
        envelope["scheduled_at"] = when.isoformat()
    envelope.update(celery_time_fields(task.app, task, options, runtime.settings))
    parent = task.app.current_worker_task
    priority = options.get("priority", task.priority)
    if priority is None and parent is not None and task.app.conf.task_inherit_parent_priority:
        # as Celery's send_task gives a call made inside a running task that task's priority;
        # kept with the job, every message of it has it (the sweeper's too)
        priority = (getattr(parent.request, "delivery_info", None) or {}).get("priority")
    if isinstance(priority, int) and not isinstance(priority, bool):
        mapped = ojs_priority_of(task.app, priority, runtime.settings.amqp_max_priority)
        if mapped is not None:
            envelope["priority"] = mapped
    expires_at = celery_expires_at(task, options, time.time())
    if expires_at is not None:
        envelope["expires_at"] = expires_at
    if options.get("reply_to") is None and isinstance(task.backend, RPCBackend):
        # Celery's send_task gives the calling thread's queue; every attempt's message must
        # carry it (a retry is published by a worker, whose own queue it would get)
        options = {**options, "reply_to": task.app.thread_oid}
    try:  # a try, not a context manager: free on the caller's path unless it raises
        job = parse_input(envelope, celery_id=True)
    except InvalidJob as refused:  # a datetime, a Decimal, ...: see typed_call
        job = typed_call(task.app, envelope, refused)
    try:
        check_later_calls(task.app, options)
        celery_options = canvas_options(with_parent(parent, options))
    except InvalidJob as refused:
        raise_refusal(refused)
    semantics = celery_semantics_of(task, runtime.settings)
    if semantics is not None:
        job = job.model_copy(update={CELERY_SEMANTICS_FIELD: semantics})
    job = enqueue_job(runtime, job, id_chosen="id" in envelope, celery_options=celery_options)
    return job.id


def with_parent(parent: Task | None, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the ``parent_id`` and ``root_id`` that Celery's ``send_task`` gives a
    call made inside a running task, ``parent`` (``app.current_worker_task``: that task, and
    its root), where the call gives none. Kept with the job, every attempt's message carries
    them, as Celery's retry keeps its request's; a retry published from the job's own attempt
    would otherwise name that attempt as its parent."""
    request = getattr(parent, "request", None)
    if request is None or request.id is None:
        return options
    inherited = {"parent_id": request.id, "root_id": request.root_id or request.id}
    return {**options, **{name: value for name, value in inherited.items()
                          if options.get(name) is None}}


def call_arguments(task: Task, args: Any, kwargs: Any) -> dict[str, Any]:
    """The envelope fields of a Celery call's type and arguments (kwargs travel in
    ``x_celery_kwargs``); :func:`~ojs_celery.envelope.parse_input` names what JSON cannot
    carry."""
    envelope: dict[str, Any] = {"type": task.ojs_type or task.name,
                                "args": json_native(list(args or ()))}
    if kwargs:
        envelope["x_celery_kwargs"] = json_native(dict(kwargs))
    return envelope


class UnencodableArguments(InvalidJob, EncodeError):
    """The :class:`~ojs_celery.InvalidJob` of a call whose arguments (or kept options: its
    headers, its callbacks' arguments) JSON cannot carry; also kombu's ``EncodeError``, which
    plain Celery's ``.delay()`` raises for what its serializer cannot encode, so that a
    caller's ``except EncodeError`` still catches it."""


#: The envelope fields that hold a Celery call's arguments, and the options kept with its job.
ARGUMENT_FIELDS = ("args", "x_celery_kwargs", *TRUSTED_OPTIONS)


def raise_refusal(refused: InvalidJob) -> NoReturn:
    """Raise ``refused``; as :class:`UnencodableArguments` when it names a call's arguments or
    kept options (what Celery's serializer would have failed on)."""
    if isinstance(refused, UnencodableArguments) or not any(
            path.startswith(ARGUMENT_FIELDS) for path, _ in refused.violations):
        raise refused
    raise UnencodableArguments(refused.violations) from refused


def check_call_arguments(task: Task, args: Any, kwargs: Any) -> dict[str, Any]:
    """Raise :class:`~ojs_celery.InvalidJob` naming what JSON cannot carry in a call's (or a
    retry's) arguments: the job's record and its messages hold them as JSON. Returns them as
    the job keeps them: ``args``, and ``x_celery_kwargs`` when there are any (typed values as
    kombu's typed JSON, see :func:`typed_call`)."""
    envelope = call_arguments(task, args, kwargs)
    try:
        parse_input(envelope, celery_id=True)
    except InvalidJob as refused:
        envelope, _ = typed_job(task.app, envelope, refused)
    return envelope


#: The envelope fields of a Celery call's arguments.
_ARGUMENTS = ("args", CELERY_KWARGS_FIELD)


def typed_call(app: Celery, envelope: dict[str, Any], refused: InvalidJob) -> Job:
    """The job of a Celery call that ``refused`` says JSON cannot carry: its arguments hold
    values that Celery's JSON serializer sends as typed values (a ``datetime``, ``date``,
    ``time``, ``Decimal``, ``UUID``, ``bytes``, nested too), which the handler gets back as
    those values, as in plain Celery. The job keeps them as that serializer's JSON, as a result
    is kept (``{"__type__": "datetime", "__value__": "..."}``), and its messages carry them
    so. Anything else raises, as :func:`raise_refusal` does. Only on the path of such calls:
    a call of JSON data never gets here."""
    try:
        return typed_job(app, envelope, refused)[1]
    except InvalidJob as exc:
        raise_refusal(exc)


def typed_job(app: Celery, envelope: dict[str, Any],
              refused: InvalidJob) -> tuple[dict[str, Any], Job]:
    """``envelope`` with its typed arguments written as the job keeps them
    (:func:`typed_arguments`), and its job; raises :class:`~ojs_celery.InvalidJob` for what it
    still breaks, or what the app's serializer cannot encode (:func:`refuse_unserializable`).
    The one check of a call's (:func:`typed_call`) and a retry's (:func:`check_call_arguments`)
    typed arguments."""
    typed = typed_arguments(envelope, refused)
    job = parse_input(typed, celery_id=True, typed=True)
    refuse_unserializable(app, envelope.get("args"), envelope.get(CELERY_KWARGS_FIELD))
    return typed, job


def typed_arguments(envelope: dict[str, Any], refused: InvalidJob) -> dict[str, Any]:
    """``envelope`` with its arguments as Celery's JSON serializer writes them (typed values
    as kombu's typed JSON; what it cannot write either, a ``set`` or an object, left for the
    envelope's rules to name where it is: kombu's ``EncodeError`` in plain Celery). Raises
    ``refused`` when no argument is named in it, and :class:`~ojs_celery.InvalidJob` naming
    the rest of it when an argument breaks a rule of its whole value that no typed value
    mends (nesting, numbers, text, and an object with exactly the keys ``__type__`` and
    ``__value__``: data that would reach the handler as something else)."""
    if not any(path.startswith(_ARGUMENTS) for path, _ in refused.violations):
        raise refused
    if any(path in _ARGUMENTS and rule in ARGUMENT_RULES for path, rule in refused.violations):
        # what the envelope's rules say of a value inside these fields (a datetime's "not a
        # valid JSON value") may be wrong: only their whole-value rules, and the other fields
        raise InvalidJob([(path, rule) for path, rule in refused.violations
                          if (path in _ARGUMENTS and rule in ARGUMENT_RULES)
                          or not path.startswith(_ARGUMENTS)])
    typed = dict(envelope)
    for name in _ARGUMENTS:
        if name in envelope:
            typed[name] = typed_leaves(envelope[name])
    return typed


def refuse_unserializable(app: Celery, args: Any, kwargs: Any) -> None:
    """Raise :class:`UnencodableArguments` when the app's ``task_serializer`` is not JSON and
    cannot encode a call's typed values (``msgpack`` has no ``datetime``): its messages would
    fail after the job is stored, where plain Celery's call raises kombu's ``EncodeError``."""
    serializer = compat.celery_setting(app, "task_serializer")
    if serializer == "json":
        return
    try:
        body: tuple[Any, ...] = (args or [], kwargs or {}, {})
        serialization.dumps(body, serializer=serializer)  # type: ignore[no-untyped-call]
    except EncodeError as exc:
        raise UnencodableArguments([("args", f"must be data the task_serializer {serializer!r} "
                                     f"can encode ({exc})")]) from None


#: The options of a call that hold the calls made after it: its callbacks and the rest of its
#: chain (each a signature, or a list of them).
LATER_CALLS = ("link", "link_error", "chain")


def check_later_calls(app: Celery, options: dict[str, Any]) -> None:
    """Raise :class:`~ojs_celery.InvalidJob` at the call when a callback or a later link of
    the chain is an OJS task whose own arguments JSON cannot carry (``link[0].args[0]``;
    ``chain`` lists the links last first, as Celery keeps them): it is published by the worker
    once this job completes, where the failure would leave the job completed in the store and
    FAILURE in the result backend, its callback never run. The rest of a chain that a worker
    publishes (its ``parent_id`` set) was checked at the chain's first call."""
    violations: list[tuple[str, str]] = []
    for option in LATER_CALLS:
        calls = options.get(option)
        if calls is None or (option == "chain" and options.get("parent_id")):
            continue
        for index, call in enumerate(calls if isinstance(calls, (list, tuple)) else [calls]):
            name = call.get("task") if isinstance(call, dict) else None
            later = _ojs_task_named(app, name) if isinstance(name, str) else None
            if later is None:
                continue
            try:
                check_call_arguments(later, call.get("args"), call.get("kwargs"))
            except InvalidJob as exc:
                violations += [(f"{option}[{index}].{path}", rule)
                               for path, rule in exc.violations]
    if violations:
        raise InvalidJob(violations)


def wrap_send_task(app: Celery) -> None:
    """Make ``app.send_task`` of an OJS task by name an OJS job (idempotent; see the module
    docstring for which calls it takes over)."""
    original = app.send_task
    if getattr(original, "__ojs_send_task__", False):
        return

    @functools.wraps(original)
    def send_task(name: str, args: Any = None, kwargs: Any = None, *more: Any,
                  **options: Any) -> AsyncResult:
        task = _ojs_task_named(app, name)
        if (task is None or options.get("task_type") is not None
                or header.NAME in (options.get("headers") or {})):
            return original(name, args, kwargs, *more, **options)
        options.update(zip(_SEND_TASK_POSITIONAL, more, strict=False))
        result_cls = options.get("result_cls") or app.AsyncResult
        result: AsyncResult = result_cls(enqueue_call(task, args, kwargs, options))
        result.ignored = options.get("ignore_result", task.ignore_result)
        return result

    send_task.__ojs_send_task__ = True  # type: ignore[attr-defined]
    app.send_task = send_task


def _ojs_task_named(app: Celery, name: str) -> Task | None:
    """The OJS task registered as ``name`` in ``app``. An app that may finalize itself does
    (its ``@app.task`` definitions are pending until then, as any enqueue would); one with
    ``autofinalize`` off is read as it is, as Celery's ``send_task`` reads it. A name not
    registered is looked for again once the app's task modules are imported (once per
    process, :meth:`~ojs_celery.runtime.Runtime.import_task_modules`): a producer that
    imported none of them would otherwise send a plain Celery message for an OJS task."""
    registry = app.tasks if app.autofinalize else app._tasks
    task = registry.get(name)
    if task is None:
        get_runtime(app).import_task_modules()
        task = registry.get(name)
    return task if getattr(task, "__ojs_task__", False) else None
