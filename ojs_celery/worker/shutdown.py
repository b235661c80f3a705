"""The signals-and-drain bootstep: the graceful shutdown of the OJS worker protocol.

SIGTSTP → quiet, SIGCONT → running. SIGTERM, a first SIGINT or a ``terminate`` directive start
the drain (``shutdown_grace_period``, D): stop consuming, report ``terminate`` (beats go on), and
leave the running jobs alone to finish. A job still running ``min(its grace_period,
shutdown_cancel_window)`` before the end of the drain gets its cancellation signal (the soft
time limit: ``SoftTimeLimitExceeded``, ``ctx.cancelled``) and may save a checkpoint; what still
runs at the end is FAILed with error ``shutdown`` (retried per its policy) and its pool process
stopped; then the worker deregisters and Celery's own shutdown finishes (exit 0). A job whose
own execution timeout fires during the drain is not signalled again: it ends with ``timeout``.
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
from collections.abc import Callable
from types import FrameType
from typing import Any

from celery import bootsteps

from .. import lifecycle, softlimit
from ..effects import carry_out
from ..faults import OncePerKind
from ..header import token_of
from ..store import StoreError
from .beat import BeatStep
from .children import PoolChildrenStep
from .gate import cancel_point, start_gate
from .node import WorkerNode, anything_running, node_of, ojs_requests
from .registration import deregister

logger = logging.getLogger(__name__)

#: How often the drain looks at what still runs.
POLL = 0.05
#: How long the drain waits, after stopping its leftovers, for the pool to report them gone,
#: when Celery's soft shutdown is on (it sleeps its whole timeout if any task looks active).
LEFTOVERS_GONE = 5.0
#: How long the drain's end waits for stopped requests to publish their retries themselves (once
#: RETRY is stored): short, since it adds to a deploy's stop past the grace period it was given.
RETRIES_REPORTED = 2.0


class Drain:
    """The signal handlers of the worker's main process, and the drain they start."""

    def __init__(self, node: WorkerNode) -> None:
        self.node = node
        self.runtime = node.runtime
        self.grace = node.settings.shutdown_grace_period
        self._previous: dict[int, Any] = {}
        self._started = threading.Event()
        self._handover = False
        self._cancelled: set[str] = set()  # jobs the drain signalled
        self._faults = OncePerKind(logger, f"the shutdown drain of worker {node.worker_id}")

    @property
    def started(self) -> bool:
        return self._started.is_set()

    def install(self) -> None:
        """Chain our handlers in front of Celery's (call from the main thread, once). Python
        itself says whether this is the main thread: under eventlet's monkey patching
        ``threading.current_thread()`` is not ``threading.main_thread()`` even there."""
        handlers = ((signal.SIGTSTP, self._on_tstp), (signal.SIGCONT, self._on_cont),
                    (signal.SIGTERM, self._on_term), (signal.SIGINT, self._on_int),
                    (signal.SIGQUIT, self._on_quit))
        for signum, handler in handlers:
            previous = signal.getsignal(signum)
            try:
                signal.signal(signum, handler)
            except ValueError:  # not the main thread (an embedded worker): nothing installed
                for installed, earlier in self._previous.items():
                    signal.signal(installed, earlier)
                self._previous.clear()
                logger.warning("ojs_celery: not in the main thread: SIGTERM/SIGTSTP/SIGCONT "
                               "are left to Celery (use the terminate directive instead)")
                return
            self._previous[signum] = previous

    # ------------------------------------------------------------------ handlers

    def _on_tstp(self, signum: int, frame: FrameType | None) -> None:
        self.node.directives.apply_soon("quiet", "SIGTSTP")

    def _on_cont(self, signum: int, frame: FrameType | None) -> None:
        self.node.directives.apply_soon("running", "SIGCONT")

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        if self._handover:
            warm = self._previous.get(signal.SIGTERM)
            if callable(warm):
                warm(signum, frame)  # Celery's warm shutdown, in the main thread
            return
        if not self._started.is_set():
            self.node.directives.apply_soon("terminate", "SIGTERM")

    def _on_quit(self, signum: int, frame: FrameType | None) -> None:
        """Celery's cold shutdown, at once (its pool children ignore SIGTERM: kill them)."""
        self.node.children.kill_all()
        cold = self._previous.get(signal.SIGQUIT)
        if callable(cold):
            cold(signum, frame)

    def _on_int(self, signum: int, frame: FrameType | None) -> None:
        if self._started.is_set():  # a second Ctrl-C: Celery's cold shutdown, at once
            self._on_quit(signal.SIGQUIT, frame)
            return
        self.node.directives.apply_soon("terminate", "SIGINT")

    # ------------------------------------------------------------------ the drain

    def begin(self, source: str) -> None:
        if self._started.is_set():
            return
        self._started.set()
        node = self.node
        logger.warning("ojs_celery: worker %s shutting down (%s): draining for up to %ss",
                       node.worker_id, source, self.grace)
        node.directives.stop_consuming()
        node.beat.soon()
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
        node = self.node
        window = node.settings.cancel_window
        deadline = time.monotonic() + self.grace
        start_gate.drain_until(deadline)  # a job that would be cancelled at once: unstarted
        while anything_running() and time.monotonic() < deadline:
            remaining = deadline - time.monotonic()
            for request in ojs_requests():
                if (request.id not in self._cancelled
                        and remaining <= cancel_point(getattr(request, "time_limits", None),
                                                      window)
                        and not _own_limit_fired(request)):
                    self._each(self._cancel, request)
            time.sleep(POLL)
        leftovers = ojs_requests()
        for request in leftovers:
            self._each(self._fail, request)
        if float(node.runtime.app.conf.get("worker_soft_shutdown_timeout") or 0) > 0:
            _wait_gone(leftovers)  # or Celery's soft shutdown would sleep on them
        self._each(_publish_retries_owed, leftovers)
        self._each(deregister, node, "signal" if source.startswith("SIG") else "shutdown")
        for job_id in self._cancelled:
            self._each(node.registry.clear_draining, job_id)
        logger.warning("ojs_celery: worker %s drained (%d job(s) still running failed)",
                       node.worker_id, len(leftovers))

    def _each(self, step: Callable[..., Any], *args: Any) -> None:
        """One step of the drain; an error in it (logged once per kind) skips only that step:
        the other jobs are still cancelled or failed, and the worker still leaves on time."""
        try:
            step(*args)
        except Exception as exc:
            self._faults.failed(exc)

    def _cancel(self, request: Any) -> None:
        """Deliver the cancellation signal: the soft time limit in the job's pool process,
        marked first as the drain's (the handler then fails with ``shutdown``). Only to an
        attempt that started: see :meth:`_attempt_started`."""
        if not self._attempt_started(request):
            return  # looked at again at the next poll
        self._cancelled.add(request.id)
        pid = getattr(request, "worker_pid", None)
        in_child = pid is not None and self.node.children.holds(pid)
        if not in_child and not softlimit.runs_here(request.id):
            return  # solo/threads pools run jobs in this process, eventlet in greenlets
        try:
            self.node.registry.mark_draining(request.id)
            if pid is not None and in_child:
                os.kill(pid, signal.SIGUSR1)
            else:
                softlimit.cancel(request.id)  # a gevent greenlet's
            logger.warning("ojs_celery: cancelling job %s for the shutdown", request.id)
        except (OSError, StoreError) as exc:
            logger.warning("ojs_celery: could not cancel job %s: %s", request.id, exc)

    def _attempt_started(self, request: Any) -> bool:
        """Has this message's attempt started (the store shows its job active with the
        message's token)? One that reached its pool process after its cancellation point
        never does: the start gate sends it back, and a signal meanwhile would land in Celery's
        handling of that, as a traceback. True when the store cannot say."""
        try:
            record = self.runtime.store.get_record(request.id)
        except StoreError:
            return True
        return (record is not None and record.token == token_of(request)
                and record.job.state == "active")

    def _fail(self, request: Any) -> None:
        """FAIL a job still running at the end of the drain, then stop it: ``shutdown``, or
        ``timeout`` when its own execution timeout fired first (and the drain sent nothing)."""
        token = token_of(request)
        if token is None:
            return
        if _own_limit_fired(request) and request.id not in self._cancelled:
            elapsed = time.time() - float(request.time_start)
            soft = float(request.time_limits[1])
            error = lifecycle.timeout_error(
                "timeout", soft, elapsed,
                f"execution timeout of {soft:g}s exceeded, and the worker shut down")
        else:
            error = lifecycle.make_error(
                "shutdown", f"the worker shut down and its grace period of {self.grace}s "
                "ended before the job finished")
        try:
            done = self.runtime.store.fail_token(request.id, token, self.node.worker_id, error)
        except StoreError as exc:
            logger.error("ojs_celery: could not fail job %s at shutdown (the sweeper will "
                         "recover it): %s", request.id, exc)
            done = None
        if done is not None and done.record is not None:
            # The drain made the transition, so it reports it (discarded: FAILURE), once:
            # the request then acks the stopped process without Celery's REVOKED, storing a
            # retry's RETRY before it publishes the next attempt (OJSRequest.ojs_carry_out).
            settled = getattr(request, "ojs_settled", None)
            if callable(settled):
                settled(self.runtime, done)
            else:
                carry_out(self.runtime, done, report_result=True, worker_request=request)
        if not self.node.children.kill(getattr(request, "worker_pid", None)):
            _publish_owed(request)  # no pool process stopped: the request writes no RETRY

    def _hand_over_to_celery(self) -> None:
        """Celery's own warm shutdown, in the main thread (nothing is left to wait for)."""
        if callable(self._previous.get(signal.SIGTERM)):
            self._handover = True
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.node.consumer.controller.stop(in_sighandler=False)


