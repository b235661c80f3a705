"""The soft time limit of an OJS attempt: it marks the running job cancelled, and it is held
while the attempt's bookkeeping runs. On the prefork pool billiard's limit is watched; on the
gevent pool, where Celery enforces no soft limit, this module raises it itself.

billiard raises ``SoftTimeLimitExceeded`` wherever the child's main thread happens to be when
the limit's signal arrives. Raised inside the store write that starts an attempt, it left the job
``available`` at attempt 0 with its message acked (no clock ever moved it again); raised inside
the outcome's write, it left a finished attempt ``active``. So :class:`OJSTask` holds the limit
from the message's arrival to the handler's first line, and again from the handler's return to
the end of the outcome's write: a limit that fires meanwhile is noted, and takes effect when the
handler is entered (the attempt has started: it times out at once) or is moot when the handler
has already returned (its outcome stands). The hard limit, which kills the child, is not held:
the main process fails the attempt by its token (see :mod:`ojs_celery.request`).

Celery's gevent pool applies the hard limit only (gevent's ``Timeout``, at the handler's next
switch) and drops the soft one, so an OJS handler there got neither its timeout's cancellation
nor the drain's. Each attempt's greenlet gets a hold of its own and a timer on gevent's loop for
the soft limit (counted, as billiard's, from the attempt's arrival in the task); when it fires
the job is marked cancelled and, unless held, ``SoftTimeLimitExceeded`` is thrown into the
greenlet, at its next switch, as gevent's own ``Timeout`` is. The drain delivers the same
(:func:`cancel`). Eventlet's pool is left as Celery has it.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import Any

import billiard.pool
from billiard.exceptions import SoftTimeLimitExceeded

from .context import job_in, maybe_current_job


class _Hold:
    """Whether an attempt's soft limit is only noted now, and whether it fired meanwhile."""

    __slots__ = ("fired", "greenlet", "held", "job_id", "timer")

    def __init__(self, job_id: str = "", greenlet: Any = None) -> None:
        self.held = False
        self.fired = False
        self.job_id = job_id
        #: gevent: the attempt's greenlet, where a limit that fires is raised, and its timer.
        self.greenlet = greenlet
        self.timer: Any = None


#: A prefork child's, or any pool's that runs one task at a time in a thread (billiard's signal
#: reaches only the main thread, so other threads' holds are never read).
_hold = _Hold()
#: gevent: the hold of each attempt running in this process, by its greenlet.
_greenlet_holds: dict[Any, _Hold] = {}
_installed = False


def begin(job_id: str, timelimit: Any) -> None:
    """An OJS attempt of ``job_id`` arrives in this process (or greenlet), with Celery's
    ``request.timelimit`` (hard, soft): from now on its soft limit is held."""
    _watch_billiard()
    greenlet = _gevent_greenlet()
    if greenlet is None:
        _hold.held = True
        return
    hold = _Hold(job_id, greenlet)
    hold.held = True
    soft = _soft_seconds(timelimit)
    if soft is not None:  # it cannot fire before this greenlet yields
        hold.timer = _gevent_loop().timer(soft)
        hold.timer.start(_fire, hold)
    _greenlet_holds[greenlet] = hold  # last: nothing is left behind if the timer failed


def hold() -> None:
    """From now on a soft limit that fires is only noted."""
    _current().held = True


def release() -> None:
    """Stop holding; raise ``SoftTimeLimitExceeded`` if the limit fired while held."""
    current = _current()
    current.held = False
    if current.fired:
        current.fired = False
        raise SoftTimeLimitExceeded()


def forget() -> None:
    """The attempt is over: stop holding, and forget a limit that fired too late to matter."""
    current = _current()
    current.held = False
    current.fired = False
    if current.greenlet is not None:
        if current.timer is not None:
            current.timer.close()
        _greenlet_holds.pop(current.greenlet, None)


def runs_here(job_id: str) -> bool:
    """Whether an attempt of ``job_id`` runs in a gevent greenlet of this process."""
    return _greenlet_hold(job_id) is not None


def cancel(job_id: str) -> None:
    """Deliver the soft limit now to ``job_id``'s attempt in a gevent greenlet of this process
    (the drain's cancellation), from gevent's loop."""
    hold = _greenlet_hold(job_id)
    if hold is not None:
        _gevent_loop().run_callback(_fire, hold)


def _greenlet_hold(job_id: str) -> _Hold | None:
    return next((hold for hold in list(_greenlet_holds.values()) if hold.job_id == job_id),
                None)


def _current() -> _Hold:
    """The hold of the attempt running here: its greenlet's on gevent, else the process's."""
    if _greenlet_holds:
        held = _greenlet_holds.get(_gevent_greenlet())
        if held is not None:
            return held
    return _hold


def _gevent_greenlet() -> Any:
    """The gevent greenlet this code runs in (a task on Celery's gevent pool), else None."""
    gevent = sys.modules.get("gevent")
    if gevent is None:
        return None
    current = gevent.getcurrent()
    return current if isinstance(current, gevent.Greenlet) else None


def _gevent_loop() -> Any:
    """gevent's event loop in this thread (gevent is imported: a greenlet of it runs here)."""
    return sys.modules["gevent"].get_hub().loop


def _soft_seconds(timelimit: Any) -> float | None:
    """The soft limit of Celery's ``(hard, soft)``; None when there is none."""
    try:
        soft = timelimit[1]
    except (TypeError, IndexError):
        return None
    return float(soft) if soft else None


def _fire(hold: _Hold) -> None:
    """gevent's loop, when an attempt's soft limit is reached (or the drain cancels it): as
    billiard's handler, chained below, does in a prefork child."""
    greenlet = hold.greenlet
    if greenlet is None or greenlet.dead or _greenlet_holds.get(greenlet) is not hold:
        return  # the attempt is over
    context = getattr(greenlet, "gr_context", None)
    ctx = job_in(context) if context is not None else None
    if ctx is not None:
        ctx.cancelled = True
    if hold.held:
        hold.fired = True
        return
    greenlet.throw(SoftTimeLimitExceeded())


def _watch_billiard() -> None:
    """Chain in front of billiard's soft-limit handler (once per process): mark the current job
    cancelled before the handler raises, and only note the limit while it is held.

    billiard gives no hook for this: a prefork child installs its own handler,
    ``billiard.pool.soft_timeout_sighandler``, for ``billiard.pool.SIG_SOFT_TIMEOUT`` (SIGUSR1)
    in ``Worker.after_fork``; we chain in front of it when, and only when, that exact function
    is installed (any other pool, or a handler of the project's own, is left alone). Checked on
    Celery 5.7.0 with billiard 4.3.2.
    """
    global _installed
    if _installed:
        return
    _installed = True
    signum = getattr(billiard.pool, "SIG_SOFT_TIMEOUT", None)
    billiard_handler: Callable[[int, Any], None] | None = getattr(
        billiard.pool, "soft_timeout_sighandler", None)
    if signum is None or billiard_handler is None:
        return
    chained = billiard_handler
    try:
        previous = signal.getsignal(signum)
    except ValueError:
        return
    if previous is not billiard_handler:
        return  # not a prefork child: no soft limit to watch

    def on_soft_limit(signum: int, frame: Any) -> None:
        ctx = maybe_current_job()
        if ctx is not None:
            ctx.cancelled = True
        if _hold.held:
            _hold.fired = True
            return
        chained(signum, frame)

    try:
        signal.signal(signum, on_soft_limit)
    except ValueError:  # not the main thread (threads pool): nothing to watch
        pass
