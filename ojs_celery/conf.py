"""Settings, read from ``app.conf.ojs`` (Django: ``CELERY_OJS = {...}``) and validated once.

Celery does not validate unknown keys, so a typo would pass silently; here every key is checked
and a bad one raises Celery's ``ImproperlyConfigured`` naming ``ojs.<key>`` and the rule.
Durations are seconds and accept floats (tests use short intervals), finite (see ``Seconds``).
"""

from __future__ import annotations

import logging
import math
from typing import Annotated, Any, Literal

from celery.exceptions import ImproperlyConfigured
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from . import compat
from .envelope import MAX_DURATION, PATTERN_RULES, TYPE_PATTERN, Job, field_violations
from .lifecycle import DAY, ERRORS_KEPT, Policy
from .store.base import DEFAULT_TIMEOUT as DEFAULT_STORE_TIMEOUT

logger = logging.getLogger(__name__)


def finite_seconds(value: float) -> float:
    """Refuse an infinite duration (``inf``, ``"Infinity"``, ``1e400``), which pydantic reads
    as a float: it would mean "never" (a drain, a republish, a deadline that never comes), and
    nothing in ojs_celery waits for ever; and one past a hundred years (``1e300``), which is
    never as well, and beyond what a wait (``threading.TIMEOUT_MAX``) or a date can hold. The
    settings' rule, and the CLI's ``--interval``."""
    if not math.isfinite(value):
        raise ValueError(f"must be a finite number of seconds, not {value}: nothing waits for "
                         "ever, so no duration is read as never")
    if value > MAX_DURATION:
        raise ValueError(f"must be at most {MAX_DURATION} seconds (a hundred years), not "
                         f"{value}: nothing waits for ever, so no duration is read as never")
    return value


def _refuse_non_finite_first(value: Any) -> Any:
    """Apply :func:`finite_seconds` to NaN and the infinities before a field's lower bound,
    which would name the bound (NaN is "not greater than 0"); other input goes on as it is, to
    pydantic's own parsing and the bounds."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):  # no number, or an int past a float
        return value
    if not math.isfinite(number):
        finite_seconds(number)
    return value


#: A duration setting: seconds, a float, finite and at most a hundred years (each field adds
#: its own lower bound, and may lower the upper one).
Seconds = Annotated[float, BeforeValidator(_refuse_non_finite_first),
                    AfterValidator(finite_seconds)]
#: The beginnings of the ``store_url`` schemes a backend exists for.
STORE_SCHEMES = ("sqlite", "postgresql", "postgres", "redis", "rediss", "unix")
#: The job ``heartbeat_timeout`` an envelope gets when it names none (the spec's default).
DEFAULT_JOB_HEARTBEAT_TIMEOUT = int(Job.model_fields["heartbeat_timeout"].default)


class Retention(BaseModel):
    """How long terminal jobs are kept before the sweeper prunes them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    completed: Seconds = Field(7 * DAY, gt=0)
    cancelled: Seconds = Field(30 * DAY, gt=0)
    discarded: Seconds = Field(30 * DAY, gt=0)
    dead_letter: Seconds = Field(180 * DAY, gt=0)


#: What waits for the settings :meth:`Settings._at_most_a_day` bounds, as its error says.
_WHO_WAITS = {
    "worker_heartbeat_timeout": "sweepers wait this long for a silent worker of this app before "
                                "they recover its jobs",
    "shutdown_grace_period": "a stopping worker waits this long for its running jobs (the "
                             "deploy with it), and nothing waits for ever",
}


def _on_postgres(info: ValidationInfo) -> bool:
    """Whether the settings being validated have a PostgreSQL ``store_url`` (checked first)."""
    return str(info.data.get("store_url") or "").lower().startswith(("postgresql", "postgres"))


