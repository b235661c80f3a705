"""``install(app)``: wire OJS into a Celery app (idempotent)."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, signals

from .identity import assign_worker_id
from .runtime import Runtime, attach, get_runtime

logger = logging.getLogger(__name__)

#: Pools whose time limits Celery does not enforce, and what is missing there.
_WEAK_POOLS = {
    "solo": "soft and hard time limits",
    "threads": "soft and hard time limits",
    "thread": "soft and hard time limits",
    "gevent": "the soft time limit (and the hard one for blocking code)",
    "eventlet": "soft and hard time limits",
}


def pool_name(pool_cls: Any) -> str:
    text = pool_cls if isinstance(pool_cls, str) else getattr(pool_cls, "__module__", "")
    return str(text).rsplit(".", 1)[-1].rsplit(":", 1)[0]


def install(app: Celery) -> Runtime:
    """Make ``app`` an OJS job system; reads and validates ``app.conf.ojs``.

    Raises ``celery.exceptions.ImproperlyConfigured`` naming the first bad setting.
    """
    existing = getattr(app, "_ojs_runtime", None)
    if existing is not None:
        return existing  # type: ignore[no-any-return]
    runtime = attach(app)

    def on_worker_init(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        worker_id = assign_worker_id()
        name = pool_name(getattr(sender, "pool_cls", ""))
        logger.info("ojs_celery: worker id %s (pool %s)", worker_id, name)
        missing = _WEAK_POOLS.get(name)
        if missing:
            logger.warning(
                "ojs_celery: the %s pool does not enforce %s: OJS execution timeouts on this "
                "worker are enforced only by the sweeper (run `celery beat` or "
                "`ojs-celery sweep --loop`), and a timed-out handler is not interrupted. "
                "Use the prefork pool for worker-side timeouts.",
                name, missing,
            )

    def on_child_shutdown(**_: Any) -> None:
        get_runtime(app).bus.flush()

    signals.worker_init.connect(on_worker_init, weak=False)
    signals.worker_process_shutdown.connect(on_child_shutdown, weak=False)
    app._ojs_signal_receivers = (on_worker_init, on_child_shutdown)
    return runtime
