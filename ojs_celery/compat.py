"""What differs between the Celery, kombu and redis-py versions ojs_celery supports.

Supported: Celery 5.4 to 5.7, each with the kombu of its minor (5.4.x to 5.7.x), billiard 4.2
to 4.3, and redis-py 5.0 to 8.x (kombu 5.5's Redis extra caps redis-py at 5.2.1, kombu 5.7's
asks for 6.4 or later). Each shim names the versions whose source was read for it. Every other
Celery internal the package uses is the same in all of them: ``worker_state.active_requests``
and ``reserved_requests``, ``Request._request_dict``, the ``Request.on_timeout(soft, timeout)``
and ``on_failure(exc_info, send_failed_event, return_ok)`` signatures, ``task_ready(request)``,
``control_command``, ``Consumer.call_soon``/``add_task_queue``/``cancel_task_queue``,
``app.steps``, and billiard's ``soft_timeout_sighandler`` (billiard 4.2.0 to 4.3.2).
"""

from __future__ import annotations

import contextlib
import importlib.util
import random
import re
import socket
import threading
import uuid
from collections.abc import Iterable
from time import monotonic
from typing import Any

import celery
from celery.utils.collections import ConfigurationView

__all__ = [
    "MissingExtra",
    "call_soon",
    "celery_setting",
    "delays_natively",
    "filesystem_message_names",
    "forget_pool_locks",
    "hide_setting",
    "jitter_backoff",
    "keeps_bound_queues",
    "pool_connection",
    "publish_confirm_limit",
    "require_backend_extra",
    "require_broker_extra",
    "require_store_extra",
    "set_celery_setting",
]


# --- Celery -----------------------------------------------------------------------------------


#: The installed Celery's (major, minor).
_CELERY_VERSION = tuple(int(part) for part in celery.__version__.split(".")[:2])
#: Celery 5.5 and later refuse a call of a task whose ``soft_time_limit`` is past its
#: ``time_limit`` (``ValueError`` from ``Task.apply_async``; the task's own, else the settings',
#: which Celery's ``bind`` copies to it; never a call's); 5.4 sends it.
REFUSES_SOFT_LIMIT_PAST_HARD = _CELERY_VERSION >= (5, 5)
#: Celery 5.7 searches the settings map by map, each for every spelling of a key; 5.4 to 5.6
#: spelling by spelling, each in every map (``ConfigurationView.__getitem__``, read in each).
_SETTINGS_BY_MAP = _CELERY_VERSION >= (5, 7)


def celery_setting(app: Any, key: str) -> Any:
    """``app.conf[key]``, found as Celery's ``ConfigurationView.__getitem__`` finds it: one of
    the key's spellings (the namespaced, new and old names) in one of ``conf.maps`` (the
    changes, then the defaults), in the order of the installed Celery (see
    :data:`_SETTINGS_BY_MAP`). The spellings depend on the key alone, so they are worked out
    once per configuration: Celery's lookup costs about 5 µs, a handful of them per
    ``.delay()``. Anything else (a configuration not loaded yet, whose namespace may still
    change when Celery loads it in the same object; a key transform; a key found nowhere) goes
    through Celery's own lookup."""
    conf = app.conf
    if (not getattr(app, "configured", False) or not isinstance(conf, ConfigurationView)
            or conf.key_t is not None):
        return conf[key]
    known: dict[str, tuple[str, ...]] = vars(conf).setdefault("_ojs_spellings", {})
    spellings = known.get(key)
    if spellings is None:
        found = [*conf._to_keys(key), *(f(key) for f in conf._keys or ())]
        spellings = known[key] = tuple(dict.fromkeys(found))  # in order, once each
    maps = conf.maps
    if _SETTINGS_BY_MAP:
        for mapping in maps:
            for spelling in spellings:
                if spelling in mapping:
                    return mapping[spelling]
    else:
        for spelling in spellings:
            for mapping in maps:
                if spelling in mapping:
                    return mapping[spelling]
    return conf[key]


