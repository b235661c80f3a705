"""The sweepers' mark in the broker's Redis: how a sweep sees that the broker lost its data.

A Redis broker restarted without persistence, flushed, or failed over to an empty replica loses
every queued message at once, while the jobs wait on in the store. The sweeper keeps a random
mark both here and in the store (``MetaArea.broker_mark``); a broker without the store's mark has
lost its data (what the sweeper then does is :func:`ojs_celery.sweeper.sweep`'s). This module is
only the Redis side: one key without expiry, named by the store's prefix (so apps with stores
of their own on one Redis keep apart) under kombu's ``global_keyprefix``, reached through
kombu's own connection settings (``redis://``, ``rediss://``, ``sentinel://``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from celery import Celery
from kombu.exceptions import OperationalError
from kombu.utils.url import maybe_sanitize_url

from .handback import plain_client

if TYPE_CHECKING:
    import redis

__all__ = ["BrokerMarker", "Unreachable", "mark_key"]


class Unreachable(RuntimeError):
    """The broker's Redis did not answer the check (the sweeper checks again next pass)."""


def mark_key(store_prefix: str) -> str:
    return f"_ojs.broker_mark.{store_prefix}"


class BrokerMarker:
    """The mark's key in the app's Redis broker; a client kept for the process (made at the
    first use, again after a failure to make it), whose kombu channel the sweeper also puts
    held messages back with (:mod:`ojs_celery.handback`)."""

    def __init__(self, app: Celery, store_prefix: str) -> None:
        self._app = app
        self._name = mark_key(store_prefix)
        self._connection: Any = None
        self._client: redis.Redis | None = None
        self._channel: Any = None
        self._key = ""
        #: Whether the last check failed: said once per outage (of this app's broker), not
        #: once per pass.
        self.failing = False
        #: Whether this process's last put-back of dead workers' messages failed: said once
        #: per outage too, while their tombstones wait for the put-back pass after pass.
        self.put_back_failing = False

    def where(self) -> str:
        """The broker's URL, password masked (for the log)."""
        uri = self._app.connection_for_write().as_uri(include_password=True)
        return str(maybe_sanitize_url(uri))  # kombu's as_uri() shows ":**@" even without one

    def read(self) -> str | None:
        """The mark the broker holds, None if none. Raises :class:`Unreachable`."""
        client, key = self._open()
        try:
            value = client.get(key)
        except _errors() as exc:
            raise _unavailable(exc) from exc
        return None if value is None else value.decode() if isinstance(value, bytes) else str(value)

    def claim(self, mark: str) -> bool:
        """Set the mark where the broker holds none; False if one is there (another sweeper's:
        the broker elects one mark among sweepers that saw none)."""
        client, key = self._open()
        try:
            return bool(client.set(key, mark, nx=True))
        except _errors() as exc:
            raise _unavailable(exc) from exc

    def channel(self) -> Any:
        """The kombu Redis channel the mark's client runs on. Raises :class:`Unreachable`."""
        self._open()
        return self._channel

    def close(self) -> None:
        connection, self._connection, self._client = self._connection, None, None
        self._channel = None
        if connection is not None:
            with contextlib.suppress(Exception):  # best effort: it is being dropped
                connection.release()

    def _open(self) -> tuple[redis.Redis, str]:
        """A plain redis-py client on kombu's pool for the broker (its URL, transport options,
        TLS and Sentinel), and the key under kombu's ``global_keyprefix`` (kombu's prefixing
        client leaves ``GET`` unprefixed, so the prefix is added here)."""
        if self._client is None:
            from kombu.transport.redis import SentinelTransport

            connection = self._app.connection_for_write()
            # each of the broker's URLs once, without kombu's sleeps between rounds (2 s per
            # pass while the broker is down): the next pass checks again. Sentinel's URLs are
            # the sentinels, all of which kombu asks for the master in each try: one try.
            tries = (1 if isinstance(connection.transport, SentinelTransport)
                     else max(len(connection.alt), 1))
            try:
                connection.ensure_connection(max_retries=tries - 1,
                                             reraise_as_library_errors=False)
                channel = connection.channel()  # kombu's Redis channel pings the server
            except (OperationalError, *_errors(), *connection.connection_errors) as exc:
                connection.release()
                raise _unavailable(exc) from exc
            self._connection, self._channel = connection, channel
            self._client, prefix = plain_client(channel)
            self._key = prefix + self._name
        return self._client, self._key


def _errors() -> tuple[type[Exception], ...]:
    import redis

    return (redis.RedisError, OSError)


def _unavailable(exc: BaseException) -> Unreachable:
    return Unreachable(f"the broker's Redis: {type(exc).__name__}: {exc}")
