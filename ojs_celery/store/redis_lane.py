"""A fast lane for the Redis store's hot round trips (every compare-and-set write, inserts).

redis-py spends about as much CPU on a command's way through its layers (pool checkout and
return, retry wrapper, command dispatch, response callbacks) as on the round trip itself. A
worker pays that twice per job, so the store keeps one connection per process aside and talks
to it directly; a thread that finds it taken borrows a connection from the client's pool for
the call, still past the other layers.

The lane never changes what a call does, only how fast the usual case goes: a script Redis has
forgotten (``NOSCRIPT``) and a connection error send the caller back to the client's ordinary
path, with its retries and script loading. The lane's connection stays checked out of the
client's pool (so ``client.close()`` closes it) until it breaks; a forked child forgets its
parent's and checks out its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .. import compat
from ..forking import forget_in_children

_hiredis_pack: Any
try:  # redis-py's own choice of packer when hiredis is installed (the ``redis`` extra)
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - without hiredis, redis-py's packer
    _hiredis_pack = None

__all__ = ["LOST", "MISSED", "Lane"]

#: What a reply reads as when Redis ran nothing (``NOSCRIPT``): take the ordinary path.
MISSED: Any = object()
#: The errors of a lost connection: the command may or may not have run.
LOST = (RedisConnectionError, RedisTimeoutError, OSError)


class Lane:
    """One connection of this process, used by whichever thread finds it free."""

    def __init__(self, client: redis.Redis) -> None:
        self._pool = client.connection_pool
        self._lock = threading.Lock()
        self._connection: Any = None
        forget_in_children(self)

    def forget_parent(self) -> None:
        """In a forked child: the parent's connection is never used here, nor closed."""
        self._lock = threading.Lock()
        self._connection = None

    def call(self, *command: str | int) -> Any:
        """Redis's reply to ``command``, or :data:`MISSED` when the caller must take the
        ordinary path (which sends it again if the reply was lost, as redis-py's retry would).
        A reply that did not come in time raises redis-py's ``TimeoutError``: a server that
        is not answering would keep the ordinary path waiting as long again."""
        answer = self._send(command, check=False)  # a dead connection only costs a detour
        if answer is None:
            return MISSED
        try:
            return answer()
        except RedisTimeoutError:
            raise
        except LOST:
            return MISSED

    def send(self, *command: str | int, check: bool = True) -> Callable[[], Any] | None:
        """Send ``command`` now and return the function that reads its reply, so the caller
        may do something else in between. The reader returns :data:`MISSED` for ``NOSCRIPT``
        and raises one of :data:`LOST` when the reply is lost. None: nothing was sent. Raises
        redis-py's ``TimeoutError`` when a new connection got no answer in time. Without
        ``check`` a kept connection is not polled first (a system call per command): one the
        server closed meanwhile then shows as a lost reply, which the caller settles."""
        return self._send(command, check=check)

    def _send(self, command: tuple[str | int, ...], check: bool) -> Callable[[], Any] | None:
        own = self._lock.acquire(blocking=False)
        connection: Any = None
        try:
            if not own:
                connection = compat.pool_connection(self._pool)
            elif self._connection is None:
                connection = self._connection = compat.pool_connection(self._pool)
            else:
                connection = self._connection
                if check:
                    _ready(connection)
            connection.send_packed_command(_pack(connection, command))
        except RedisTimeoutError:  # a new connection's handshake got no answer in time
            self._done(connection, own, broken=True)
            raise
        except LOST:
            self._done(connection, own, broken=True)
            return None
        except BaseException:
            self._done(connection, own, broken=False)
            raise

        def answer() -> Any:
            broken = False
            try:
                return connection.read_response()
            except NoScriptError:
                return MISSED
            except LOST:
                broken = True
                raise
            finally:
                self._done(connection, own, broken)

        return answer

    def _done(self, connection: Any, own: bool, broken: bool) -> None:
        """Free the lane, or give a borrowed connection back. A broken connection is
        disconnected and returned to the pool: the lane checks out a fresh one next time."""
        if connection is not None and broken:
            connection.disconnect()
        if own and broken:
            self._connection = None
        if connection is not None and (broken or not own):
            self._pool.release(connection)
        if own:
            self._lock.release()


def _pack(connection: Any, command: tuple[str | int, ...]) -> Any:
    """The command as the wire carries it. The lane's commands are all ``str`` and ``int``
    with a one-word name, which hiredis packs as redis-py would (UTF-8), without redis-py's
    per-argument pass over them (a compare-and-set has some forty arguments)."""
    if _hiredis_pack is None:
        return connection.pack_command(*command)
    return [_hiredis_pack(command)]


def _ready(connection: Any) -> None:
    """Make a kept connection fit to send, as the pool checks one it hands out: a socket
    with something to read was closed by the server (a restart, ``CLIENT KILL``, a timeout)
    and is replaced, so that a command is never written into a dead connection."""
    try:
        stale = connection.can_read()
    except LOST:
        stale = True
    if stale:
        connection.disconnect()
