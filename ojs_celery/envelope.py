"""The OJS job envelope: pydantic models, validation and (de)serialisation.

One model, :class:`Job`, carries both the client-settable attributes of the OJS envelope (with the
timeouts extension's fields) and the system-managed ones (state, attempt, timestamps, errors,
result). Client input goes through :func:`parse_envelope`, which ignores system fields, fills the
defaults and turns every violation into one :class:`InvalidJob` that names each field path.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Annotated, Any, Final, Literal

from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads
from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic import JsonValue as JsonValue  # explicit re-export: the package's JSON type
from pydantic_core import PydanticSerializationError, to_jsonable_python

from .entropy import random_hex

SPEC_VERSION: Final = "1.0"
MAX_ENVELOPE_BYTES = 1024 * 1024
#: A batch: at most this many envelopes (the OJS batch schema's ``maxItems``) and, given as
#: text, this many bytes (what a producer can make a process hold before any check).
MAX_BATCH_JOBS = 10_000
MAX_BATCH_BYTES = 32 * 1024 * 1024
#: OJS core says ``[a-z][a-z0-9_]*`` segments; real producers (the conformance cases,
#: ``openapi.yaml``) also send hyphens and upper-case letters, and Celery task names may hold
#: ``:`` (``proj.tasks:send_mail``): all accepted, verbatim (README, decisions).
TYPE_PATTERN = r"^[A-Za-z][A-Za-z0-9_:\-]*(\.[A-Za-z][A-Za-z0-9_:\-]*)*$"
#: OJS core says ``[a-z0-9][a-z0-9.-]*``; any Celery queue name (``_``, ``:``, upper case)
#: is accepted verbatim, so that a routed Celery queue is the job's queue (README, decisions).
QUEUE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_:.\-]*$"
UUID7_PATTERN = re.compile(
    r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$"
)
#: The task ids a Celery caller may give (canvas assigns UUIDv4s; ``task_id=`` may be any
#: word): lower-case, no spaces or separators a store key or an event subject would mind.
CELERY_ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._:@+=~-]{0,254}$")
_UUID_ANY = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_DURATION = re.compile(
    r"^P(?!$)(?:(?P<y>\d+)Y)?(?:(?P<mo>\d+)M)?(?:(?P<w>\d+)W)?(?:(?P<d>\d+)D)?"
    r"(?:T(?=\d)(?:(?P<h>\d+)H)?(?:(?P<mi>\d+)M)?(?:(?P<s>\d+(?:\.\d+)?)S)?)?$"
)

#: Fields the system manages: a client's values for them are ignored (OJS core).
SYSTEM_FIELDS = frozenset(
    {
        "state",
        "attempt",
        "created_at",
        "enqueued_at",
        "started_at",
        "completed_at",
        "cancelled_at",
        "discarded_at",
        "next_retry_at",
        "error",
        "errors",
        "result",
        "last_checkpoint",
        "progress",
    }
)

#: This adapter's namespace of extension fields. Of it, an envelope may set only
#: ``x_celery_kwargs`` (Celery keyword arguments, a JSON object): callbacks, routing and other
#: Celery options come from trusted Python code only (see :data:`CELERY_OPTIONS_FIELD`).
CELERY_NAMESPACE: Final = "x_celery_"
CELERY_KWARGS_FIELD: Final = "x_celery_kwargs"
#: Where the Celery options given by Python code (``.apply_async(link=...)``) are kept with
#: the stored job, so that every attempt (a retry the sweeper publishes too) carries them.
#: :func:`parse_envelope` refuses it: no envelope can set it.
CELERY_OPTIONS_FIELD: Final = "x_celery_options"
#: The marker of a job created by a Celery caller that keeps Celery's semantics (its
#: ``max_retries`` and ``default_retry_delay``): see :mod:`ojs_celery.lifecycle.rules`'s
#: ``decide``. Refused from an envelope, like every ``x_celery_*`` field but the kwargs.
CELERY_SEMANTICS_FIELD: Final = "x_celery_semantics"
#: What the error history's dropped entries counted (see ``ERRORS_KEPT`` in
#: :mod:`ojs_celery.lifecycle.rules`). Refused from an envelope, like the other fields above.
ERRORS_DROPPED_FIELD: Final = "x_celery_errors_dropped"


_SYSTEM_FIELD_SET: set[str] = set(SYSTEM_FIELDS)
#: What a job's record holds that its envelope did not ask for (see ``Job.same_request``).
_NOT_REQUESTED: set[str] = _SYSTEM_FIELD_SET | {ERRORS_DROPPED_FIELD}

State = Literal[
    "scheduled",
    "available",
    "pending",
    "active",
    "completed",
    "retryable",
    "cancelled",
    "discarded",
]


class InvalidJob(ValueError):
    """An envelope broke one or more rules; ``violations`` holds ``(field path, rule)`` pairs."""

    def __init__(self, violations: Sequence[Sequence[str]]) -> None:
        self.violations = [(str(path), str(rule)) for path, rule in violations]
        # Its arguments are what rebuilds it, not its message: raised in a prefork child, it
        # must unpickle in the worker's main process (billiard sends it there, or the worker
        # stops consuming), and Celery's JSON result serializer rebuilds a task's exception
        # from its args (JSON turns the pairs into lists, taken back as pairs above).
        super().__init__(self.violations)

    def __str__(self) -> str:
        lines = "\n".join(f"  {path}: {rule}" for path, rule in self.violations)
        return f"invalid OJS job ({len(self.violations)} violation(s)):\n{lines}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self.args, self.__dict__)


class DuplicateJob(InvalidJob):
    """A job with this client-chosen id exists with a different envelope (a conflict).

    Enqueueing the same envelope with the same id again returns the existing job instead
    (enqueue is idempotent: a retry after a lost reply is safe). A subclass of
    :class:`InvalidJob` naming the ``id`` field, so that ``except InvalidJob`` still catches
    every rejected input; the CLI gives it an exit status of its own.
    """

    def __init__(self, job_id: str, path: str = "id") -> None:
        super().__init__([(path, f"a different job with id {job_id} exists already")])
        self.job_id = job_id
        self.args = (job_id, path)  # what rebuilds it (see InvalidJob)


#: A UUIDv7's variant digit (0b10 then two random bits) for a random hex digit.
_UUID7_VARIANT: Final = {digit: "89ab"[index % 4] for index, digit in enumerate("0123456789abcdef")}


def could_be_job_id(text: str) -> bool:
    """Whether ``text`` (any case) has the form of a job id: a UUID or a Celery task id. Other
    text names no job, and is not sent to a store (whose driver may not even encode it)."""
    return CELERY_ID_PATTERN.fullmatch(text.lower()) is not None


def new_job_id() -> str:
    """A fresh lowercase UUIDv7 (time-ordered, as OJS recommends): RFC 9562's 48-bit Unix
    milliseconds, then random bits. Made here because it is on every job's and every event's
    path and the ``uuid`` module has no version 7 before Python 3.14. Built as text: the
    version digit 7, 74 random bits from 19 random hex digits (one of them, two bits of it,
    in the variant digit), about half the cost of the same UUID made as an integer."""
    stamp = f"{time.time_ns() // 1_000_000:012x}"
    bits = random_hex(19)
    return f"{stamp[:8]}-{stamp[8:]}-7{bits[:3]}-{_UUID7_VARIANT[bits[3]]}{bits[4:7]}-{bits[7:]}"


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def from_epoch(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, timezone.utc)


def format_timestamp(value: datetime) -> str:
    """RFC 3339 as pydantic writes a job's timestamps (microseconds unless zero, UTC as ``Z``,
    other offsets kept), so that events and errors quote a job's times as its JSON does."""
    text = value.isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


