"""What one attempt of a handler came to, as a type.

:func:`run_handler` is the one place where a handler's return value or exception becomes an
:data:`Outcome`; :meth:`ojs_celery.task.OJSTask._record_outcome` is the one place that maps an
outcome to its store write and to what Celery is told. Celery's own control-flow exceptions
(``Ignore``, ``Reject``, ``Retry`` and ``self.retry()``) and billiard's soft time limit each
have their own outcome, so that none of them is mistaken for a handler error.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

from billiard.exceptions import SoftTimeLimitExceeded
from celery.exceptions import Ignore, Reject, Retry
from kombu.utils.json import dumps as kombu_dumps

from . import lifecycle
from .envelope import JsonValue, utf8_safe


class JobError(Exception):
    """Raise from a handler to fail the attempt with your own OJS error ``type``.

    ``retryable=False`` discards the job at once, whatever the retry policy says.
    """

    def __init__(self, message: str, type: str = "error", retryable: bool = True) -> None:
        super().__init__(message)
        self.type = type
        self.retryable = retryable


class RetryRequested(Exception):
    """``self.retry()`` inside an OJS task: an OJS failure with an optional delay, and the
    ``args``/``kwargs`` the next attempt runs with when the handler replaced them."""

    def __init__(
        self,
        exc: BaseException | None,
        delay: float | None,
        args: list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        when: Any = None,
    ) -> None:
        super().__init__(said(exc) if exc else "retry requested by the handler")
        self.exc = exc
        self.delay = delay
        self.args_ = args
        self.kwargs_ = kwargs
        #: What Celery's ``Retry`` says the retry is: the countdown (seconds) or the eta.
        self.when = when

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.exc, self.delay, self.args_, self.kwargs_, self.when),
                self.__dict__)


#: A ``self.retry(throw=False)`` of the running handler: Celery sends the retry and lets the
#: handler go on; here the attempt fails with it when the handler returns.
pending_retry: ContextVar[RetryRequested | None] = ContextVar("ojs_pending_retry", default=None)


#: OJS's bounds on an error's backtrace ("SHOULD be <= 50 frames and <= 10,000 chars"); the
#: message gets the same length bound, so that one huge exception text cannot bloat the job,
#: its history and its events.
MAX_FRAMES = 50
MAX_ERROR_CHARS = 10_000


def error_from_exception(exc: BaseException) -> dict[str, JsonValue]:
    """The OJS error object: ``type`` is the class name unless the handler chose one. Any
    exception makes one: text JSON cannot hold (a lone surrogate) is escaped, an exception whose
    ``str()`` fails is named by its class, and the text is cut to OJS's bounds."""
    type_ = exc.type if isinstance(exc, JobError) else type(exc).__name__
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)[-MAX_FRAMES:]
    backtrace: list[JsonValue] = []
    room = MAX_ERROR_CHARS
    for line in reversed(frames):  # the innermost frames and the exception line matter most
        text = _shortened(utf8_safe(line.rstrip("\n")), room)
        if not text:
            break
        backtrace.insert(0, text)
        room -= len(text)
    return lifecycle.make_error(_shortened(utf8_safe(type_), 200), said(exc),
                                backtrace=backtrace)


def said(exc: BaseException) -> str:
    """What an exception says, as an error message can hold it (see error_from_exception)."""
    try:
        text = str(exc)
    except Exception:  # a __str__ that raises: the class still names what happened
        text = f"{type(exc).__name__} (its message could not be read)"
    return _shortened(utf8_safe(text), MAX_ERROR_CHARS) or type(exc).__name__


