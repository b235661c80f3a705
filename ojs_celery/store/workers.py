"""The worker registry: one record per worker process (OJS worker protocol registration).

A worker writes its record when it registers and with every beat; the sweeper finds workers
whose beats stopped (:meth:`WorkerRegistry.stale`), marks each one it declares dead as being
buried (:meth:`WorkerRegistry.bury`: a tombstone, which ``stale`` returns first until the
burial is done), recovers its jobs, and removes it; ``ojs-celery workers`` lists them. The
registry lives on the same backend as the jobs (see :mod:`.base`), reached as
``store.workers``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BURIED", "WorkerInfo", "WorkerRegistry"]

#: A tombstone's place in the index by last beat (its record keeps the worker's last beat):
#: before every beat, so that every sweeper's ``stale`` returns it first, whatever its cutoff.
BURIED = -1.0


@dataclass
class WorkerInfo:
    """A registered worker process (OJS worker protocol registration)."""

    worker_id: str
    hostname: str
    pid: int
    nodename: str = ""
    queues: list[str] = field(default_factory=list)
    concurrency: int = 1
    labels: list[str] = field(default_factory=list)
    #: Its pool ends an attempt at Celery's hard time limit by itself (prefork): the sweeper
    #: then leaves an attempt past its deadline to the worker clock while the worker is silent.
    #: False when not known (the record of an older version).
    time_limits: bool = False
    #: Its own ``worker_heartbeat_timeout``: a sweeper whose setting is shorter (another app
    #: on the store, a deploy that lengthened the beats) waits this long before declaring it
    #: dead. 0: not known (the record of an older version).
    heartbeat_timeout: float = 0.0
    started_at: float = 0.0
    state: str = "running"
    directive: str | None = None
    last_beat: float = 0.0
    active_job_ids: list[str] = field(default_factory=list)
    reserved_job_ids: list[str] = field(default_factory=list)
    #: Set in a tombstone (:meth:`WorkerRegistry.bury`): when a sweeper declared the worker
    #: dead (the time its recoveries are computed at, however late a pass resumes them).
    buried_at: float | None = None
    #: The nonce of that burial: the sweeper whose write's reply was lost knows it by it.
    burial: str = ""

    @property
    def buried(self) -> bool:
        """A tombstone: declared dead, its jobs being recovered (the worker itself is gone,
        or comes back to find itself not registered)."""
        return self.buried_at is not None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerInfo:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


class WorkerRegistry(ABC):
    """Worker records, indexed by last beat."""

    @abstractmethod
    def save(self, info: WorkerInfo) -> None:
        """Write a worker's record as it is: registration and every beat (last writer wins;
        each worker writes only its own record)."""

    @abstractmethod
    def get(self, worker_id: str) -> WorkerInfo | None: ...

    @abstractmethod
    def remove(self, worker_id: str, buried: bool = False) -> bool:
        """Delete the record; False if there was none. ``buried``: only a tombstone (the end
        of a burial), not the record of a worker that came back and beat meanwhile."""

    @abstractmethod
    def bury(self, tombstone: WorkerInfo) -> bool:
        """Replace a worker's record with ``tombstone`` (the record as read, ``buried_at``
        and ``burial`` set) and move its index entry to :data:`BURIED`, unless the record is
        a tombstone already or gone: True for the one caller that does (the claim among
        sweepers), and for the call that finds its own ``burial`` there (sent again after its
        reply was lost). The worker's next save, if it comes back, replaces the tombstone."""

    @abstractmethod
    def all(self) -> list[WorkerInfo]:
        """Every registered worker, by worker id."""

    @abstractmethod
    def stale(self, cutoff: float, limit: int) -> list[str]:
        """Ids of workers whose last beat is at or before ``cutoff``, oldest first (the
        tombstones first of all)."""
