"""Celery canvas for OJS tasks: the options ``chain``/``group``/``chord``/``link`` give a job.

Canvas works through per-message options (the rest of a chain, the chord body, the group id
and index, the callbacks) that Celery's worker reads from the message. A Celery caller's options
are kept with the job (see :func:`ojs_celery.producer.with_celery_options`) and sent with every
attempt's message, so each link of a chain is an OJS job with its own timeouts and retries and
Celery's own machinery (``trace``, ``on_chord_part_return``) runs the next step. The same
options let :mod:`ojs_celery.effects` report an outcome the sweeper decided as Celery would.
"""

from __future__ import annotations

import json
from typing import Any

from celery.app.task import Context
from kombu.utils.json import dumps

from .envelope import CELERY_KWARGS_FIELD, InvalidJob, Job, typed_values
from .producer import TRUSTED_OPTIONS


def canvas_options(options: dict[str, Any]) -> dict[str, Any]:
    """The canvas options of an ``apply_async`` call, as the JSON data Celery sends."""
    kept = {name: options[name] for name in TRUSTED_OPTIONS if options.get(name) is not None}
    if not kept:
        return {}
    try:
        native: dict[str, Any] = json.loads(dumps(kept))  # type: ignore[no-untyped-call]
    except (TypeError, ValueError):  # as Celery's publish would fail on it, before storing
        raise InvalidJob([(name, "must be data Celery's JSON serializer can encode")
                          for name, value in kept.items() if not _encodable(value)]) from None
    return native


def _encodable(value: Any) -> bool:
    try:
        dumps(value)  # type: ignore[no-untyped-call]
    except (TypeError, ValueError):
        return False
    return True


def celery_context(job: Job, task_name: str, options: dict[str, Any]) -> Context:
    """The request Celery's result backend needs to report ``job``'s outcome as a worker
    would (chord member, errbacks, the rest of a chain): built from its stored options, with
    the typed values they and the job's arguments keep as kombu's typed JSON read back as
    values, as a worker's request has them from the message (a chord body or an errback
    called from here gets its ``datetime`` arguments as such)."""
    options = typed_values(options)
    return Context(
        id=job.id,
        task=task_name,
        args=typed_values(list(job.args)),
        kwargs=typed_values(dict(job.extensions.get(CELERY_KWARGS_FIELD) or {})),
        chord=options.get("chord"),
        group=options.get("group_id"),
        group_index=options.get("group_index"),
        callbacks=options.get("link"),
        errbacks=options.get("link_error"),
        chain=options.get("chain"),
        parent_id=options.get("parent_id"),
        root_id=options.get("root_id"),
        reply_to=options.get("reply_to"),
        correlation_id=job.id,
        delivery_info={},
        called_directly=False,
    )