def set_celery_setting(conf: Any, key: str, value: Any) -> None:
    """Set ``key`` in Celery's configuration ``conf`` so that every lookup of it finds
    ``value``: in ``conf.changes``, under the first of the key's spellings (``_to_keys``) that
    the configuration holds, which for an app configured with ``config_from_object(...,
    namespace="CELERY")`` from settings that have it is the namespaced one (a Django project's
    ``CELERY_BEAT_SCHEDULE``). Celery 5.4 to 5.6 look each spelling up in every map before the
    next spelling (see :data:`_SETTINGS_BY_MAP`), so a plain ``conf.beat_schedule = ...`` was
    shadowed there by the project's own setting (beat never scheduled the sweep); Celery 5.7
    finds ``changes`` first whatever the spelling, so there only a spelling ``changes`` holds
    is kept. Otherwise the key is set as it is, so that a later ``conf.key = ...`` of the
    project's own still replaces it, as in Celery."""
    if isinstance(conf, ConfigurationView) and conf.prefix:
        # Celery 5.7 reads ``changes`` before the project's settings: a spelling held there
        # only (a plain one would shadow a project's later ``conf.key = ...`` there)
        maps = [conf.changes] if _SETTINGS_BY_MAP else conf.maps
        held = [spelling for spelling in conf._to_keys(key)
                if any(spelling in mapping for mapping in maps)]
        if held:
            key = held[0]
    conf[key] = value


def publish_confirm_limit(seconds: float) -> dict[str, float]:
    """The publish option that bounds the wait for a broker's publisher confirmation
    (``ojs.publish_timeout``), for ``send_task``: Celery 5.5+ passes ``confirm_timeout`` on
    to kombu 5.5+. Celery 5.4 and kombu 5.4 have no such option (Celery would add it to the
    message's properties, where nothing reads it), so there the wait stays unbounded."""
    return {"confirm_timeout": seconds} if _CONFIRM_TIMEOUT else {}


# --- kombu ------------------------------------------------------------------------------------


def _kombu_version() -> tuple[int, int]:
    import kombu

    major, minor = (int(part) for part in kombu.__version__.split(".")[:2])
    return major, minor


#: Whether ``send_task`` can bound a publisher confirmation's wait: kombu's
#: ``Producer.publish`` takes ``confirm_timeout`` from 5.5, Celery passes it on from 5.5.
_CONFIRM_TIMEOUT = _kombu_version() >= (5, 5) and _CELERY_VERSION >= (5, 5)


def keeps_bound_queues() -> bool:
    """May a publish name a queue bound to a channel before the call (``producer.bound_queue``)?

    After a lost connection kombu's ``Producer.publish`` retries with the same ``declare``
    list. kombu 5.7.0 revives an entity still bound to the closed channel onto the new one;
    kombu 5.5.4 and 5.6.2 raise ``RecoverableConnectionError('channel disconnected')`` on every
    retry (the message is not sent); kombu 5.4.2 declares on the producer's current channel.
    """
    return not (5, 5) <= _kombu_version() < (5, 7)


def _quorum_detector() -> Any:
    """Celery's ``detect_quorum_queues`` (5.5 and later), looked up once; None on 5.4."""
    try:
        from celery.utils.quorum_queues import detect_quorum_queues
    except ImportError:  # Celery 5.4
        return None
    return detect_quorum_queues


_detect_quorum_queues = _quorum_detector()

#: The least an ETA must be ahead when Celery routes it through RabbitMQ's native delayed
#: delivery (see :func:`delays_natively`): one whole second, and a little for the time Celery
#: takes between this check and its own reading of the clock.
NATIVE_DELAY_LEAST = 1.05


def delays_natively(app: Any, producer: Any, queue: Any) -> bool:
    """Does Celery send a message with an ETA to ``queue`` through RabbitMQ's native delayed
    delivery (the ``celery_delayed_*`` exchanges of quorum queues)?

    Celery 5.5 to 5.7 do so when the app has a quorum queue on RabbitMQ and the message's
    exchange is not direct; ``send_task`` then routes by the whole seconds left,
    ``int(eta - now)``, and raises ``ValueError`` for an ETA less than a second ahead (plain
    Celery's ``countdown=0.5`` does too), so a job due that soon is published a little later
    instead (:data:`NATIVE_DELAY_LEAST`). Celery 5.4 has no native delayed delivery."""
    if _detect_quorum_queues is None:  # Celery 5.4
        return False
    if isinstance(queue, str):  # a queue named: Celery's router looks it up so
        try:
            queue = app.amqp.queues[queue]
        except KeyError:  # Celery raises for it
            return False
    exchange = getattr(queue, "exchange", None)
    if exchange is None or exchange.type == "direct":  # Celery's worker holds it until its ETA
        return False
    driver = producer.connection.transport.driver_type
    return bool(_detect_quorum_queues(app, driver)[0])