#: The last whole second :func:`format_epoch` formatted, and its text up to the seconds.
_last_second: tuple[int, str] = (-1, "")


def format_epoch(seconds: float) -> str:
    """``format_timestamp(from_epoch(seconds))``, the same text (microseconds rounded half to
    even as ``datetime`` rounds them, none when zero), without a ``datetime`` per call: every
    event's time is one, and the date and time up to the second are formatted once a second."""
    global _last_second
    whole = math.floor(seconds)
    micro = round((seconds - whole) * 1e6)
    if micro >= 1_000_000:
        whole, micro = whole + 1, micro - 1_000_000
    cached, prefix = _last_second
    if cached != whole:
        t = time.gmtime(whole)
        prefix = (f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}"
                  f"T{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}")
        _last_second = (whole, prefix)
    return f"{prefix}.{micro:06d}Z" if micro else prefix + "Z"


@functools.lru_cache(maxsize=256)
def parse_duration(text: str) -> float:
    """Seconds in an ISO 8601 duration (``PT1S``, ``PT5M``, ``P1DT2H``).

    Years count 365 days and months 30. Cached: every decoded job validates its retry
    intervals again, and a deployment uses a handful of distinct durations.
    """
    match = _DURATION.fullmatch(text)
    if match is None:
        raise ValueError(f"must be an ISO 8601 duration such as PT1S or PT5M, got {text!r}")
    parts = {k: float(v) if v else 0.0 for k, v in match.groupdict().items()}
    days = parts["y"] * 365 + parts["mo"] * 30 + parts["w"] * 7 + parts["d"]
    return days * 86400 + parts["h"] * 3600 + parts["mi"] * 60 + parts["s"]


def _duration(text: str) -> str:
    parse_duration(text)
    return text


#: An RFC 3339 timestamp (its ``date-time``): a full date, ``T`` (or a space, which RFC 3339
#: allows for readability), the time with its seconds, a fraction after a ``.``, then ``Z`` or
#: ``±hh:mm``. What ISO 8601 and pydantic's parser also take (no seconds, ``,5``, ``+0100``,
#: ``+01``) is refused: a producer in another language must write what every OJS reader reads.
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?"
                      r"(?P<zone>[Zz]|[+-]\d{2}:\d{2})?")
_RFC3339_RULE = ("must be an RFC 3339 timestamp string with a time zone "
                 "(YYYY-MM-DDThh:mm:ss[.fraction] then Z or ±hh:mm)")
#: A leap second (``23:59:60Z``): the minute, then what follows the seconds.
_LEAP_SECOND = re.compile(r"(?P<minute>\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}):60(?P<rest>(\.\d+)?\S*)")

Duration = Annotated[str, Field(json_schema_extra={"format": "duration"})]

#: The longest duration an envelope may ask for (timeouts, TTLs, retry intervals), in seconds: a
#: hundred years. A longer one is no real request, and its deadlines would overflow the clocks
#: (past the year 9999, or beyond a float). Checked on input only (:func:`parse_envelope`): a
#: stored record is read back as it was written, and its decoding pays nothing for the check.
MAX_DURATION = 100 * 365 * 24 * 3600
_TOO_LONG = f"must be at most {MAX_DURATION} seconds (a hundred years)"
_SECONDS_FIELDS = ("timeout", "visibility_timeout", "total_timeout", "enqueue_ttl", "grace_period",
                   "heartbeat_timeout")


def _too_long(job: Job) -> list[tuple[str, str]]:
    """The durations of a valid ``job`` beyond :data:`MAX_DURATION`, as violations."""
    found = [(name, _TOO_LONG) for name in _SECONDS_FIELDS
             if (getattr(job, name) or 0) > MAX_DURATION]
    found += [(f"retry.{name}", _TOO_LONG) for name in ("initial_interval", "max_interval")
              if not parse_duration(getattr(job.retry, name)) <= MAX_DURATION]
    return found
JobType = Annotated[str, StringConstraints(min_length=1, max_length=255, pattern=TYPE_PATTERN)]
QueueName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=QUEUE_PATTERN)]


def _max_below_initial(initial: str) -> str:
    return f"must be greater than or equal to initial_interval ({initial})"


