"""The soft time limit in a prefork child: it marks the running job cancelled, and it is held
while the attempt's bookkeeping runs.

billiard raises ``SoftTimeLimitExceeded`` wherever the child's main thread happens to be when
the limit's signal arrives. Raised inside the store write that starts an attempt, it left the job
``available`` at attempt 0 with its message acked (no clock ever moved it again); raised inside
the outcome's write, it left a finished attempt ``active``. So :class:`OJSTask` holds the limit
from the message's arrival to the handler's first line, and again from the handler's return to
the end of the outcome's write: a limit that fires meanwhile is noted, and takes effect when the
handler is entered (the attempt has started: it times out at once) or is moot when the handler
has already returned (its outcome stands). The hard limit, which kills the child, is not held:
the main process fails the attempt by its token (see :mod:`ojs_celery.request`).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import billiard.pool
from billiard.exceptions import SoftTimeLimitExceeded

from .context import maybe_current_job


class _Hold:
    """One per process: a prefork child runs one task at a time, in its main thread."""

    held = False
    fired = False


_hold = _Hold()
_installed = False


def hold() -> None:
    """From now on a soft limit that fires is only noted."""
    _hold.held = True


def release() -> None:
    """Stop holding; raise ``SoftTimeLimitExceeded`` if the limit fired while held."""
    _hold.held = False
    if _hold.fired:
        _hold.fired = False
        raise SoftTimeLimitExceeded()


def forget() -> None:
    """The attempt is over: stop holding, and forget a limit that fired too late to matter."""
    _hold.held = False
    _hold.fired = False


def watch() -> None:
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
