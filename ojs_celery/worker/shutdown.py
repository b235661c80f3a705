"""Signals and the graceful shutdown of the OJS worker protocol.

SIGTSTP → quiet, SIGCONT → running. SIGTERM, a first SIGINT or a ``terminate`` directive → stop
consuming, report ``terminate`` (beats go on), and wait for the running jobs up to the worker
shutdown grace period; a job still running gets its cancellation signal (the soft time limit,
``ctx.cancelled``) early enough to have its own ``grace_period`` (or what remains of the drain)
before the end; then it is FAILed with error ``shutdown`` and retried per its policy, its pool
process is stopped, the worker deregisters and Celery's own warm shutdown finishes (exit 0).
A second SIGINT, or SIGQUIT, stays Celery's immediate cold shutdown.

Celery's warm shutdown would wait for tasks without a bound, and its soft shutdown sleeps the
whole timeout inside the signal handler; here the handler only starts a thread, and the worker
leaves as soon as its jobs are done.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any

from celery.worker import state as worker_state

from .. import lifecycle
from ..effects import carry_out
from ..header import token_of
from ..store import StoreError
from . import children
from .agent import WorkerAgent, ojs_requests

logger = logging.getLogger(__name__)

#: How often the drain looks at what still runs.
POLL = 0.05


class GracefulShutdown:
    """Installs the signal handlers in the worker's main process and runs the drain."""

    def __init__(self, agent: WorkerAgent) -> None:
        self.agent = agent
        self.runtime = agent.runtime
        self.grace = agent.settings.shutdown_grace_period
        self._previous: dict[int, Any] = {}
        self._started = threading.Event()
        self._handover = False
        agent.on_terminate = self.begin

    @property
    def started(self) -> bool:
        return self._started.is_set()

    def install(self) -> None:
        """Chain our handlers in front of Celery's (call from the main thread, once)."""
        if threading.current_thread() is not threading.main_thread():
            logger.warning("ojs_celery: not in the main thread: SIGTERM/SIGTSTP/SIGCONT are "
                           "left to Celery (use the terminate directive instead)")
            return
        for signum, handler in ((signal.SIGTSTP, self._on_tstp), (signal.SIGCONT, self._on_cont),
                                (signal.SIGTERM, self._on_term), (signal.SIGINT, self._on_int),
                                (signal.SIGQUIT, self._on_quit)):
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, handler)

    # ------------------------------------------------------------------ handlers

    def _on_tstp(self, signum: int, frame: FrameType | None) -> None:
        threading.Thread(target=self.agent.apply, args=("quiet", "SIGTSTP"), daemon=True).start()

    def _on_cont(self, signum: int, frame: FrameType | None) -> None:
        threading.Thread(target=self.agent.apply, args=("running", "SIGCONT"),
                         daemon=True).start()

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        if self._handover:
            warm = self._previous.get(signal.SIGTERM)
            if callable(warm):
                warm(signum, frame)  # Celery's warm shutdown, in the main thread
            return
        if not self._started.is_set():
            threading.Thread(target=self.agent.apply, args=("terminate", "SIGTERM"),
                             daemon=True).start()

    def _on_quit(self, signum: int, frame: FrameType | None) -> None:
        """Celery's cold shutdown, at once (its pool children ignore SIGTERM: kill them)."""
        children.kill_children(self.agent.consumer.pool)
        cold = self._previous.get(signal.SIGQUIT)
        if callable(cold):
            cold(signum, frame)

    def _on_int(self, signum: int, frame: FrameType | None) -> None:
        if self._started.is_set():  # a second Ctrl-C: Celery's cold shutdown, at once
            self._on_quit(signal.SIGQUIT, frame)
            return
        threading.Thread(target=self.agent.apply, args=("terminate", "SIGINT"),
                         daemon=True).start()

    # ------------------------------------------------------------------ the drain

    def begin(self, source: str) -> None:
        if self._started.is_set():
            return
        self._started.set()
        logger.warning("ojs_celery: worker %s shutting down (%s): draining for up to %ss",
                       self.agent.worker_id, source, self.grace)
        self.agent.stop_consuming()
        self.agent.beat_soon()
        threading.Thread(target=self._drain, args=(source,), name="ojs-drain",
                         daemon=True).start()

    def _drain(self, source: str) -> None:
        """Wait, cancel, fail what is left, leave; whatever goes wrong, Celery gets the end."""
        try:
            self._wait_and_fail(source)
        except Exception:
            logger.exception("ojs_celery: the shutdown drain failed; stopping the worker")
        finally:
            self._hand_over_to_celery()

    def _wait_and_fail(self, source: str) -> None:
        deadline = time.monotonic() + self.grace
        signalled: set[str] = set()
        while _snapshot_active() and time.monotonic() < deadline:
            remaining = deadline - time.monotonic()
            for request in ojs_requests():
                if request.id not in signalled and remaining <= _job_grace(request):
                    signalled.add(request.id)
                    self._cancel(request)
            time.sleep(POLL)
        leftovers = ojs_requests()
        for request in leftovers:
            self._fail(request)
        reason = "signal" if source.startswith("SIG") else "shutdown"
        self.agent.deregister(reason)
        try:
            self.runtime.store.meta.clear_draining(self.agent.worker_id)
        except StoreError:
            pass
        logger.warning("ojs_celery: worker %s drained (%d job(s) failed with `shutdown`)",
                       self.agent.worker_id, len(leftovers))

    def _cancel(self, request: Any) -> None:
        """Deliver the cancellation signal: the soft time limit in the job's pool process."""
        pid = getattr(request, "worker_pid", None)
        if not pid or pid == os.getpid():
            return  # solo/threads pools run jobs in this process: nothing to interrupt
        try:
            self.runtime.store.meta.mark_draining(self.agent.worker_id)
            os.kill(pid, signal.SIGUSR1)
            logger.warning("ojs_celery: cancelling job %s for the shutdown", request.id)
        except (OSError, StoreError) as exc:
            logger.warning("ojs_celery: could not cancel job %s: %s", request.id, exc)

    def _fail(self, request: Any) -> None:
        """FAIL a job still running at the end of the drain (error ``shutdown``), then stop it."""
        token = token_of(request)
        if token is None:
            return
        error = lifecycle.make_error(
            "shutdown", f"the worker shut down and its grace period of {self.grace}s ended "
            "before the job finished")
        try:
            done = self.runtime.store.fail_token(request.id, token, self.agent.worker_id, error)
        except StoreError as exc:
            logger.error("ojs_celery: could not fail job %s at shutdown (the sweeper will "
                         "recover it): %s", request.id, exc)
            done = None
        if done is not None and done.record is not None:
            carry_out(self.runtime, done)
        pid = getattr(request, "worker_pid", None)
        if pid and pid != os.getpid():
            try:
                self.agent.consumer.pool.terminate_job(pid, signal.SIGKILL)
            except (NotImplementedError, OSError) as exc:
                logger.warning("ojs_celery: could not stop job %s: %r", request.id, exc)

    def _hand_over_to_celery(self) -> None:
        """Celery's own warm shutdown, in the main thread (nothing is left to wait for)."""
        if callable(self._previous.get(signal.SIGTERM)):
            self._handover = True
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.agent.consumer.controller.stop(in_sighandler=False)


def _snapshot_active() -> bool:
    return bool(worker_state.active_requests)


def _job_grace(request: Any) -> float:
    """The job's own grace period, from its time limits (hard − soft)."""
    hard, soft = getattr(request, "time_limits", (None, None)) or (None, None)
    if hard and soft:
        return float(hard) - float(soft)
    return 0.0