class RetryPolicy(BaseModel):
    """OJS retry policy; partial policies are merged with these defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_attempts: StrictInt = Field(default=3, ge=0)
    initial_interval: Duration = "PT1S"
    backoff_coefficient: StrictFloat = Field(default=2.0, ge=1.0)
    max_interval: Duration = "PT5M"
    jitter: StrictBool = True
    non_retryable_errors: list[Annotated[str, StringConstraints(min_length=1)]] = []
    on_exhaustion: Literal["discard", "dead_letter"] = "discard"

    @field_validator("initial_interval", "max_interval")
    @classmethod
    def _valid_duration(cls, value: str) -> str:
        return _duration(value)

    # Field validators (not a model validator), so that each violation names its field path.
    @field_validator("initial_interval")
    @classmethod
    def _initial_positive(cls, value: str) -> str:
        if parse_duration(value) <= 0:
            raise ValueError("must be greater than zero")
        return value

    @field_validator("max_interval")
    @classmethod
    def _max_not_below_initial(cls, value: str, info: ValidationInfo) -> str:
        initial = info.data.get("initial_interval")
        if initial is not None and parse_duration(value) < parse_duration(initial):
            raise ValueError(_max_below_initial(initial))
        return value

    @field_validator("non_retryable_errors")
    @classmethod
    def _unique_entries(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("must not repeat an entry")
        return value

    def merged_violations(self) -> list[tuple[str, str]]:
        """What is wrong with the policy once merged with the defaults: a field validator does
        not see a default (an ``initial_interval`` over the default ``max_interval`` alone
        would be stored, and no later read would accept the record). Input only."""
        if self.max_seconds >= self.initial_seconds:
            return []
        unless = f"; when not given it is {self.max_interval}"
        return [("retry.max_interval", _max_below_initial(self.initial_interval) + unless)]

    @property
    def initial_seconds(self) -> float:
        return parse_duration(self.initial_interval)

    @property
    def max_seconds(self) -> float:
        return parse_duration(self.max_interval)


class Job(BaseModel):
    """An OJS job: the envelope a producer sent plus the state the system keeps for it.

    Unknown top-level fields (``x_*`` extensions and anything else) are kept and written back.
    """

    # schema is read by its spec name only: an extension named "schema_uri" stays one
    model_config = ConfigDict(extra="allow", validate_assignment=False)

    specversion: Literal["1.0"] = SPEC_VERSION
    id: str = Field(default_factory=new_job_id)
    type: JobType
    queue: QueueName = "default"
    args: list[JsonValue]
    meta: dict[str, JsonValue] | None = None
    priority: StrictInt = Field(default=0, ge=-100, le=100)
    timeout: StrictInt = Field(default=1800, gt=0)
    scheduled_at: AwareDatetime | None = None
    expires_at: AwareDatetime | None = None
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    unique: dict[str, JsonValue] | None = None
    schema_uri: str | None = Field(None, alias="schema")
    visibility_timeout: StrictInt = Field(default=1800, ge=1)
    total_timeout: StrictInt | None = Field(default=None, gt=0)
    enqueue_ttl: StrictInt | None = Field(default=None, gt=0)
    grace_period: StrictInt = Field(default=30, ge=0)
    heartbeat_timeout: StrictInt = Field(default=60, gt=0)

    # System-managed attributes.
    state: State = "available"
    attempt: int = 0
    created_at: AwareDatetime | None = None
    enqueued_at: AwareDatetime | None = None
    started_at: AwareDatetime | None = None
    completed_at: AwareDatetime | None = None
    cancelled_at: AwareDatetime | None = None
    discarded_at: AwareDatetime | None = None
    next_retry_at: AwareDatetime | None = None
    error: dict[str, JsonValue] | None = None
    errors: list[dict[str, JsonValue]] = []
    result: JsonValue = None
    last_checkpoint: JsonValue = None
    progress: dict[str, JsonValue] | None = None

    @field_validator("id", mode="before")
    @classmethod
    def _uuid7(cls, value: Any, info: ValidationInfo) -> Any:
        """A UUIDv7 for an envelope from outside; a Celery caller's task id (see
        :data:`CELERY_ID_PATTERN`) when :func:`parse_input` is told the id came from Celery,
        and when a stored record is read back (no context)."""
        if not isinstance(value, str):
            raise ValueError("must be a string")
        lowered = value.lower()
        if UUID7_PATTERN.fullmatch(lowered):
            return lowered
        celery_id = info.context is None or bool(info.context.get("celery_id"))
        if celery_id and _UUID_ANY.fullmatch(lowered):
            return lowered
        if celery_id and CELERY_ID_PATTERN.fullmatch(value):
            return value
        if celery_id:
            raise ValueError("must be a UUID or up to 255 of a-z 0-9 . _ : @ + = ~ - "
                             "(a Celery task id, lower case)")
        raise ValueError("must be a UUIDv7 (8-4-4-4-12 hex digits, version 7)")

    @field_validator("scheduled_at", "expires_at", mode="wrap")
    @classmethod
    def _rfc3339(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """RFC 3339 text (pydantic alone would also read ``"5"`` as seconds since 1970), with
        a rule that says what is wrong in place of pydantic's parser message."""
        if value is None or isinstance(value, datetime):
            return handler(value)
        form = _RFC3339.fullmatch(value) if isinstance(value, str) else None
        if form is None:
            raise ValueError(_RFC3339_RULE)
        if form["zone"] is None:
            raise ValueError(f"{_RFC3339_RULE}: the time zone is missing")
        leap = _LEAP_SECOND.fullmatch(value) if ":60" in value else None
        try:
            if leap is None:
                return handler(value)
            # RFC 3339 allows second 60 (a leap second); it is read as the next second's
            # start, as POSIX clocks (and so every deadline here) count it
            return handler(leap["minute"] + ":59" + leap["rest"]) + timedelta(seconds=1)
        except OverflowError:  # the leap second after 9999-12-31T23:59:59
            raise ValueError(f"{_RFC3339_RULE}: its date, time or offset is out of range "
                             "(offsets are at most ±23:59)") from None
        except ValidationError as exc:
            if exc.errors()[0]["type"] == "timezone_aware":
                raise ValueError(f"{_RFC3339_RULE}: the time zone is missing") from None
            raise ValueError(f"{_RFC3339_RULE}: its date, time or offset is out of range "
                             "(offsets are at most ±23:59)") from None

    @field_validator("total_timeout")
    @classmethod
    def _total_not_below_timeout(cls, value: int | None, info: ValidationInfo) -> int | None:
        timeout = info.data.get("timeout")
        if value is not None and timeout is not None and value < timeout:
            raise ValueError(f"must be greater than or equal to timeout ({timeout})")
        return value

    @property
    def extensions(self) -> dict[str, Any]:
        """The unknown top-level fields, as sent."""
        return dict(self.model_extra or {})

    @property
    def terminal(self) -> bool:
        return self.state in ("completed", "cancelled", "discarded")

    def same_request(self, other: Job) -> bool:
        """Whether both were enqueued with the same envelope (and the same trusted Celery
        options): every field but the system-managed ones is equal."""
        return _requested(self) == _requested(other)

    def to_dict(self) -> dict[str, Any]:
        """The job as OJS JSON data: absent optional fields are omitted."""
        data = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        if self.result is None and "result" in data:
            del data["result"]
        return data

    def to_json(self) -> str:
        """Compact one-line JSON."""
        return json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False)


