"""The public API around the store: enqueue, read and cancel jobs."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from functools import partial
from typing import TYPE_CHECKING, Any

from celery import Celery

from . import arrival, lifecycle
from .effects import carry_out, log_unpublished
from .envelope import (
    CELERY_KWARGS_FIELD,
    DuplicateJob,
    InvalidJob,
    Job,
    Rules,
    could_be_job_id,
    parse_batch,
    parse_input,
)
from .lifecycle import Transition
from .producer import (
    DEFAULT_QUEUE,
    BrokerUnavailable,
    call_mismatch,
    celery_queue,
    check_serializer,
    ojs_queue_of,
    publish,
    sent_together,
    with_celery_options,
)
from .runtime import Runtime, UnknownType, get_runtime
from .store import DuplicateJob as StoredDuplicate
from .store import StoreError

if TYPE_CHECKING:
    from .store.redis import RedisStore

logger = logging.getLogger(__name__)


class JobNotFound(LookupError):
    """No job with this id (it never existed, or it was pruned after its retention)."""


def get_job(job_id: str, *, app: Celery | None = None) -> Job | None:
    """The job as the store has it now, or None."""
    if not could_be_job_id(job_id):
        return None
    return get_runtime(app).store.get(job_id.lower())


def cancel(job_id: str, *, app: Celery | None = None) -> Job:
    """Cancel a job that has not ended. A running attempt is stopped (its pool process is
    killed, by job id and token) and its late outcome, should it come first, is rejected; the
    result backend reads REVOKED, as after Celery's ``revoke``, so ``AsyncResult.get()``
    raises instead of waiting.

    Cancelling a cancelled job returns it unchanged; a completed or discarded job raises
    ``ValueError``; an unknown id raises :class:`JobNotFound`.
    """
    if not could_be_job_id(job_id):
        raise JobNotFound(f"no job with id {job_id}")
    runtime = get_runtime(app)
    done = runtime.store.cancel(job_id.lower())
    if done.record is not None:
        carry_out(runtime, done, stop_attempt=True, report_result=True)
        return done.record.job
    job = runtime.store.get(job_id.lower())
    if job is None:
        raise JobNotFound(f"no job with id {job_id}")
    if job.state == "cancelled":
        return job
    raise ValueError(f"job {job_id} is already {job.state}: it cannot be cancelled")


#: Jobs :func:`purge` reads and cancels at a time (one read and one write of the store each).
PURGE_PAGE = 500
#: The clocks that together index every job waiting to run: held in the store (a far
#: ``scheduled_at``, a long backoff), its message not sent yet (the outbox), its message sent
#: (the backstop's clock). Read in that order, the order a job moves on in while the purge
#: runs (a sweeper promotes it, publishes it): one read in the other order found it in none.
WAITING_CLOCKS = (lifecycle.PROMOTE.name, lifecycle.DISPATCH.name, lifecycle.REDISPATCH.name)


def purge(queues: Iterable[str] | None = None, *, app: Celery | None = None) -> int:
    """Cancel every job that waits to run (``scheduled``, ``available``, ``retryable``) in
    ``queues`` (Celery queue names, or one name; None: every queue) and return how many were
    cancelled.

    Celery's purge empties the broker's queues, not the store, and the sweeper sends a waiting
    job's message again when it has waited ``redispatch_after`` (the backstop for a message
    that a broker lost): a purged job would come back. A cancelled one never runs, its message
    purged or not; its result reads REVOKED. A running attempt is left to finish, as Celery's
    purge leaves what a worker took."""
    runtime = get_runtime(app)
    store = runtime.store
    if isinstance(queues, str):  # one queue, not the queues named by its letters
        queues = [queues]
    names = None if queues is None else frozenset(
        name for name in (_record_queue(runtime.app, queue) for queue in queues) if name)
    rule = partial(lifecycle.purge, now=time.time(), queues=names)
    cancelled = 0
    try:
        for clock in WAITING_CLOCKS:
            cursor: str | None = None
            while True:
                ids, cursor = store.scan(clock, cursor, PURGE_PAGE)
                if ids:
                    results = store.apply_many(ids, rule)
                    failure: StoreError | None = None
                    for job_id, done in zip(ids, results, strict=True):
                        if done is None:  # it changed since it was read (a worker started it)
                            if failure is not None:
                                continue
                            try:
                                done = store.apply(job_id, rule)
                            except StoreError as exc:  # raised once the page's written
                                failure = exc         # cancellations are carried out: no
                                continue              # later purge finds them
                        if done.record is not None:
                            carry_out(runtime, done, report_result=True)
                            cancelled += 1
                    if failure is not None:
                        raise failure
                if cursor is None:
                    break
    except StoreError as exc:
        raise StoreError(f"{exc} ({cancelled} job(s) were cancelled before it: purge again to "
                         "go on)") from exc
    return cancelled


def _record_queue(app: Celery, name: str) -> str | None:
    """A Celery queue's name in the job records; None for one that no job can have (a Celery
    queue called ``default`` beside another default queue: see ``ojs_queue_of``)."""
    try:
        return ojs_queue_of(app, name)
    except InvalidJob:
        return None


def enqueue_batch(
    envelopes: str | bytes | list[object], *, app: Celery | None = None
) -> list[Job]:
    """Validate every envelope, store them all in one atomic step (all or none: an id taken
    by another job stores nothing), then publish them: sent together, up to
    :data:`PUBLISH_CHUNK` in one Redis pipeline, where kombu can (kombu 5.7 and later). As with
    :func:`enqueue`, an envelope whose id names the job it made before (the batch sent again)
    returns that job, and once the batch is stored this returns: a message that could not be
    published stays in the outbox, and the sweeper publishes it."""
    runtime = get_runtime(app)
    jobs = parse_batch(envelopes, rules=publish_rules(runtime))
    mismatches = [(f"[{index}].args", rule) for index, rule in enumerate(
        argument_rule(runtime, job) for job in jobs) if rule is not None]
    if mismatches:
        raise InvalidJob(mismatches)
    check_serializer(runtime.app)
    earlier, transitions = _store_batch(runtime, jobs)
    with ExitStack() as held:
        try:  # one producer (one pooled connection) for every message of the batch
            producer = held.enter_context(runtime.app.producer_or_acquire())
        except Exception:  # each publish tries on its own, and says what failed
            producer = None
        broker_down = False
        for start in range(0, len(transitions), PUBLISH_CHUNK):
            broker_down = _publish_chunk(runtime, transitions[start:start + PUBLISH_CHUNK],
                                         producer, broker_down)
    made = iter(transition.record.job for transition in transitions if transition.record)
    return [earlier[index] if index in earlier else next(made) for index in range(len(jobs))]


def _store_batch(runtime: Runtime, jobs: list[Job]) -> tuple[dict[int, Job], list[Transition]]:
    """Store ``jobs`` in one atomic step, but those that exist already as the same request
    (sent before, by this batch's earlier sending or one ``enqueue``): returns those, by their
    index in ``jobs``, and the transitions of the jobs stored now. Raises
    :class:`DuplicateJob`, storing nothing, when another job has one of the ids."""
    earlier: dict[int, Job] = {}
    pending = list(range(len(jobs)))
    taken = ""
    for _ in range(runtime.store.max_conflicts):
        if not pending:
            break
        try:
            return earlier, runtime.store.create_many([jobs[i] for i in pending])
        except StoredDuplicate as exc:
            taken = exc.job_id
        records = runtime.store.get_records([jobs[i].id for i in pending])
        for index, record in zip(list(pending), records, strict=True):
            if record is None:
                continue
            if not record.job.same_request(jobs[index]):
                raise DuplicateJob(jobs[index].id, path=f"[{index}].id") from None
            earlier[index] = record.job
            pending.remove(index)
    if pending:  # the store kept refusing ids it then could not find: give up as before
        index = next((i for i in pending if jobs[i].id == taken), pending[0])
        raise DuplicateJob(taken, path=f"[{index}].id")
    return earlier, []


#: Messages of an ``enqueue_batch`` sent together (one Redis pipeline): bounds what a batch
#: holds in memory before it is sent.
PUBLISH_CHUNK = 500


def _publish_chunk(
    runtime: Runtime, transitions: list[Transition], producer: Any, broker_down: bool
) -> bool:
    """Publish what ``transitions`` owe, sent together where kombu can
    (:func:`~.producer.sent_together`), and acknowledge their outbox entries once sent;
    returns whether the broker is down. After one failed publish the rest is left to the
    sweeper at once."""
    sent: list[tuple[str, int]] = []
    try:
        with sent_together(producer):
            for transition in transitions:
                try:
                    carry_out(runtime, transition, publish_message=not broker_down,
                              raise_unpublished=True, producer=producer, acks=sent)
                except Exception as exc:
                    broker_down = broker_down or isinstance(exc, BrokerUnavailable)
                    assert transition.record is not None
                    log_unpublished(transition.record.job.id, exc)
    except Exception as exc:  # the batch was not sent, or only in part: none is acknowledged
        logger.error("ojs_celery: %d stored job(s) of a batch may not have been published (%s: "
                     "%s); the sweeper publishes them later", len(sent), type(exc).__name__, exc)
        return True
    for job_id, token in sent:
        runtime.acks.ack(job_id, token)
    return broker_down


def enqueue(envelope: dict[str, Any] | str | bytes | Job, *, app: Celery | None = None) -> Job:
    """Validate an OJS envelope, store it and publish it; return the stored job.

    Raises :class:`~ojs_celery.InvalidJob` (nothing stored or published) naming every problem:
    of the envelope, an unknown type, a queue the app does not declare; its subclass
    :class:`~ojs_celery.DuplicateJob` when a job with this client-chosen id exists with a
    different envelope (the same envelope again returns the existing job);
    :class:`~ojs_celery.StoreError` if the store cannot be reached. When it returns, the job is
    stored and will run; when it raises, nothing was stored. A message that could not be
    published (the broker is down) stays in the outbox and the sweeper publishes it: that is
    logged, not raised, so that a caller who retries never gets the job twice.
    """
    runtime = get_runtime(app)
    job = parse_input(envelope, rules=publish_rules(runtime))
    mismatch = argument_rule(runtime, job)
    if mismatch is not None:
        raise InvalidJob([("args", mismatch)])
    return enqueue_job(runtime, job, id_chosen=client_chose_id(job), checked=True)


def client_chose_id(job: Job) -> bool:
    """Whether the producer set the job's id (then it may be taken), decided from the parsed
    envelope: a key spelled with JSON escapes (``"\\u0069d"``) is the same ``id``."""
    return "id" in job.model_fields_set


def publish_rules(runtime: Runtime) -> Rules:
    """The checks an envelope needs this app for: its type is an OJS task (or mapped in
    ``type_map``) and its queue is one the app can publish to."""

    def rules(data: dict[str, Any]) -> list[tuple[str, str]]:
        queue = data.get("queue")
        return publish_violations(runtime, data.get("type"), DEFAULT_QUEUE if queue is None
                                  else queue) + beat_violations(runtime, data)

    return rules


def beat_violations(runtime: Runtime, data: dict[str, Any]) -> list[tuple[str, str]]:
    """A ``visibility_timeout`` (and, unless the handler heartbeats, a ``heartbeat_timeout``)
    shorter than twice the workers' ``heartbeat_interval`` (this app's setting): the beats that
    keep a running job alive come that far apart, so such a job would be declared stalled or
    invisible between two beats of a healthy worker, every attempt."""
    interval = runtime.settings.heartbeat_interval
    floor = 2 * interval
    found: list[tuple[str, str]] = []
    for name in ("heartbeat_timeout", "visibility_timeout"):
        value = data.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value >= floor:
            continue
        if name == "heartbeat_timeout" and _handler_heartbeats(runtime, data):
            continue
        rule = (f"must be at least {floor:g}s, twice the workers' heartbeat_interval "
                f"({interval:g}s): their beats keep a running job alive, and a shorter one "
                "ends healthy jobs between two beats")
        if name == "heartbeat_timeout":
            rule += ' (or set "x_heartbeat": "handler" and heartbeat from the handler)'
        found.append((name, rule))
    return found


def _handler_heartbeats(runtime: Runtime, data: dict[str, Any]) -> bool:
    """Whether only the handler's heartbeats count for this job (its ``x_heartbeat``, or its
    task's ``heartbeat = "handler"``)."""
    if data.get("x_heartbeat") == "handler":
        return True
    job_type = data.get("type")
    try:
        task = runtime.app.tasks[runtime.task_name_for(job_type)] if isinstance(
            job_type, str) else None
    except (UnknownType, KeyError):
        return False
    return getattr(task, "heartbeat", "worker") == "handler"


