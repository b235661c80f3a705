"""Every store call of the worker protocol about the worker itself, in one place.

The worker's record in the registry, its one-shot directive and its "draining" mark live in the
store's worker and meta areas; the bootsteps reach them only through :class:`Registry`, so that
a change of the store's worker/meta API is a change of this module alone. Job writes (extend,
fail) stay with the job store.
"""

from __future__ import annotations

from ..runtime import Runtime
from ..store import WorkerInfo

#: The one-shot directives an operator can leave for a worker (``ojs-celery workers ...``).
DIRECTIVES = ("quiet", "resume", "terminate")


class Registry:
    """One worker's record, directive and draining mark (raises ``StoreError`` as the store)."""

    def __init__(self, runtime: Runtime, worker_id: str) -> None:
        self.runtime = runtime
        self.worker_id = worker_id

    def register(self, info: WorkerInfo) -> None:
        self.runtime.store.workers.save(info)

    def beat(self, info: WorkerInfo) -> tuple[str | None, bool]:
        """Save the beat; returns the pending directive (taken) and whether the worker was
        still registered before this beat (False: it was declared dead meanwhile, its record
        gone or a tombstone, which this save replaces). The directive is taken last: a beat
        that fails before (its save refused) leaves it for the next beat, where taking it
        first lost it with the failed beat."""
        store = self.runtime.store
        found = store.workers.get(self.worker_id)
        known = found is not None and not found.buried
        store.workers.save(info)
        return store.meta.take_directive(self.worker_id), known

    def deregister(self) -> None:
        self.runtime.store.remove_worker(self.worker_id)

    def mark_draining(self, job_id: str) -> None:
        self.runtime.store.meta.mark_draining(self.worker_id, job_id)

    def clear_draining(self, job_id: str) -> None:
        self.runtime.store.meta.clear_draining(self.worker_id, job_id)
