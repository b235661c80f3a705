"""The consumer bootstep that runs the OJS worker protocol inside ``celery worker``."""

from __future__ import annotations

from typing import Any

from celery import bootsteps
from celery.worker import state as worker_state

from ..runtime import get_runtime
from .agent import WorkerAgent
from .shutdown import GracefulShutdown


class OJSWorkerStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Registration, BEAT, directives and signals (added by ``install``)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)
    label = "OJS worker protocol"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.agent: WorkerAgent | None = None
        self.drain: GracefulShutdown | None = None

    def start(self, parent: Any) -> None:
        if self.agent is not None:
            return  # consumer restarts (broker reconnects) start steps again
        self.agent = WorkerAgent(get_runtime(parent.app), parent)
        self.drain = GracefulShutdown(self.agent)
        self.drain.install()
        self.agent.start()

    def stop(self, parent: Any) -> None:
        if worker_state.should_stop or worker_state.should_terminate:
            self._leave()

    def shutdown(self, parent: Any) -> None:
        self._leave()

    def _leave(self) -> None:
        """A shutdown that did not go through the drain (Celery's own, e.g. the ``shutdown``
        remote-control command): deregister so that nobody declares this worker dead."""
        agent, self.agent = self.agent, None
        if agent is not None and not (self.drain is not None and self.drain.started):
            agent.deregister("shutdown")