#: Kept Celery options that say where a call came from, not what it asks for: the queue the
#: ``rpc://`` backend replies to (the calling thread's) and the task it was called from (its
#: ``parent_id`` and root, which Celery gives a call made inside a task). The same call from
#: another thread, process or task is the same request.
_CALL_CONTEXT = frozenset({"reply_to", "parent_id", "root_id"})


def _requested(job: Job) -> dict[str, Any]:
    """What :meth:`Job.same_request` compares: the job as its producer asked for it, without
    the options of the call's context (:data:`_CALL_CONTEXT`)."""
    data = job.model_dump(mode="json", by_alias=True, exclude=_NOT_REQUESTED)
    options = data.get(CELERY_OPTIONS_FIELD)
    if isinstance(options, dict) and not _CALL_CONTEXT.isdisjoint(options):
        asked = {k: v for k, v in options.items() if k not in _CALL_CONTEXT}
        if asked:
            data[CELERY_OPTIONS_FIELD] = asked
        else:
            del data[CELERY_OPTIONS_FIELD]
    return data


def _path(loc: tuple[int | str, ...], root: str = "") -> str:
    text = root
    for part in loc:
        if isinstance(part, int) or str(part).isdigit():
            text += f"[{part}]"
        else:
            text += ("." if text else "") + str(part)
    return text or "(envelope)"


#: What a field's pattern asks, in words: the rule an envelope's error and a setting's name.
PATTERN_RULES = {
    "type": "must be dot-separated segments, each a letter then letters, digits, _, - or : "
            "(e.g. email.send)",
    "queue": "must match [A-Za-z0-9][A-Za-z0-9_:.-]* (letters, digits, _, :, dots and hyphens)",
}


#: ``loc`` parts before a JSON value, per field. Inside the value pydantic tags each nested
#: container with "list" or "dict" before its index or key: those tags are not field paths.
_JSON_VALUE_DEPTH = {"args": 2, "meta": 2, "unique": 2, "error": 2, "progress": 2, "errors": 3}


def _json_value_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    depth = _JSON_VALUE_DEPTH.get(str(loc[0]), 1) if loc else 0
    return loc[:depth] + loc[depth + 1 :: 2]


def field_violations(
    error: ValidationError, root: str = "", unknown: str = "is not a known field"
) -> list[tuple[str, str]]:
    """``(field path, rule)`` for each error pydantic found: the one translation of its
    locations (``retry.max_attempts``, ``args[0]``; ``root`` goes in front) and messages
    (``unknown`` for a field the model forbids). Envelopes and settings both use it."""
    found: list[tuple[str, str]] = []
    for item in error.errors():
        loc = tuple(
            p for p in item["loc"] if not str(p).startswith(("function-", "json-or-python"))
        )
        if item["type"] == "invalid-json-value":
            loc = _json_value_loc(loc)
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "missing":
            message = "is required"
        elif item["type"] == "extra_forbidden":
            message = unknown
        elif item["type"] == "literal_error" and loc == ("specversion",):
            message = f'must be "{SPEC_VERSION}"'
        elif item["type"] == "string_pattern_mismatch" and loc and loc[-1] in PATTERN_RULES:
            message = PATTERN_RULES[str(loc[-1])]
        found.append((_path(loc, root), message))
    return found


def _field_violations_before_model(data: dict[Any, Any],
                                   typed: bool = False) -> list[tuple[Any, str]]:
    """``(key, rule)`` for the top-level fields the model cannot be trusted with: a key that is
    no string, a value nested deeper than :data:`MAX_NESTING` or holding a number that is not
    finite, a kombu type tag in the message body's fields (unless ``typed``: see
    :func:`parse_input`), an ``x_celery_*`` field that an
    envelope may not set or that is malformed. One pass, on every enqueue's path."""
    found: list[tuple[Any, str]] = []
    for key, value in data.items():
        if not isinstance(key, str):
            found.append((key, "must be a string field name"))
            continue
        if not _utf8_key(key):
            found.append((key, _UTF8_RULE))
            continue
        rule = _UNIQUE_RULE if key == "unique" else _value_rule(
            value, tags=not typed and key in _MESSAGE_BODY_FIELDS)
        if rule is None and key[:9].lower() == CELERY_NAMESPACE:
            rule = _celery_field_rule(key, value)
        if rule is not None:
            found.append((key, rule))
    return found