def argument_rule(runtime: Runtime, job: Job) -> str | None:
    """Why a valid job's ``args`` and ``x_celery_kwargs`` do not fit its task's signature, by
    Celery's own check (as ``.delay()`` is checked at the call): a job that could only fail
    with a ``TypeError`` is refused before it is stored. None: they fit."""
    kwargs = (job.model_extra or {}).get(CELERY_KWARGS_FIELD) or {}
    task = runtime.app.tasks.get(runtime.task_name_for(job.type))
    mismatch = None if task is None else call_mismatch(task, job.args, kwargs)
    return None if mismatch is None else f"do not fit the task's signature: {mismatch}"


def publish_violations(runtime: Runtime, job_type: Any, queue: Any) -> list[tuple[str, str]]:
    """Why a job of ``job_type`` on ``queue`` could not be published here (none: it can)."""
    found: list[tuple[str, str]] = []
    if isinstance(job_type, str):
        try:
            runtime.task_name_for(job_type)
        except UnknownType as exc:
            found.append(("type", str(exc).removeprefix("type: ")))
    if isinstance(queue, str):
        name = celery_queue(runtime.app, queue)
        queues = runtime.app.amqp.queues
        reserved = runtime.reserved_queues.get(name)
        if reserved is not None:
            found.append(("queue", f"is reserved: {name!r} is {reserved}, which no job may be "
                          "published to"))
        elif name not in queues and not getattr(queues, "create_missing", True):
            found.append(("queue", f"is not a queue the Celery app declares ({name!r} is not "
                          "in task_queues, and task_create_missing_queues is off)"))
    return found