def stalls_on_green_amqp(pool: str, driver: str, conf: Any, options: dict[str, Any]) -> bool:
    """Whether this worker meets a Celery 5.7 stall: on a green pool (gevent, eventlet) with
    AMQP heartbeats, ``celery.worker.loops.synloop`` drains its event dispatcher's connection
    after every message it takes, waiting up to 0.1 s there (``_quick_drain``) for a frame that
    rarely comes: the worker takes about 10 tasks a second, whatever its concurrency or
    prefetch. The dispatcher exists unless task events, gossip and the worker heartbeat are
    all off (``celery.worker.consumer.events``). Checked on Celery 5.7.0 (5.6 had no AMQP
    heartbeats on green pools, and no such drain); found by its function, not its version.
    ``options``: the worker's own (``WorkController.options``: ``-E``, ``--without-*``)."""
    if pool not in ("gevent", "eventlet") or driver != "amqp" or not conf.broker_heartbeat:
        return False
    from celery.worker import loops

    if not hasattr(loops, "_quick_drain"):
        return False
    events = options.get("task_events")
    if events is None:
        events = conf.worker_send_task_events
    return bool(events or not options.get("without_gossip")
                or not options.get("without_heartbeat"))


def call_soon(consumer: Any, callback: Any, *args: Any) -> None:
    """Run ``callback(*args)`` in the worker's consumer thread, promptly, from any thread.

    ``Consumer.call_soon`` hands the callback to kombu's event loop (the hub). kombu 5.7.0
    wakes the loop's poller when another thread does so; kombu 5.4.2, 5.5.4 and 5.6.2 do not,
    so the callback waits for the poll to return (up to a second, or until a message arrives,
    which is then delivered first: a queue cancelled this way still hands out the message that
    woke the loop). On those versions this registers a socket pair with the hub (from the loop
    thread, at the first call and again after the hub was reset by a connection loss) and
    writes to it after queueing the callback. Without a hub (filesystem transport) the consumer
    runs pending callbacks at every poll of its own.
    """
    consumer.call_soon(callback, *args)
    hub = getattr(consumer, "hub", None)
    if hub is None or hasattr(hub, "_create_waker"):  # kombu 5.7: wakes itself
        return
    with _WAKERS_LOCK:
        waker = getattr(hub, "_ojs_waker", None)
        if waker is None:
            waker = hub._ojs_waker = _Waker()
    waker.wake(hub)


_WAKERS_LOCK = threading.Lock()


class _Waker:
    """A socket pair in kombu's hub whose only job is to end the current poll."""

    def __init__(self) -> None:
        self.reader, self.writer = socket.socketpair()
        self.reader.setblocking(False)
        self.writer.setblocking(False)
        self._poller: Any = None  # the hub's poller we are registered with
        self._registering = False

    def wake(self, hub: Any) -> None:
        if self._poller is not None and self._poller is getattr(hub, "_poller", None):
            with contextlib.suppress(OSError):
                self.writer.send(b"\0")
        elif not self._registering:  # registered by the loop thread itself, at its next turn
            self._registering = True
            hub.call_soon(self._register, hub)

    def _register(self, hub: Any) -> None:
        self._registering = False
        hub.add_reader(self.reader, self._drain)
        self._poller = hub.poller

    def _drain(self) -> None:
        with contextlib.suppress(OSError):
            self.reader.recv(4096)



def filesystem_message_names(queue: str) -> tuple[str, str]:
    """The final and the temporary file name of a message for kombu's filesystem transport.

    kombu 5.7.0 takes a file for ``queue`` when the part after its first dot is
    ``<queue>.msg``; kombu 5.4.2, 5.5.4 and 5.6.2 take any file whose name *contains*
    ``.<queue>.msg``. So the temporary name must not contain the queue's name at all, or the
    older versions move and read the message while it is being written (and lose it).
    """
    unique = f"{round(monotonic() * 1000)}_{uuid.uuid4()}"
    return f"{unique}.{queue}.msg", f".{unique}.tmp"


def filesystem_exchange_file(channel: Any, exchange: str) -> Any:
    """The file of an exchange's bindings for kombu's filesystem ``channel``: kombu 5.7's
    ``_exchange_file`` (which refuses a name that would leave the folder); kombu 5.4 to 5.6
    have none and name it in place, in the control folder."""
    helper = getattr(channel, "_exchange_file", None)
    if helper is not None:
        return helper(exchange)
    return channel.control_folder / f"{exchange}.exchange"