#: Unique jobs (OJS level 4) are not implemented: a job asking for them is refused rather than
#: run twice behind its producer's back. Checked on input only, so a record stored with one
#: by an earlier version still reads.
_UNIQUE_RULE = ("is not supported: ojs_celery does not implement unique jobs (OJS level 4); "
                "a client-chosen id makes an enqueue idempotent")


def _celery_field_rule(key: str, value: Any) -> str | None:
    """What is wrong with the ``x_celery_*`` field ``key`` of an envelope from outside."""
    if key != CELERY_KWARGS_FIELD:
        return (f"is not accepted from an envelope: {CELERY_NAMESPACE}* fields belong to "
                f"ojs_celery, and only {CELERY_KWARGS_FIELD} may be set (callbacks, routing "
                "and Celery options come from Python code)")
    if not isinstance(value, dict):
        return "must be a JSON object (the Celery keyword arguments)"
    if not all(isinstance(name, str) for name in value):
        return "must have string keys (the Celery keyword arguments)"
    return None


def _is_utf8(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False, default=str).encode()
    except UnicodeEncodeError:
        return False
    return True


def utf8_violations(fields: dict[str, Any]) -> list[tuple[str, str]]:
    """``(name, rule)`` for each field whose value holds text UTF-8 cannot encode (a lone
    surrogate, such as ``os.fsdecode`` makes of bytes that are not UTF-8): the store writes a
    job as UTF-8 JSON."""
    return [(name, _UTF8_RULE) for name, value in fields.items() if not _is_utf8(value)]


#: Fields by name, each JSON data (what ``args`` holds): the Celery kwargs' strict check.
_JSON_FIELDS: TypeAdapter[dict[str, JsonValue]] = TypeAdapter(dict[str, JsonValue])
_NOT_JSON = "must be JSON data"


def _extension_violations(job: Job) -> list[tuple[str, str]]:
    """What is wrong with a valid ``job``'s extension fields. ``x_celery_kwargs`` must be JSON
    data, as ``args`` is (tuples taken as lists, :func:`json_native`): a Python caller's
    ``datetime`` or ``bytes`` would be stored as text and no longer match the message of the
    call it came from, which the worker would drop. Any other extension is written back as
    pydantic writes it (a ``datetime`` as text), unless it cannot be written at all. (Nesting
    and finite numbers were checked with every top-level field before the model.)"""
    extra = job.model_extra
    if not extra:
        return []
    found = [(key, _NOT_JSON) for key, value in extra.items()
             if key != CELERY_KWARGS_FIELD and not _is_json(value)]
    if CELERY_KWARGS_FIELD in extra:
        extra[CELERY_KWARGS_FIELD] = kwargs = json_native(extra[CELERY_KWARGS_FIELD])
        try:
            _JSON_FIELDS.validate_python({CELERY_KWARGS_FIELD: kwargs})
        except ValidationError as exc:
            found += field_violations(exc)
    return found


def storable_violations(fields: dict[str, Any]) -> list[tuple[str, str]]:
    """``(field, rule)`` for each value of ``fields`` (by name) that a job's JSON cannot hold
    at all: nested too deep, a number that is not finite, an object pydantic cannot write (a
    ``datetime``, a ``Decimal`` or a ``UUID`` it writes as text)."""
    found: list[tuple[str, str]] = []
    for name, value in fields.items():
        rule = _value_rule(value)
        if rule is None and not _is_json(value):
            rule = _NOT_JSON
        if rule is not None:
            found.append((name, rule))
    return found


def _value_rule(value: Any, tags: bool = False) -> str | None:
    """What is wrong with a field's value as JSON data: nesting or a number, and with ``tags``
    a kombu type tag (None: nothing)."""
    if isinstance(value, (list, dict, tuple)):
        return _data_rule(value, tags)
    return _FINITE_RULE if isinstance(value, float) and not math.isfinite(value) else None


def _is_json(value: Any) -> bool:
    try:
        to_jsonable_python(value)
    except PydanticSerializationError:
        return False
    return True


def _surely_small(job: Job) -> bool:
    """True when ``job.to_json()`` is certainly within :data:`MAX_ENVELOPE_BYTES`, found
    without building it (that is the slow part of validating a small job).

    pydantic's own writer gives the same text except for floats: it writes the same digits
    with another notation (at most one character shorter, ``1e-7`` for ``1e-07``) and NaN
    or infinities as ``null``; a float is at least 3 characters there and at most 5 longer
    in ``to_json``, so three times pydantic's size bounds it. Only for jobs without
    extensions: everything else in a job is validated JSON data, which both writers accept
    alike, while an extension may hold any object (``to_json`` then decides, as always).
    """
    if job.model_extra:
        return False
    try:
        text = job.model_dump_json(by_alias=True, exclude_none=True)
    except PydanticSerializationError:
        return False
    return 3 * len(text.encode()) <= MAX_ENVELOPE_BYTES


#: Extra checks of a decoded envelope that need more than the envelope (the Celery app: is the
#: type an OJS task, is the queue declared): ``(field path, rule)`` pairs, as violations.
Rules = Callable[[dict[str, Any]], list[tuple[str, str]]]