def enqueue_job(
    runtime: Runtime, job: Job, *, id_chosen: bool = True,
    celery_options: dict[str, Any] | None = None, checked: bool = False,
) -> Job:
    """Store and publish a job that is already valid (``checked``: and whose type and queue
    :func:`publish_violations` found publishable). ``celery_options`` (``link``,
    ``link_error``) come from trusted Python code only, never from an envelope."""
    if not checked:
        violations = publish_violations(runtime, job.type, job.queue)
        if violations:
            raise InvalidJob(violations)
    check_serializer(runtime.app)
    if celery_options:
        job = with_celery_options(job, celery_options)
    shared = runtime.joint_store
    if shared is not None:  # the store is the broker's Redis: one write for record and message
        try:
            return _create_joint(runtime, shared, job)
        except StoredDuplicate:
            if not id_chosen:
                raise
            return _same_job_again(runtime, job)
    if id_chosen:
        # A client-chosen id may be taken: the store answers before anything is published.
        try:
            transition = runtime.store.create(job)
        except StoredDuplicate:
            return _same_job_again(runtime, job)
        assert transition.record is not None
        carry_out(runtime, transition)
        return transition.record.job
    # A fresh UUIDv7 cannot collide: publish while the store write is in flight (one round
    # trip instead of two). If the write fails, enqueue raises and the message already sent
    # names a job that does not exist, which a worker drops. Its outbox entry is cleared only
    # once the write is confirmed: there is none to clear otherwise. (A write left uncertain
    # that did land keeps its entry: the sweeper publishes once more, and fencing drops it.
    # So does one that landed too late for its message, see arrival.landed_in_time.)
    transition, confirm = runtime.store.begin_create(job)
    assert transition.record is not None
    unpublished: Exception | None = None
    acks: list[tuple[str, int]] = []
    if transition.publish is not None:
        try:
            publish(runtime, transition.record.job, transition.publish, record=transition.record,
                    acks=acks)
        except Exception as exc:  # the store write decides what enqueue reports
            unpublished = exc
        except BaseException:  # interrupted: Ctrl-C, gevent's Timeout, a worker's exit
            _settle_interrupted(job.id, confirm)
            raise
    confirm()  # raises if nothing was stored: the message, if sent, names no job
    if arrival.landed_in_time(transition.record.job):
        for job_id, token in acks:
            runtime.acks.ack(job_id, token)
    elif acks:
        logger.warning("ojs_celery: job %s is stored, but its insert's reply was read more "
                       "than %ss after it was made (a slow insert, or a slow publish beside "
                       "it), and a worker may have dropped its message as an orphan "
                       "meanwhile: its outbox entry stays, the sweeper publishes it once more",
                       job.id, arrival.LANDED_IN_TIME)
    runtime.emit(transition)
    if unpublished is not None:
        log_unpublished(job.id, unpublished)
    return transition.record.job


