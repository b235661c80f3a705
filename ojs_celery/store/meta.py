"""The meta area: small values that processes leave for each other in the store.

A sweeper records when it last ran (a worker warns when sweeps stop); ``ojs-celery workers
quiet`` leaves a one-shot directive that the worker takes with its next beat; a draining worker
marks each job it cancels, so that the job, cancelled in its pool process, fails with
``shutdown``, not ``timeout``; sweepers keep the mark that shows a Redis broker lost its data,
and the republishing under way after a loss (:class:`BrokerMark`). Every key is named here and
nowhere else: callers use the typed methods. The area lives on the same backend as the jobs
(see :mod:`.base`), reached as ``store.meta``.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, replace

from ..lifecycle import BlindSpell

__all__ = ["BrokerMark", "MetaArea"]

#: When the last sweep pass ended (epoch seconds, ``repr`` of a float).
LAST_SWEEP = "last_sweep"
#: When a sweeper last reached the store (wall-clock epoch seconds), and the last blind spell:
#: the last gap between two such contacts long enough to hide the workers' beats
#: (``"start,end"``; see :meth:`MetaArea.record_contact`).
LAST_CONTACT = "last_contact"
BLIND_SPELL = "blind_spell"
#: The broker of the last worker that started on this store (see :meth:`MetaArea.note_broker`).
BROKER = "broker"
#: The sweepers' mark of the broker's data, and the republishing under way after a loss
#: (:class:`BrokerMark`, JSON).
BROKER_MARK = "broker_mark"


@dataclass(frozen=True)
class BrokerMark:
    """What the store knows of the broker's data (see ``ojs_celery.sweeper``): ``mark``, the
    random value the broker holds too while it keeps its data; after a loss, ``lost_before``
    (the jobs published before it are republished), the ``cursor`` of that scan of the waiting
    jobs and how many were ``republished`` so far. ``stored`` is the value as read, which a
    compare-and-set must still find."""

    mark: str
    lost_before: float | None = None
    cursor: str | None = None
    republished: int = 0
    stored: str | None = None

    @property
    def republishing(self) -> bool:
        return self.lost_before is not None

    def encode(self) -> str:
        return json.dumps({"mark": self.mark, "lost_before": self.lost_before,
                           "cursor": self.cursor, "republished": self.republished})

    @classmethod
    def decode(cls, text: str) -> BrokerMark:
        """A value that does not read (written by hand) is a mark no broker holds: the next
        check replaces it, republishing what waits (harmless copies)."""
        try:
            value = json.loads(text)
            return cls(str(value["mark"]), value.get("lost_before"), value.get("cursor"),
                       int(value.get("republished") or 0), text)
        except (ValueError, TypeError, KeyError):
            return cls("", stored=text)


def directive_key(worker_id: str) -> str:
    """A directive waiting for ``worker_id``'s next beat (``quiet``, ``resume``, ``terminate``)."""
    return f"directive:{worker_id}"


def draining_key(worker_id: str, job_id: str) -> str:
    """Present once ``worker_id``'s shutdown drain has sent ``job_id`` its cancellation."""
    return f"shutdown:{worker_id}:{job_id}"