def _shortened(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[: max(limit - 1, 0)] + "…" if limit > 0 else ""


@dataclass(frozen=True)
class Completed:
    """The handler returned ``value``: JSON data, or a value Celery's JSON serializer carries
    as a typed one (see :func:`typed_result`), whose JSON is ``typed``."""

    value: Any
    typed: Any = None

    @property
    def result(self) -> Any:
        """The job's result as its record keeps it (JSON data)."""
        return self.value if self.typed is None else self.typed


@dataclass(frozen=True)
class Failed:
    """The handler raised ``exc``; ``retryable=False`` (a :class:`JobError` asking for it)
    discards the job whatever the retry policy says."""

    exc: BaseException
    retryable: bool = True


@dataclass(frozen=True)
class TimedOut:
    """The soft time limit's ``SoftTimeLimitExceeded`` escaped the handler."""

    exc: BaseException


@dataclass(frozen=True)
class Retried:
    """``self.retry()``, ``autoretry_for`` or a ``Retry`` raised by hand: fail this attempt,
    with ``delay`` seconds instead of the backoff when the handler chose one."""

    cause: BaseException | None
    delay: float | None
    args: list[Any] | None = None
    kwargs: dict[str, Any] | None = None
    #: As :attr:`RetryRequested.when` (None: the retry policy's backoff decides).
    when: Any = None


@dataclass(frozen=True)
class Cancelled:
    """The handler raised Celery's ``Ignore``: the job is cancelled by its own attempt."""


@dataclass(frozen=True)
class Rejected:
    """The handler raised Celery's ``Reject``: discarded, or retried per policy when it asked
    for a requeue (never requeued as it is: the message's token is spent)."""

    exc: Reject


Outcome: TypeAlias = Completed | Failed | TimedOut | Retried | Cancelled | Rejected


#: One encoder for every result (``json.dumps`` with an option builds a new one per call).
#: Not ASCII-only, so that what the store writes, UTF-8, is what is checked.
_STRICT_JSON = json.JSONEncoder(allow_nan=False, ensure_ascii=False)


def run_handler(call: Callable[[], Any]) -> Outcome:
    """Run the handler and say what it came to; a result that is not JSON data fails it."""
    reset = pending_retry.set(None)
    try:
        value = call()
        requested = pending_retry.get()
        if requested is not None:  # self.retry(throw=False), then the handler returned
            raise requested
    except SoftTimeLimitExceeded as exc:
        return TimedOut(exc)
    except RetryRequested as exc:
        return Retried(exc.exc, exc.delay, exc.args_, exc.kwargs_, exc.when)
    except Ignore:
        return Cancelled()
    except Reject as exc:
        return Rejected(exc)
    except Retry as exc:  # raised by hand, not through self.retry()
        return Retried(exc.exc, None)
    except Exception as exc:
        return Failed(exc, exc.retryable if isinstance(exc, JobError) else True)
    finally:
        pending_retry.reset(reset)
    problem = _json_problem(value)
    if problem is None:
        return Completed(value)
    typed = typed_result(value)
    return Failed(problem) if typed is None else Completed(value, typed)


def result_problem(value: Any) -> TypeError | None:
    """Why a handler's return value cannot be its job's result (neither JSON data nor a typed
    value of Celery's JSON serializer, see :func:`typed_result`); None: it can."""
    problem = _json_problem(value)
    return None if problem is None or typed_result(value) is not None else problem


def typed_result(value: Any) -> Any:
    """``value`` as Celery's JSON serializer writes what JSON has no type for (a ``datetime``,
    ``date``, ``time``, ``Decimal``, ``UUID``, ``bytes``: ``{"__type__": "datetime",
    "__value__": "2030-01-01T00:00:00"}``), which kombu reads back as that value: a plain
    Celery task may return one, and its caller's ``AsyncResult`` gets it back. None for
    what that serializer cannot write either (a ``set``, any object)."""
    try:
        typed = json.loads(kombu_dumps(value))  # type: ignore[no-untyped-call]
    except Exception:
        return None
    return typed if _json_problem(typed) is None else None


def _json_problem(value: Any) -> TypeError | None:
    """Why ``value`` is not JSON data (NaN and infinities are not JSON either; text with a
    lone surrogate, such as ``os.fsdecode`` makes of a file name that is not UTF-8, cannot be
    written as the UTF-8 the store keeps); None: it is."""
    try:
        text = _STRICT_JSON.encode(value)
    except (TypeError, ValueError) as bad:
        return TypeError(f"result is not JSON-serialisable: {bad}")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as bad:
            return TypeError("result is not JSON-serialisable: text must be Unicode that UTF-8 "
                             f"can encode (no lone surrogates such as \\ud800): {bad}")
    return None


def celery_exception(outcome: Outcome) -> BaseException | None:
    """The exception Celery learns of for a failed attempt (its ``Retry``'s cause, or what
    ends the task when the job is discarded); None where the handler raised none of its own."""
    if isinstance(outcome, (Failed, TimedOut)):
        return outcome.exc
    if isinstance(outcome, Retried):
        return outcome.cause
    if isinstance(outcome, Rejected):
        return cast(BaseException, outcome.exc)
    return None