def _settle_interrupted(job_id: str, confirm: Callable[[], None]) -> None:
    """Wait for the store write of an enqueue whose publish was interrupted. The store's
    connection is held for that write until its reply is read (the fast lanes of
    ``store/redis_lane.py`` and ``store/pg_lane.py``): read, it is free for the process's next
    write. The caller sees the interrupt, not this write's outcome; a job that got stored has
    its message owed, which the sweeper publishes."""
    try:
        confirm()
    except Exception as exc:  # the interrupt is what the caller is told
        logger.warning("ojs_celery: enqueue of job %s was interrupted and its store write "
                       "failed: %r", job_id, exc)


def _same_job_again(runtime: Runtime, job: Job) -> Job:
    """The stored job that has ``job``'s id when ``job`` is the same request again (enqueue is
    idempotent); raises :class:`DuplicateJob` when another job has the id."""
    existing = runtime.store.get(job.id)
    if existing is not None and existing.same_request(job):
        return existing
    raise DuplicateJob(job.id) from None


def _create_joint(runtime: Runtime, store: RedisStore, job: Job) -> Job:
    """:func:`enqueue_job` when the store is the broker's Redis: the record and the message
    in one script (see :mod:`ojs_celery.joint`), which pushes nothing if the id is taken (the
    store's DuplicateJob; ``before_task_publish`` was sent, as for any publish that fails).
    Raises as the store write would; a publish that failed before reaching the broker leaves
    the job stored with its message owed, as in the other path."""
    from .joint import JointCreate

    transition = store.new_record(job)
    assert transition.record is not None
    joint = JointCreate(store, transition)
    unpublished: Exception | None = None
    acks: list[tuple[str, int]] = []  # owed only if the record was written before kombu's push
    if transition.publish is not None:
        with joint:
            try:
                publish(runtime, transition.record.job, transition.publish,
                        record=transition.record, acks=acks)
            except Exception as exc:
                if joint.attempted and joint.written is None:
                    raise  # the record's write failed: nothing written, nothing pushed
                if joint.written != "joint":  # the script did both: what failed after is moot
                    unpublished = exc
    joint.finish(published=unpublished is None)
    if joint.written == "first" and unpublished is None:
        for job_id, token in acks:
            runtime.acks.ack(job_id, token)
    runtime.emit(transition)
    if unpublished is not None:
        log_unpublished(job.id, unpublished)
    return transition.record.job