# --- redis-py ---------------------------------------------------------------------------------


def jitter_backoff(base: float, cap: float) -> Any:
    """redis-py's ``ExponentialWithJitterBackoff(base=, cap=)``, on every supported redis-py.

    The class exists from redis-py 5.3.0 on; redis-py 5.0 to 5.2.1 (the newest that kombu 5.5's
    Redis extra allows) has only ``AbstractBackoff``, on which this builds the same formula:
    ``min(cap, random() * base * 2 ** failures)``.
    """
    from redis import backoff

    native = getattr(backoff, "ExponentialWithJitterBackoff", None)
    if native is not None:
        return native(base=base, cap=cap)
    return _JitterBackoff(base, cap)


class _JitterBackoff:
    """``ExponentialWithJitterBackoff`` for redis-py before 5.3 (see :func:`jitter_backoff`)."""

    def __init__(self, base: float, cap: float) -> None:
        self._base = base
        self._cap = cap

    def reset(self) -> None:
        pass

    def compute(self, failures: int) -> float:
        return float(min(self._cap, random.random() * self._base * 2**failures))


def pool_connection(pool: Any) -> Any:
    """A connection checked out of a redis-py ``ConnectionPool``.

    redis-py 5.3.0 and later take no argument (passing the old ``command_name`` warns);
    redis-py 5.0 to 5.2.1 require ``command_name`` (any string: the plain pool ignores it).
    """
    if _REDIS_NEEDS_COMMAND_NAME:
        return pool.get_connection("_")
    return pool.get_connection()


_RLOCK = type(threading.RLock())


def forget_pool_locks(pool: Any) -> None:
    """In a forked child: give a redis-py ``ConnectionPool`` new locks before it is first used.

    The pool notices the fork at its next use and resets itself under its locks: ``_fork_lock``
    (waited for 5 s, then ``ChildDeadlockedError``) and, from redis-py 8, ``_lock`` (waited for
    without a bound), whose reset also takes the lock of its ``_event_dispatcher`` when it makes
    a new connection. A parent thread that held one of them at the fork (a worker's beat thread
    checking a connection in or out while Celery's prefork pool forks a replacement child) never
    releases it in the child, whose first store call then waits for ever. Nothing else in the
    child holds them: the pool was not used here yet. Each lock is replaced by one of its kind
    (redis-py 5 uses ``Lock``, 8 ``RLock``); a pool or version without them is left as it is.
    Read in redis-py 5.0, 5.2.1, 6.4 and 8.1's ``connection.py`` and ``event.py``.
    """
    for owner, name in ((pool, "_fork_lock"), (pool, "_lock"),
                        (getattr(pool, "_event_dispatcher", None), "_lock")):
        old = getattr(owner, name, None)
        if old is not None and callable(getattr(old, "acquire", None)):
            setattr(owner, name, threading.RLock() if isinstance(old, _RLOCK) else threading.Lock())


def _redis_needs_command_name() -> bool:
    try:
        import redis
    except ImportError:
        return False
    parts = [*redis.__version__.split("."), "0", "0"][:2]
    try:
        return (int(parts[0]), int(parts[1])) < (5, 3)
    except ValueError:
        return False


_REDIS_NEEDS_COMMAND_NAME = _redis_needs_command_name()


# --- extras -----------------------------------------------------------------------------------


class MissingExtra(ImportError):
    """A configured backend whose optional dependencies are not installed."""


#: URL scheme -> (extra, the modules that extra installs and the backend imports).
_STORE_EXTRAS = {
    "redis": ("redis", ("redis",)),
    "rediss": ("redis", ("redis",)),
    "unix": ("redis", ("redis",)),
    "postgresql": ("postgres", ("psycopg",)),
    "postgres": ("postgres", ("psycopg",)),
}


def _kombu_redis_modules() -> tuple[str, ...]:
    """What kombu's Redis transport imports: also ``packaging`` from kombu 5.5 on (5.7 installs
    it only with its own ``redis`` extra; 5.4.2 does not use it)."""
    return ("redis", "packaging") if _kombu_version() >= (5, 5) else ("redis",)


_BROKER_EXTRAS = {
    scheme: ("redis", _kombu_redis_modules()) for scheme in ("redis", "rediss", "sentinel")
}
_BACKEND_EXTRAS = {
    "redis": ("redis", ("redis",)),
    "rediss": ("redis", ("redis",)),
    "sentinel": ("redis", ("redis",)),
}