def _own_limit_fired(request: Any) -> bool:
    """Has the job's own soft time limit (its execution timeout) already been sent?"""
    soft = (getattr(request, "time_limits", None) or (None, None))[1]
    started = getattr(request, "time_start", None)
    return bool(soft and started and time.time() >= float(started) + float(soft))


def _publish_owed(request: Any) -> bool:
    """Publish the next attempt's message that ``request`` still holds (see
    ``OJSRequest.ojs_carry_out``); whether one was."""
    publish = getattr(request, "ojs_publish_owed", None)
    return callable(publish) and bool(publish())


def _publish_retries_owed(requests: list[Any]) -> None:
    """The retries of the drained ``requests`` whose messages are still held: each stopped
    request publishes its own once Celery's result backend has its RETRY (when the pool
    reports the stopped process, ``OJSRequest._ack_without_failure``). One that has not
    reported within :data:`RETRIES_REPORTED` (the pool never reports it, or its attempt ended
    otherwise: a handler that returned meanwhile, whose outcome the store rejected) is
    published here, before the worker leaves: not left in the outbox for the sweeper, which
    would send it only after ``dispatch_grace``, or never with no sweeper running. Either way
    once: the request gives its message up to whichever publishes it first."""
    owing = [request for request in requests if getattr(request, "ojs_owes", lambda: False)()]
    if not owing:
        return
    limit = time.monotonic() + RETRIES_REPORTED
    while time.monotonic() < limit:
        active = {r.id for r in ojs_requests()}
        if not [r for r in owing if r.ojs_owes() and r.id in active]:
            break
        time.sleep(POLL)
    for request in owing:
        _publish_owed(request)


def _wait_gone(requests: list[Any]) -> None:
    """Wait (bounded) until the pool has reported the stopped ``requests`` gone."""
    ids = {r.id for r in requests}
    limit = time.monotonic() + LEFTOVERS_GONE
    while ids and time.monotonic() < limit:
        if not ids & {r.id for r in ojs_requests()}:
            return
        time.sleep(POLL)


class DrainStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Installs the signal handlers (main thread, once) and gives the worker its drain."""

    requires = (BeatStep, PoolChildrenStep)
    label = "OJS signals and drain"

    def start(self, parent: Any) -> None:
        node = node_of(parent)
        if getattr(node, "drain", None) is None:
            node.drain = Drain(node)
            node.drain.install()