def decode_json(text: str | bytes, what: str = "(envelope)") -> Any:
    """JSON text (UTF-8 when bytes) as data, or :class:`InvalidJob` naming ``what``. A
    leading UTF-8 byte order mark (files from some Windows editors) is ignored, as RFC 8259
    lets a parser do."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8-sig")  # not UTF-16 or -32, which json.loads would guess
        return _DECODER.decode(text)
    except RecursionError:
        raise InvalidJob([(what, _NESTING_RULE)]) from None
    except UnicodeDecodeError as exc:
        raise InvalidJob([(what, f"is not UTF-8 text: {exc.reason} at byte {exc.start}")]) \
            from None
    except ValueError as exc:  # json.JSONDecodeError, or bytes in another encoding
        raise InvalidJob([(what, f"is not valid JSON: {exc}")]) from None


def json_native(value: Any) -> Any:
    """Tuples become lists and number, boolean and null object keys become text, as Celery's
    JSON serializer would send them; anything JSON cannot carry is left for envelope
    validation to name."""
    if isinstance(value, (list, tuple)):
        return [json_native(v) for v in value]
    if isinstance(value, dict):
        return {_json_key(k): json_native(v) for k, v in value.items()}
    return value


def _json_key(key: Any) -> Any:
    """An object key as ``json.dumps`` writes it (``1`` → ``"1"``, ``True`` → ``"true"``)."""
    if isinstance(key, str) or not (key is None or isinstance(key, (bool, int, float))):
        return key
    return json.dumps(key)


def _not_a_json_number(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


#: One decoder for all: ``json.loads`` with any option builds a new decoder on every call.
_DECODER = json.JSONDecoder(parse_constant=_not_a_json_number)


def parse_envelope(data: dict[str, Any] | str | bytes | Job) -> Job:
    """Validate an envelope and return a new job (state unset; system fields ignored).

    Raises :class:`InvalidJob` listing every violation. The public API: the package's own
    callers use :func:`parse_input`, whose extra arguments are theirs only."""
    return parse_input(data)


#: What a batch (an array, or ``{"jobs": [...]}``) sent where one envelope is expected is told.
BATCH_HINT = ("this is a batch of envelopes; send it with enqueue_batch "
              "(ojs-celery enqueue --batch)")


def _looks_like_a_batch(data: Any) -> bool:
    """Whether ``data``, sent as one envelope, is a batch: an array of objects, or an object
    with a ``jobs`` array and no ``type`` (the OJS batch format)."""
    if isinstance(data, dict):
        data = data.get("jobs") if "type" not in data else None
    return isinstance(data, list) and bool(data) and all(isinstance(item, dict) for item in data)


def parse_input(
    data: dict[str, Any] | str | bytes | Job, *, rules: Rules | None = None,
    celery_id: bool = False, sent: int | None = None, typed: bool = False,
) -> Job:
    """Validate client input and return a new job (state unset; system fields ignored).

    Raises :class:`InvalidJob` listing every violation, those of ``rules`` included (a rule's
    violation of a field the envelope's own rules already reject is left out); nothing else
    is touched. ``celery_id``: the id is a task id a Celery caller (``apply_async``, canvas)
    chose, which need not be a UUIDv7; an envelope from outside must carry a UUIDv7 or none.
    ``sent``: the size in bytes of the text ``data`` was decoded from (an item of a batch given
    as text), which the 1 MiB limit applies to; text ``data`` is measured itself. ``typed``:
    ``args`` and ``x_celery_kwargs`` are a Celery caller's, written by :func:`typed_leaves`,
    and may hold kombu's typed JSON; an envelope from outside may not (:data:`KOMBU_TAG_RULE`).
    """
    if isinstance(data, Job):
        data = data.model_dump(mode="json", by_alias=True, exclude_none=True)
    if isinstance(data, (str, bytes)):
        if len(data) > MAX_ENVELOPE_BYTES:
            raise InvalidJob([("(envelope)", _OVERSIZED)])
        sent = len(data) if isinstance(data, bytes) else _utf8_size(data)
    if sent is not None and sent > MAX_ENVELOPE_BYTES:
        raise InvalidJob([("(envelope)", f"{_OVERSIZED} (is {sent} bytes)")])
    if isinstance(data, (str, bytes)):
        data = decode_json(data)
    if _looks_like_a_batch(data):
        raise InvalidJob([("(envelope)", f"must be a JSON object: {BATCH_HINT}")])
    if not isinstance(data, dict):
        raise InvalidJob([("(envelope)", "must be a JSON object")])
    clean = {k: v for k, v in data.items() if k not in SYSTEM_FIELDS and v is not None}
    if isinstance(clean.get("retry"), dict):  # explicit null = absent, in the policy too
        clean["retry"] = {k: v for k, v in clean["retry"].items() if v is not None}
    violations: list[tuple[str, str]] = []
    for key, rule in _field_violations_before_model(clean, typed):
        violations.append((utf8_safe(str(key)), rule))
        del clean[key]  # checked already: pydantic would only add noise (or recurse)
    named = {path for path, _ in violations}
    if "args" in clean and not isinstance(clean["args"], list):
        violations.append(("args", "must be a JSON array"))
        named.add("args")
    if "args" in named:
        clean["args"] = []  # placeholder: check the other fields without a bogus "is required"
    try:
        job: Job | None = _validated(clean, celery_id)
    except ValidationError as exc:
        job = None
        violations += [(path, rule) for path, rule in field_violations(exc)
                       if _top_field(path) not in named]
    if rules is not None:
        named |= {_top_field(path) for path, _ in violations}
        violations += [(path, rule) for path, rule in rules(data) if _top_field(path) not in named]
    if violations or job is None:
        raise InvalidJob(violations)
    violations = _too_long(job) + _extension_violations(job)
    if "retry" in clean:  # the defaults alone hold
        violations += job.retry.merged_violations()
    if violations:
        raise InvalidJob(violations)
    if _surely_small(job):
        return job
    try:
        size = len(job.to_json().encode())
    except PydanticSerializationError:  # every field is checked by now
        raise InvalidJob([("(envelope)", _NOT_JSON)]) from None
    except UnicodeEncodeError:
        bad = utf8_violations({str(key): value for key, value in clean.items()})
        raise InvalidJob(bad or [("(envelope)", _UTF8_RULE)]) from None
    # Text is measured as sent: the job's own JSON may be longer than the text it came from
    # (``1e5`` is written ``100000.0``), and an envelope within 1 MiB as sent is accepted.
    if sent is None and size > MAX_ENVELOPE_BYTES + _SYSTEM_BYTES:
        raise InvalidJob([("(envelope)", f"{_OVERSIZED} (is {size - _SYSTEM_BYTES} "
                                         "bytes, less the fields the system adds)")])
    return job


_OVERSIZED = "must not exceed 1 MiB"


def _oversized(exc: InvalidJob) -> bool:
    """Is one of ``exc``'s violations the envelope's size?"""
    return any(path == "(envelope)" and rule.startswith(_OVERSIZED)
               for path, rule in exc.violations)


def _item_sizes(text: str | bytes) -> list[int]:
    """The size in bytes of each envelope of ``text``, a valid batch (a JSON array, or an
    object whose ``jobs`` is one: the OJS batch format), as written there. Bytes are read as
    :func:`decode_json` reads them, a leading byte order mark skipped."""
    if isinstance(text, bytes):
        text = text.decode("utf-8-sig")
    at = _past_space(text, 0)
    if text[at] == "{":
        at = _jobs_at(text, at)
    sizes: list[int] = []
    at = _past_space(text, at + 1)  # past the "["
    while text[at] != "]":
        _, end = _DECODER.raw_decode(text, at)
        sizes.append(_utf8_size(text[at:end]))
        at = _past_space(text, end)
        if text[at] == ",":
            at = _past_space(text, at + 1)
    return sizes


def _jobs_at(text: str, at: int) -> int:
    """The index of the ``jobs`` array in ``text``, a valid JSON object that starts at ``at``
    (its last ``jobs`` key, the one :func:`decode_json` keeps)."""
    found = -1
    at = _past_space(text, at + 1)  # past the "{"
    while text[at] != "}":
        key, end = _DECODER.raw_decode(text, at)
        at = _past_space(text, _past_space(text, end) + 1)  # past the ":"
        _, end = _DECODER.raw_decode(text, at)
        if key == "jobs":
            found = at
        at = _past_space(text, end)
        if text[at] == ",":
            at = _past_space(text, at + 1)
    return found


def _past_space(text: str, at: int) -> int:
    """The index of the first character from ``at`` on that is not JSON whitespace."""
    while text[at] in " \t\n\r":
        at += 1
    return at


def _utf8_size(text: str) -> int:
    """The length of ``text`` in UTF-8 (a lone surrogate counted as UTF-8 would write it:
    validation names it later)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


#: What the system adds to an envelope that has only ``type`` and ``args`` (the id, the
#: defaults of every other field, the state): a job's JSON may be that much over 1 MiB, so
#: that every envelope up to 1 MiB is accepted, as OJS requires.
_SYSTEM_BYTES = len(Job(type="t", args=[]).to_json()) - len('{"type":"t","args":[]}')


#: The envelope's integer fields (``retry.max_attempts`` too).
_INTEGER_FIELDS = ("priority", "timeout", "visibility_timeout", "total_timeout", "enqueue_ttl",
                   "grace_period", "heartbeat_timeout")


def _validated(clean: dict[str, Any], celery_id: bool) -> Job:
    """The job of the envelope fields ``clean``. A whole number written as a float (``30.0``,
    ``1e3``) in an integer field is taken as that integer, as JSON Schema's ``integer`` takes
    it (a producer whose numbers are doubles, Java or Python, writes them so): only when the
    strict validation refused one, so that the common envelope pays nothing for it."""
    context = {"celery_id": celery_id}
    try:
        return Job.model_validate(clean, context=context)
    except ValidationError:
        wholes = _whole_numbers(clean, _INTEGER_FIELDS)
        retry = clean.get("retry")
        retry = retry if isinstance(retry, dict) else {}
        retry_wholes = _whole_numbers(retry, ("max_attempts",))
        if not wholes and not retry_wholes:
            raise
        if retry_wholes:
            wholes["retry"] = {**retry, **retry_wholes}
        return Job.model_validate({**clean, **wholes}, context=context)


def _whole_numbers(data: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The floats of ``names`` in ``data`` that are whole numbers, as integers."""
    return {name: int(value) for name in names
            if isinstance(value := data.get(name), float) and value.is_integer()}


def _top_field(path: str) -> str:
    return re.split(r"[.\[]", path, maxsplit=1)[0]


#: How deep arrays and objects may nest in one field of an envelope. Deeper data would exhaust
#: Python's recursion somewhere on its way (JSON codecs, pydantic, kombu, the worker).
MAX_NESTING = 64
_NESTING_RULE = f"must not nest arrays and objects more than {MAX_NESTING} levels deep"


_UTF8_RULE = "must be Unicode text that UTF-8 can encode (no lone surrogates such as \\ud800)"
#: JSON has no NaN or infinities: stored, they would make the job's JSON unreadable to every
#: strict parser (other languages', ``jq``'s). ``1e400`` is valid JSON text that no double holds:
#: Python reads it as an infinity.
_FINITE_RULE = ("must hold only finite numbers (JSON has no NaN or Infinity; a number such "
                "as 1e400 is beyond a double's range)")


def _data_rule(value: list[Any] | dict[Any, Any] | tuple[Any, ...],
               tags: bool = False) -> str | None:
    """What is wrong with the JSON data ``value``: arrays and objects nested deeper than
    :data:`MAX_NESTING`, an object key UTF-8 cannot encode, a number that is not finite, and
    with ``tags`` an object kombu reads as a type tag (None: nothing). Walked without
    recursion, stopping at the first fault."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_NESTING:
            return _NESTING_RULE
        if isinstance(item, dict):
            if not all(_utf8_key(key) for key in item):
                return _UTF8_RULE
            if tags and item.keys() == _KOMBU_TAG_KEYS:
                return KOMBU_TAG_RULE
            item = item.values()
        for child in item:
            if isinstance(child, (list, dict, tuple)):
                stack.append((child, depth + 1))
            elif isinstance(child, float) and not math.isfinite(child):
                return _FINITE_RULE
    return None


#: The fields a task message's body carries, which kombu's JSON decoder reads on the worker.
_MESSAGE_BODY_FIELDS = frozenset({"args", CELERY_KWARGS_FIELD})
#: An object with exactly these keys is a type tag to kombu's JSON decoder (a ``datetime``, a
#: ``Decimal``, ...; an unknown tag makes the message undecodable): the handler would not get
#: the data that was stored, so the worker could never start the job.
_KOMBU_TAG_KEYS = frozenset({"__type__", "__value__"})
KOMBU_TAG_RULE = ('must not hold an object with exactly the keys "__type__" and "__value__" '
                  "(kombu's JSON reads it as a typed value, not as data)")
#: The rules of a field's whole value that no typed value mends (see :func:`typed_leaves`): a
#: Celery call whose arguments break one is refused as they are.
ARGUMENT_RULES = frozenset({_NESTING_RULE, _UTF8_RULE, _FINITE_RULE, KOMBU_TAG_RULE})


def typed_json(value: Any) -> Any:
    """``value`` as the JSON data Celery's JSON serializer (kombu's) writes it: tuples as lists,
    keys as text, and a ``datetime``, ``date``, ``time``, ``Decimal``, ``UUID`` or ``bytes``
    (or a type registered with kombu's ``register_type``) as kombu's typed JSON,
    ``{"__type__": "datetime", "__value__": "2030-01-02T00:00:00+00:00"}``, which kombu's
    decoder on the worker reads back as that value. ``TypeError`` or ``ValueError`` for what
    that serializer cannot write either (a ``set``, an object), as its ``EncodeError`` says.
    A NaN or an infinity is written and read back: the envelope's own rules refuse it."""
    return json.loads(kombu_dumps(value))  # type: ignore[no-untyped-call]


def typed_leaves(value: Any) -> Any:
    """JSON data ``value`` as :func:`typed_json` writes it, except that what kombu's JSON cannot
    write (a ``set``, an object) is left as it is, for the envelope's rules to name where it
    is. Walks lists, tuples and dicts, which :data:`ARGUMENT_RULES` bound in depth."""
    if isinstance(value, (list, tuple)):
        return [typed_leaves(item) for item in value]
    if isinstance(value, dict):
        return {_json_key(key): typed_leaves(item) for key, item in value.items()}
    if value is None or type(value) in (str, int, float, bool):
        return value
    try:
        return typed_json(value)
    except (TypeError, ValueError):
        return value


def holds_typed(value: Any) -> bool:
    """Whether the JSON data ``value`` (lists, tuples and dicts walked, no deeper than
    :data:`MAX_NESTING`: deeper data is refused elsewhere) holds an object kombu reads as a typed
    value (exactly the keys ``__type__`` and ``__value__``)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_NESTING:
            continue
        if isinstance(item, dict):
            if item.keys() == _KOMBU_TAG_KEYS:
                return True
            item = item.values()
        stack.extend((child, depth + 1) for child in item
                     if isinstance(child, (list, dict, tuple)))
    return False


def typed_values(value: Any) -> Any:
    """The JSON data ``value`` with each typed value of :func:`typed_json` read back as kombu's
    decoder reads it (a ``datetime``, a ``Decimal``, ...): what a job's stored arguments are to
    a serializer other than JSON (``pickle``), or to Celery's canvas called in this process.
    ``value`` itself when it holds none."""
    if not isinstance(value, (list, dict, tuple)) or not holds_typed(value):
        return value
    return kombu_loads(json.dumps(value))  # type: ignore[no-untyped-call]


def utf8_safe(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (a lone surrogate) escaped as ``\\udcxx``: a
    field name, an error message or a CLI line that can always be written."""
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _utf8_key(key: Any) -> bool:
    """Whether an object key can be written as JSON text: not a string with a lone surrogate
    (pydantic would write it as U+FFFD, a key other than the one the message carries)."""
    if not isinstance(key, str) or key.isascii():
        return True
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_batch(data: str | bytes | list[Any], *, rules: Rules | None = None) -> list[Job]:
    """Validate a JSON array (or ``{"jobs": [...]}``) of envelopes; every job must be valid."""
    text: str | bytes | None = None
    sizes: list[int] | None = None
    if isinstance(data, (str, bytes)):
        if len(data) > MAX_BATCH_BYTES:
            raise InvalidJob([("(batch)", f"must not exceed {MAX_BATCH_BYTES // 2**20} MiB")])
        text, data = data, decode_json(data, "(batch)")
    if isinstance(data, dict) and isinstance(data.get("jobs"), list):
        data = data["jobs"]
    elif not isinstance(data, list):
        text = None  # no batch: refused below, nothing to measure
    if not isinstance(data, list) or not data:
        raise InvalidJob([("(batch)", "must be a non-empty JSON array of job envelopes")])
    if len(data) > MAX_BATCH_JOBS:
        raise InvalidJob([("(batch)", f"must hold at most {MAX_BATCH_JOBS} envelopes (the OJS "
                           "batch schema's limit; send more batches)")])
    jobs: list[Job] = []
    violations: list[tuple[str, str]] = []
    first_index: dict[str, int] = {}
    for index, item in enumerate(data):
        if isinstance(item, (str, bytes)):  # JSON data in a batch, not text to decode again
            violations.append((f"[{index}]", "must be a JSON object"))
            continue
        try:
            try:
                job = parse_input(item, rules=rules)
            except InvalidJob as exc:
                # Over 1 MiB as the job writes it: measure the item as sent (in a top-level
                # array), found in the text only now, since this is rare
                if text is None or not _oversized(exc):
                    raise
                sizes = sizes or _item_sizes(text)
                job = parse_input(item, rules=rules, sent=sizes[index])
        except InvalidJob as exc:
            violations.extend(
                (f"[{index}]" if path == "(envelope)" else f"[{index}].{path}", rule)
                for path, rule in exc.violations
            )
            continue
        if job.id in first_index:
            violations.append(
                (f"[{index}].id", f"duplicates the id of job [{first_index[job.id]}] ({job.id})")
            )
        first_index.setdefault(job.id, index)
        jobs.append(job)
    if violations:
        raise InvalidJob(violations)
    return jobs
