"""Prefork children ignore SIGTSTP and SIGTERM, so that a signal sent to the whole process group
(Ctrl-Z, or systemd's SIGTERM) lets the main process drain instead of killing running jobs.

``SIG_IGN`` is the one disposition billiard keeps when it resets a child's signals after
``worker_process_init``. Billiard still stops a child at a hard time limit (it follows SIGTERM
with SIGKILL after 0.1 s), and on a cold shutdown the main process kills its children itself,
since they no longer obey the SIGTERM that Celery would send them.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

logger = logging.getLogger(__name__)

_main_pid: int | None = None


def prepare() -> None:
    """In the main process, before the pool forks."""
    global _main_pid
    _main_pid = os.getpid()


def protect_child() -> None:
    """In each pool child (``worker_process_init``; the solo pool sends it in the main
    process, which keeps its handlers)."""
    if _main_pid is None or os.getpid() == _main_pid:
        return
    signal.signal(signal.SIGTSTP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def kill_children(pool: Any) -> None:
    """Cold shutdown: stop every pool process now (they ignore SIGTERM)."""
    inner = getattr(pool, "_pool", None)
    for process in list(getattr(inner, "_pool", None) or []):
        pid = getattr(process, "pid", None)
        if pid and pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError as exc:
                logger.debug("ojs_celery: kill child %s: %r", pid, exc)