def _missing(modules: Iterable[str]) -> list[str]:
    return [name for name in modules if importlib.util.find_spec(name) is None]


def _scheme(url: str) -> tuple[str, str | None]:
    """The scheme of ``url`` and, for SQLAlchemy's ``dialect+driver``, the driver."""
    scheme = url.split(":", 1)[0].lower()
    dialect, _, driver = scheme.partition("+")
    return dialect, driver or None


def require_store_extra(url: str) -> None:
    """Raise :class:`MissingExtra` naming the extra to install when the job store at ``url``
    needs a package that is not installed; one naming another PostgreSQL driver
    (``postgresql+psycopg2://``), when SQLAlchemy cannot load that driver."""
    dialect, driver = _scheme(url)
    if dialect in ("postgresql", "postgres") and driver not in (None, "psycopg"):
        _require_driver(url, driver)
        return
    _require(_STORE_EXTRAS.get(dialect), f"the job store {_shown(url)}")


def _require_driver(url: str, driver: str | None) -> None:
    """Raise :class:`MissingExtra` when SQLAlchemy cannot load the driver a URL names
    (``postgresql+psycopg2://`` without psycopg2): the error would otherwise come from the
    first enqueue, as a traceback."""
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    from .store.sql import normalise_url  # postgres+<driver>:// as the store reads it

    try:
        normalise_url(url).get_dialect().import_dbapi()
    except (ImportError, NoSuchModuleError) as exc:  # (the latter, an ArgumentError)
        why = str(exc) if isinstance(exc, ImportError) else "SQLAlchemy has no such driver"
        raise MissingExtra(
            f"the job store {_shown(url)} names the driver {driver!r}, which cannot be loaded "
            f"({why}): install it, or use postgresql://... (psycopg 3, the ojs-celery[postgres] "
            "extra)"
        ) from None
    except ArgumentError:  # SQLAlchemy's text repeats the URL, password included
        raise MissingExtra(f"the job store {_shown(url)} is not a valid URL") from None


def require_broker_extra(url: str | None) -> None:
    """Raise :class:`MissingExtra` naming the extra to install when the Celery broker at
    ``url`` needs a package that is not installed (kombu imports its Redis transport only on
    the first connection: without this check the error comes from the middle of a publish)."""
    if not url:
        return
    for one in str(url).split(";"):
        _require(_BROKER_EXTRAS.get(_scheme(one.strip())[0]), f"the broker {_shown(one)}")


def require_backend_extra(url: str | None) -> None:
    """Raise :class:`MissingExtra` naming the extra to install when Celery's result backend at
    ``url`` is Redis and redis-py is not installed (Celery itself says "install redis")."""
    if url and isinstance(url, str):
        _require(_BACKEND_EXTRAS.get(_scheme(url)[0]), f"the result backend {_shown(url)}")


def _require(need: tuple[str, tuple[str, ...]] | None, what: str) -> None:
    if need is None:
        return
    extra, modules = need
    missing = _missing(modules)
    if missing:
        raise MissingExtra(
            f"{what} needs the ojs-celery[{extra}] extra: pip install 'ojs-celery[{extra}]' "
            f"(missing: {', '.join(missing)})"
        )


def _shown(url: str) -> str:
    """``url`` without credentials, for an error message."""
    scheme, sep, rest = url.strip().partition("://")
    if not sep:  # not a URL: its first part only, which holds no password
        return repr(scheme.split(":", 1)[0] + ":...")
    host = rest.rsplit("@", 1)[-1].split("/", 1)[0]
    return f"{scheme}://{host}"


# --- Celery's settings report -------------------------------------------------------------------


def hide_setting(name: str) -> None:
    """Make ``celery report`` (and everything that prints ``conf.humanize(censored=True)``)
    mask a setting whose key is ``name``, nested ones included, as Celery masks its own
    passwords: Celery censors keys that match ``celery.app.utils.HIDDEN_SETTINGS`` (a regex it
    reads at each call; checked on Celery 5.4.0 to 5.7.0) and broker or backend URLs, not
    ``ojs.store_url``. Idempotent."""
    from celery.app import utils

    pattern = utils.HIDDEN_SETTINGS.pattern
    alternatives = pattern.split("|")
    if name.upper() not in alternatives:
        utils.HIDDEN_SETTINGS = re.compile(f"{pattern}|{name.upper()}", re.IGNORECASE)