class Settings(BaseModel):
    """Every ``ojs`` setting with its default (see the README's settings table)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store_url: str = "sqlite:///ojs.sqlite3"
    store_prefix: str = Field("ojs", pattern=r"^[A-Za-z][A-Za-z0-9_]*$", max_length=40)
    #: PostgreSQL store only: ``synchronous_commit`` for the store's sessions (None: the
    #: server's). ``"off"`` trades the last moments of writes on a server crash for an
    #: insert that does not wait for the disk (README, settings).
    store_synchronous_commit: Literal["on", "off", "local", "remote_write",
                                      "remote_apply"] | None = None
    #: Seconds a store call waits for the store's answer before it fails (see
    #: :data:`ojs_celery.store.base.DEFAULT_TIMEOUT`).
    store_timeout: Seconds = Field(DEFAULT_STORE_TIMEOUT, ge=0.1, le=3600)
    #: Seconds a publish waits for the broker's confirmation, when the app has kombu's
    #: publisher confirms on (``broker_transport_options={"confirm_publish": True}``, RabbitMQ).
    #: Celery sends no limit, and a blocked connection (a RabbitMQ memory or disk alarm) never
    #: confirms: without one, ``.delay()`` and ``enqueue`` would wait for ever.
    publish_timeout: Seconds = Field(10.0, ge=0.1, le=3600)
    type_map: dict[str, str] = {}
    events: bool = True
    amqp_max_priority: int = Field(10, ge=1, le=255)
    dispatch_grace: Seconds = Field(10.0, gt=0)
    schedule_horizon: Seconds = Field(60.0, gt=0)
    redispatch_after: Seconds = Field(3600.0, gt=0)
    sweep_interval: Seconds = Field(2.0, gt=0)
    sweep_queue: str = "ojs.sweep"
    sweep_batch: int = Field(500, ge=1)
    #: At most the error history's length (its tail of dispatch errors is what is counted).
    dispatch_failure_limit: int = Field(5, ge=1, le=ERRORS_KEPT)
    execution_tolerance: Seconds = Field(1.5, ge=1.5)
    heartbeat_interval: Seconds = Field(5.0, gt=0)
    #: At most a day: a worker records its own, which sweepers wait for (a dead one with a huge
    #: timeout would hold its jobs that long).
    worker_heartbeat_timeout: Seconds = Field(30.0, gt=0)
    #: At most a day: a deploy waits this long for the worker's running jobs (see _at_most_a_day).
    shutdown_grace_period: Seconds = Field(25.0, ge=0)
    #: A job still running this long (at most its own grace period) before the drain ends gets
    #: its cancellation signal; at most half of ``shutdown_grace_period`` (see cancel_window).
    shutdown_cancel_window: Seconds = Field(5.0, ge=0)
    labels: list[str] = []
    retention: Retention = Retention()
    #: The execution timeout of a Celery caller's job whose task has no Celery time limit.
    #: Whole seconds (a job's timeout), at most a hundred years as the job's own (finite_seconds):
    #: a longer one passed here and failed every Celery call of a task with no time limit.
    default_timeout: Annotated[int, AfterValidator(finite_seconds)] = Field(1800, gt=0)
    #: ``"celery"``: jobs from Celery callers keep Celery's retry semantics (README mapping);
    #: ``"ojs"``: they get the OJS defaults, as envelopes do (a task's ``ojs_semantics`` wins).
    celery_callers: Literal["celery", "ojs"] = "celery"

    @field_validator("store_url")
    @classmethod
    def _store_url(cls, value: str) -> str:
        """A scheme the package has a backend for, with that backend's extra installed:
        checked when the settings are read, not at the first store call."""
        scheme = value.split(":", 1)[0].lower()
        if not scheme.startswith(STORE_SCHEMES):
            raise ValueError(
                f"unsupported scheme {scheme!r} (use sqlite:///path, postgresql://... or "
                "redis://...)"
            )
        try:
            compat.require_store_extra(value)
        except compat.MissingExtra as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("worker_heartbeat_timeout", "shutdown_grace_period")
    @classmethod
    def _at_most_a_day(cls, value: float, info: ValidationInfo) -> float:
        """Waits that hold jobs, which a longer value would hold for days: the jobs of a dead
        worker, or a deploy (a stopping worker's drain, unbounded in all but name)."""
        if value > DAY:
            raise ValueError(f"at most a day ({DAY:.0f}s): {_WHO_WAITS[str(info.field_name)]}")
        return value

    @field_validator("store_prefix")
    @classmethod
    def _prefix_fits_postgres(cls, value: str, info: ValidationInfo) -> str:
        """PostgreSQL cuts a name longer than 63 bytes, and its store's index names are the
        prefix and up to 24 characters more: every store call would fail."""
        if _on_postgres(info):
            from .store.sql import POSTGRES_MAX_IDENTIFIER, longest_name

            name = longest_name(value)
            if len(name) > POSTGRES_MAX_IDENTIFIER:
                room = POSTGRES_MAX_IDENTIFIER - (len(name) - len(value))
                raise ValueError(
                    f"at most {room} characters with a PostgreSQL store (its index {name} "
                    f"would be over PostgreSQL's {POSTGRES_MAX_IDENTIFIER})"
                )
        return value

    @field_validator("type_map")
    @classmethod
    def _types(cls, value: dict[str, str]) -> dict[str, str]:
        import re

        for ojs_type, task_name in value.items():
            if not re.fullmatch(TYPE_PATTERN, ojs_type):
                raise ValueError(
                    f"key {ojs_type!r} is not a valid OJS type (it "
                    f"{PATTERN_RULES['type']})"
                )
            if not isinstance(task_name, str) or not task_name:
                raise ValueError(f"value for {ojs_type!r} must be a Celery task name")
        return value

    @field_validator("store_synchronous_commit")
    @classmethod
    def _synchronous_commit_on_postgres(cls, value: str | None, info: ValidationInfo) -> str | None:
        """A PostgreSQL setting: with another store it would silently do nothing."""
        if value is not None and not _on_postgres(info):
            raise ValueError("applies to a PostgreSQL store_url only")
        return value

    @model_validator(mode="after")
    def _worker_liveness(self) -> Settings:
        """A worker is declared dead after ``worker_heartbeat_timeout`` without a beat; if
        that is not longer than one beat interval plus one sweep interval, healthy workers are
        declared dead and their jobs run twice."""
        floor = self.heartbeat_interval + self.sweep_interval
        if self.worker_heartbeat_timeout <= floor:
            raise ValueError(
                f"worker_heartbeat_timeout ({self.worker_heartbeat_timeout}s) must be longer "
                f"than heartbeat_interval + sweep_interval ({floor}s), or live workers are "
                "declared dead"
            )
        return self

    def warnings(self) -> list[str]:
        """Legal settings that go against the worker protocol's recommendations."""
        found = []
        if self.worker_heartbeat_timeout < 3 * self.heartbeat_interval:
            found.append(
                f"ojs.worker_heartbeat_timeout ({self.worker_heartbeat_timeout}s) is under 3x "
                f"heartbeat_interval ({self.heartbeat_interval}s), as the worker protocol "
                "recommends: one slow beat gets a live worker declared dead"
            )
        if 4 * self.heartbeat_interval > DEFAULT_JOB_HEARTBEAT_TIMEOUT:
            found.append(
                f"ojs.heartbeat_interval ({self.heartbeat_interval}s) is over a quarter of the "
                f"default job heartbeat_timeout ({DEFAULT_JOB_HEARTBEAT_TIMEOUT}s), as the "
                "timeouts extension recommends: jobs relying on worker beats may stall"
            )
        return found

    @field_validator("shutdown_cancel_window")
    @classmethod
    def _cancel_window(cls, value: float, info: ValidationInfo) -> float:
        """Clamp a window set explicitly to half the drain, with a warning (the default is
        clamped silently by :attr:`cancel_window`, so a short drain needs no second setting)."""
        drain: float | None = info.data.get("shutdown_grace_period")
        if drain is None:  # the drain itself is invalid: that error is reported
            return value
        half = drain / 2
        if value > half:
            logger.warning("ojs_celery: ojs.shutdown_cancel_window %ss is more than half of "
                           "ojs.shutdown_grace_period %ss: using %ss", value, drain, half)
            return half
        return value

    @property
    def cancel_window(self) -> float:
        """The effective window: at most half the drain, the other half being the jobs' time
        to finish undisturbed (a drain of 0 has no window)."""
        return min(self.shutdown_cancel_window, self.shutdown_grace_period / 2)

    @property
    def blind_after(self) -> float:
        """A gap this long between two sweeps that reached the store is a blind spell (see
        ``lifecycle.BlindSpell``): sweeps come every ``sweep_interval``, and a gap longer than
        a beat interval more may have hidden a beat."""
        return self.heartbeat_interval + self.sweep_interval

    @property
    def policy(self) -> Policy:
        return Policy(
            dispatch_grace=self.dispatch_grace,
            schedule_horizon=self.schedule_horizon,
            redispatch_after=self.redispatch_after,
            execution_tolerance=self.execution_tolerance,
            worker_heartbeat_timeout=self.worker_heartbeat_timeout,
            dispatch_failure_limit=self.dispatch_failure_limit,
            retention_completed=self.retention.completed,
            retention_cancelled=self.retention.cancelled,
            retention_discarded=self.retention.discarded,
            retention_dead_letter=self.retention.dead_letter,
        )


def raw_settings(conf: Any) -> Any:
    """The ``ojs`` setting as Celery's configuration ``conf`` holds it: ``ojs`` (a Django
    project's ``CELERY_OJS`` with ``namespace="CELERY"``), else ``CELERY_OJS``, the name it has
    in a configuration in Celery's old upper-case style (``BROKER_URL``,
    ``CELERY_RESULT_BACKEND``) or a Django settings module read without a namespace, where
    Celery keeps a name it does not know as it is written (it was silently ignored: the app
    ran on the default SQLite store)."""
    raw = conf.get("ojs")
    return conf.get("CELERY_OJS") if raw is None else raw


def read_settings(raw: Any) -> Settings:
    """Validate the raw ``ojs`` setting; raise ``ImproperlyConfigured`` naming each bad key."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ImproperlyConfigured(f"ojs: must be a dict of settings, got {type(raw).__name__}")
    try:
        return Settings.model_validate(raw)
    except ValidationError as exc:
        problems = [f"{path}: {rule}"
                    for path, rule in field_violations(exc, "ojs", unknown="unknown setting")]
        raise ImproperlyConfigured("invalid OJS settings:\n  " + "\n  ".join(problems)) from None