class MetaArea(ABC):
    """Typed values over the primitives a backend provides for a string key-value area (put,
    get, take, drop, swap)."""

    @abstractmethod
    def _put(self, key: str, value: str) -> None: ...

    @abstractmethod
    def _get(self, key: str) -> str | None: ...

    @abstractmethod
    def _take(self, key: str) -> str | None:
        """Read and delete a value in one atomic step: of several takers, one gets it."""

    @abstractmethod
    def _drop(self, key: str, expected: str) -> bool:
        """Delete the key if it still holds ``expected``, in one atomic step; False if not
        (deleted already, or replaced)."""

    @abstractmethod
    def _swap(self, key: str, expected: str | None, value: str) -> bool:
        """Write ``value`` if the key still holds ``expected`` (None: no value), in one atomic
        step: of several writers from the same value, one wins (on Redis, a key that holds
        ``value`` already counts as written: the same swap sent again by redis-py after its
        reply was lost finds it so)."""

    # ------------------------------------------------------------------ directives

    def send_directive(self, worker_id: str, directive: str) -> None:
        """Leave ``directive`` for the worker (it replaces one not yet taken)."""
        self._put(directive_key(worker_id), directive)

    def take_directive(self, worker_id: str) -> str | None:
        """The directive waiting for ``worker_id``, at least once: read, then deleted if it is
        still the one read. A delete whose reply was lost (done or not) still returns the
        directive; one not done returns it again at the next beat, which is harmless (a
        directive sets a state: quiet, running, terminate). A delete the store refused (an
        error reply: read-only, no permission) raises, the directive left for a later beat.
        A read and delete in one step lost the directive with its reply: redis-py sent it
        again, which found nothing, and a PostgreSQL beat failed after the delete was done."""
        from .base import StoreError, answered  # base imports this module

        key = directive_key(worker_id)
        directive = self._get(key)
        if directive is not None:
            try:
                self._drop(key, directive)
            except StoreError as failure:
                if answered(failure):
                    raise
        return directive

    def pending_directive(self, worker_id: str) -> str | None:
        """The directive waiting for ``worker_id``, left in place (for display)."""
        return self._get(directive_key(worker_id))

    def forget_worker(self, worker_id: str, job_ids: Iterable[str] = ()) -> None:
        """Delete what was left for a worker that is gone: a directive it never took, and the
        drain's marks of ``job_ids`` (its jobs, if it died draining). Nothing else removes
        them, and every worker id is new."""
        self._take(directive_key(worker_id))
        for job_id in job_ids:
            self._take(draining_key(worker_id, job_id))

    def note_broker(self, broker: str) -> str | None:
        """Record the broker of a worker starting on this store; returns the one recorded
        before when it differs. A store shared by apps or environments on different brokers
        has each one's sweepers publish the others' jobs to their own broker, where their
        workers run them: the store says whose a job is nowhere else."""
        before = self._get(BROKER)
        if before == broker:
            return None
        self._put(BROKER, broker)
        return before

    # ------------------------------------------------------------------ shutdown drain

    def mark_draining(self, worker_id: str, job_id: str) -> None:
        """The drain cancels ``job_id``: its cancellation is a ``shutdown``."""
        self._put(draining_key(worker_id, job_id), "1")

    def clear_draining(self, worker_id: str, job_id: str) -> None:
        self._take(draining_key(worker_id, job_id))

    def is_draining(self, worker_id: str, job_id: str) -> bool:
        return self._get(draining_key(worker_id, job_id)) is not None

    # ------------------------------------------------------------------ sweeps

    def record_sweep(self, at: float) -> None:
        self._put(LAST_SWEEP, repr(float(at)))

    def last_sweep(self) -> float | None:
        """When the last sweep pass ended, or None if none ever did."""
        value = self._get(LAST_SWEEP)
        return float(value) if value else None

    def record_contact(self, wall: float | None, blind_after: float) -> BlindSpell | None:
        """A sweeper reached the store at ``wall`` (its clock, like the workers' beats; None:
        when the store answered this call's first request); returns the last blind spell: the
        last time ``blind_after`` seconds or more passed between two contacts. The store, or
        every sweeper, was away then, and a beat not seen in that time may never have reached
        the store (a Redis pause stops the beats and the sweeps alike).

        A sweeper's contact is the time of the answer, not of the question: a pass that asked
        during a pause of the store is answered only when the pause ends, and a contact
        stamped before that would split the pause in two spells, of which only the last is
        kept (the first part's silence would then count against live workers)."""
        last = self._get(LAST_CONTACT)
        if wall is None:
            wall = time.time()
        if last and wall - float(last) >= blind_after:
            self._put(BLIND_SPELL, f"{float(last)!r},{float(wall)!r}")
        self._put(LAST_CONTACT, repr(float(wall)))
        spell = self._get(BLIND_SPELL)
        if not spell:
            return None
        start, _, end = spell.partition(",")
        return BlindSpell(float(start), float(end))

    # ------------------------------------------------------------------ the broker's data

    def broker_mark(self) -> BrokerMark | None:
        """The sweepers' mark of the broker's data, None before the first check."""
        value = self._get(BROKER_MARK)
        return BrokerMark.decode(value) if value else None

    def swap_broker_mark(self, before: BrokerMark | None, after: BrokerMark) -> BrokerMark | None:
        """Replace ``before`` (as read: None, nothing) by ``after``; ``after`` as stored, or
        None when another sweeper changed it first."""
        stored = after.encode()
        if not self._swap(BROKER_MARK, None if before is None else before.stored, stored):
            return None
        return replace(after, stored=stored)
