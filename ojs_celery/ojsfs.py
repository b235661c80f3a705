"""``ojsfs://``: kombu's filesystem transport with atomic writes and claimed messages, the
embedded default's broker (:mod:`ojs_celery.embedded`).

kombu's filesystem transport writes a message file in place, and a consumer that lists the
folder in between may read it half-written: the message is then lost (it shows as a JSON error).
:class:`Transport` writes to a temporary name and renames, which is atomic, so consumers only
ever see whole messages. :func:`register_transport` makes it kombu's ``ojsfs://`` transport; it
runs in ``install(app)`` and :func:`embedded_settings`, not at import (kombu keeps its aliases
in a module-level dict: there is no per-app registry).

kombu's consumer also takes a message by moving its file to the system's temporary folder and
deleting it once read, before the task has run: a worker killed (SIGKILL, the machine's power)
after taking messages lost them, and the jobs waited for the sweeper's redispatch backstop (an
hour by default); where that folder is on another file system (a tmpfs ``/tmp``) the move is a
copy, which two consumers may make of one file at once. :class:`Channel` takes a message by
renaming its file into a claim folder of its own process, in the broker folder
(``.claimed/<owner>/``, locked with ``flock`` for the process's life), and deletes it when the
message is acknowledged; a message rejected with requeue or restored at shutdown is written
back. A consumer puts the files of a claim folder whose lock is free (its process is gone)
back into the broker folder, under their own names (so in their order), at its start and then
every :data:`RESTORE_INTERVAL` seconds: what a killed worker had taken is delivered again, and
fencing drops a copy of a job that ran meanwhile. The same look removes the empty claim folder
of a process killed before it locked it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
import uuid
from queue import Empty
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

from . import compat

SCHEME = "ojsfs"

logger = logging.getLogger(__name__)


#: The folder, in the broker folder, of every consumer process's claimed messages (a name
#: kombu's filesystem transport never takes for a message: no queue is named ``claimed``).
CLAIMS = ".claimed"
#: The folder, in the broker folder, where a message file that is no message is set aside.
UNREADABLE = ".unreadable"
#: Seconds between a consumer's looks for the claims of processes that are gone.
RESTORE_INTERVAL = 2.0
#: Seconds after which a claim folder that never got its lock file belongs to a process that
#: died making it (between the folder and the lock), not to one making it now.
ABANDONED_AFTER = 60.0

_claims_lock = threading.Lock()
#: broker folder -> this process's claim folder there and the descriptor of its lock file,
#: which stays open (a forked child forgets its parent's: :func:`_forget_parent_claims`).
_own_claims: dict[str, tuple[str, int]] = {}
#: broker folder -> when this process looks for the claims of processes gone next.
_next_restore: dict[str, float] = {}
#: delivery tag -> its claimed file, for every channel of this process: kombu may acknowledge
#: or reject a message on another channel than the one that took it (its transport sends a
#: message for a cancelled consumer back with the first channel it has).
_claimed: dict[str, str] = {}


class BrokerFolderMissing(ChannelError):  # type: ignore[misc]
    """The broker folder is not there: removed while the process ran (a cleaner of old files,
    a hand), and the messages it held with it. A Celery worker stops on it, with one line
    (:mod:`ojs_celery.worker.broker_folder`)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        super().__init__(folder)

    def __str__(self) -> str:
        return (f"the broker folder {self.folder} is missing (removed while this process ran? "
                "the messages it held are gone with it); a process that configures the app "
                "with embedded_settings() makes it again at its start")


def _listdir(folder: str) -> list[str]:
    """The names in the broker folder ``folder``; :class:`BrokerFolderMissing` if it is not
    there, a ChannelError naming it for any other failure (kombu's own listing let the
    ``OSError`` out, which Celery shows with a traceback)."""
    try:
        return os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise BrokerFolderMissing(folder) from exc
    except OSError as exc:
        raise ChannelError(f"Cannot list {folder!r}: {exc.strerror or exc}") from exc


def _claim_folder(folder: str) -> str:
    """This process's claim folder in the broker folder ``folder``: made at its first use,
    with a lock file that the process holds (``flock``) until it ends. The lock is taken before
    the lock file gets its name, so no consumer ever sees it free while its owner lives."""
    with _claims_lock:
        found = _own_claims.get(folder)
        if found is None:
            claims = os.path.join(folder, CLAIMS)
            try:  # not makedirs: a broker folder removed meanwhile is not made again here
                os.mkdir(claims)
            except FileExistsError:
                pass
            except FileNotFoundError as exc:
                raise BrokerFolderMissing(folder) from exc
            own = os.path.join(claims, f"{os.getpid()}-{uuid.uuid4().hex}")
            os.mkdir(own)
            temporary = f"{own}.locking"
            descriptor = os.open(temporary, os.O_RDWR | os.O_CREAT, 0o600)  # never closed
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            os.rename(temporary, f"{own}.lock")
            found = _own_claims[folder] = (own, descriptor)
        return found[0]


def _forget_claim_folder(folder: str, own: str) -> None:
    """Forget this process's claim folder ``own`` in the broker folder ``folder``, which is
    gone (removed with the broker folder, or by a cleaner of old files): the next claim makes a
    new one. Nothing if another thread of the process did so already."""
    with _claims_lock:
        found = _own_claims.get(folder)
        if found is None or found[0] != own:
            return
        del _own_claims[folder]
        with contextlib.suppress(OSError):
            os.unlink(f"{own}.lock")
        with contextlib.suppress(OSError):
            os.close(found[1])


def _take(folder: str, name: str) -> str | None:
    """Move the message file ``name`` of the broker folder ``folder`` into this process's claim
    folder; its path there, or None if another consumer took it first."""
    for _ in range(2):
        own = _claim_folder(folder)
        claimed = os.path.join(own, name)
        try:
            os.rename(os.path.join(folder, name), claimed)
        except FileNotFoundError:
            if os.path.isdir(own):  # another consumer took it
                return None
            # the claim folder is gone, not the message: every message would be skipped for
            # ever as taken by another consumer
            _forget_claim_folder(folder, own)
            continue
        except OSError as exc:
            raise ChannelError(f"Cannot take file {name!r} from {folder!r}: "
                               f"{exc.strerror or exc}") from exc
        return claimed
    return None


def _message(text: bytes) -> dict[str, Any] | None:
    """The message a file holds; None if it holds none (empty or cut short, which a power
    loss may leave, or written by something else)."""
    try:
        message = loads(bytes_to_str(text))  # type: ignore[no-untyped-call]
    except ValueError:  # a UnicodeDecodeError too
        return None
    if not isinstance(message, dict) or not isinstance(message.get("properties", {}), dict):
        return None
    return message


def _set_aside(folder: str, claimed: str, name: str) -> None:
    """Move a claimed file that is no message to the broker folder's :data:`UNREADABLE`
    folder, and say so. Raised instead, it stopped the consumer (a Celery worker: "Unrecoverable
    error"), and claimed, it came back at every start: no message after it ever ran."""
    aside = os.path.join(folder, UNREADABLE)
    try:
        os.makedirs(aside, exist_ok=True)
        os.rename(claimed, os.path.join(aside, name))
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(claimed)
        logger.error("ojs_celery: message file %s in %s is no message; could not set it "
                     "aside (%s): deleted it", name, folder, exc.strerror or exc)
        return
    logger.error("ojs_celery: message file %s in %s is no message (empty, cut short or "
                 "written by something else): moved it to %s", name, folder, aside)


def _forget_parent_claims() -> None:
    """In a forked child (a prefork pool process, the embedded beat): close the parent's lock
    files. A lock lasts while any process has its file open, so a pool process that outlived
    its killed worker by a while would have kept the worker's messages claimed meanwhile."""
    global _claims_lock
    _claims_lock = threading.Lock()  # another thread of the parent may have held it
    _claimed.clear()  # the parent's to acknowledge, not this process's
    for _, descriptor in _own_claims.values():
        with contextlib.suppress(OSError):
            os.close(descriptor)
    _own_claims.clear()


os.register_at_fork(after_in_child=_forget_parent_claims)


def restore_claims(folder: str) -> int:
    """Put back into the broker folder ``folder`` the messages of every claim folder whose
    owner is gone (its lock is free), under their own names; the number put back."""
    claims = os.path.join(folder, CLAIMS)
    try:
        entries = os.listdir(claims)
    except FileNotFoundError:
        return 0
    with _claims_lock:  # never this process's own, whatever the lock says: where flock
        # locks for the whole process (NFS emulates it with fcntl's locks), the process's own
        # second open of its lock file takes it at once
        mine = {own for own, _ in _own_claims.values()}
    restored = 0
    for entry in entries:
        if not entry.endswith(".lock"):
            continue
        lock_file = os.path.join(claims, entry)
        owner = lock_file[:-len(".lock")]
        if owner in mine:
            continue
        try:
            descriptor = os.open(lock_file, os.O_RDWR)
        except FileNotFoundError:  # another consumer restored it just now
            continue
        try:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its process lives (this process's own included)
                continue
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(owner):
                    with contextlib.suppress(FileNotFoundError):
                        os.rename(os.path.join(owner, name), os.path.join(folder, name))
                        restored += 1
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(owner)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_file)
        finally:
            os.close(descriptor)
    for owner in {entry.removesuffix(".locking") for entry in entries
                  if "." not in entry.removesuffix(".locking")}:
        if os.path.join(claims, owner) not in mine:
            _remove_abandoned(os.path.join(claims, owner))
    return restored


def _remove_abandoned(owner: str) -> None:
    """Remove the claim folder ``owner`` and its half-made lock file (``.locking``) if the
    folder never got its lock file (``.lock``): its process was killed between making the
    folder and taking the lock, and nothing else would ever remove it. A folder made less than
    :data:`ABANDONED_AFTER` seconds ago (a process making it now), a ``.locking`` file still
    locked, and a folder that holds messages (whose lock file something else deleted: its
    owner may live) are left."""
    if os.path.exists(f"{owner}.lock"):
        return
    made = []
    for path in (owner, f"{owner}.locking"):
        with contextlib.suppress(FileNotFoundError):
            made.append(os.stat(path).st_mtime)
    if not made or time.time() - max(made) < ABANDONED_AFTER:
        return
    try:
        descriptor = os.open(f"{owner}.locking", os.O_RDWR)
    except FileNotFoundError:
        descriptor = None
    try:
        if descriptor is not None:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its process lives, about to name it ``.lock``
                return
        try:
            os.rmdir(owner)
        except FileNotFoundError:
            pass
        except OSError:  # not empty
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{owner}.locking")
    finally:
        if descriptor is not None:
            os.close(descriptor)


def _bindings(file: Any, text: bytes) -> list[Any]:
    """An exchange file's bindings (none in an empty one); a file that is no JSON table (one
    that kombu's unlocked first bind broke) is named, with what to do, in a ChannelError."""
    if not text.strip():
        return []
    try:
        return [filesystem.exchange_queue_t(*binding)
                for binding in loads(bytes_to_str(text))]  # type: ignore[no-untyped-call]
    except (ValueError, TypeError) as exc:
        raise ChannelError(f"Cannot read {file}: not a table of bindings ({exc}); remove the "
                           "file and restart the workers, which bind their queues again") from exc


class Channel(filesystem.Channel):
    """Filesystem channel whose writes are atomic (temp file + rename) and whose messages stay
    on disk, claimed, until they are acknowledged (see the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._no_ack_queues: set[str] = set()
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]

    def get_table(self, exchange: Any) -> list[Any]:
        """The exchange's bindings, read under a shared lock; an empty file (a first bind
        between its creation and its write) has none."""
        file = compat.filesystem_exchange_file(self, exchange)
        try:
            with open(file, "rb") as handle:
                fcntl.flock(handle, fcntl.LOCK_SH)
                text = handle.read()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ChannelError(f"Cannot open {file}: {exc.strerror or exc}") from exc
        return _bindings(file, text)

    def _queue_bind(self, exchange: Any, routing_key: Any, pattern: Any, queue: Any) -> None:
        """Add the binding to the exchange's file under an exclusive lock taken before the
        file is read or written. kombu's own opens a file that does not exist yet with
        truncation before it locks it: two processes binding at once (two workers started
        together, each binding its remote-control queue) each wrote over the other's table,
        which lost a binding or left a file of broken JSON that every later publish to the
        exchange failed on."""
        file = compat.filesystem_exchange_file(self, exchange)
        binding = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        try:
            self.control_folder.mkdir(exist_ok=True)
            with open(os.open(file, os.O_RDWR | os.O_CREAT, 0o644), "r+b") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file is closed
                table = _bindings(file, handle.read())
                if binding not in table:
                    table.insert(0, binding)
                    handle.seek(0)
                    handle.truncate()
                    handle.write(str_to_bytes(dumps(table)))  # type: ignore[no-untyped-call]
        except OSError as exc:
            raise ChannelError(f"Cannot open {file}: {exc.strerror or exc}") from exc

    def _get(self, queue: Any, timeout: Any = None) -> Any:
        folder = self.data_folder_in
        now = time.monotonic()
        if now >= _next_restore.get(folder, 0.0):
            _next_restore[folder] = now + RESTORE_INTERVAL
            restore_claims(folder)
        wanted = f"{queue}.msg"
        for name in sorted(_listdir(folder)):
            if name.partition(".")[2] != wanted:
                continue
            claimed = _take(folder, name)
            if claimed is None:  # another consumer took it
                continue
            try:
                with open(claimed, "rb") as handle:
                    text = handle.read()
            except OSError as exc:
                raise ChannelError(f"Cannot read file {claimed!r} from queue: "
                                   f"{exc.strerror or exc}") from exc
            message = _message(text)
            if message is None:
                _set_aside(folder, claimed, name)
                continue
            tag = message.get("properties", {}).get("delivery_tag")
            if queue in self._no_ack_queues or tag is None:
                self._release(claimed)
            else:
                _claimed[tag] = claimed
            return message
        raise Empty()

    def _size(self, queue: Any) -> int:
        """The number of messages in ``queue`` (a declare asks it), by the rule :meth:`_get`
        takes files by."""
        wanted = f"{queue}.msg"
        return sum(name.partition(".")[2] == wanted for name in _listdir(self.data_folder_in))

    def _purge(self, queue: Any) -> int:
        """Remove ``queue``'s messages, by the rule :meth:`_get` takes files by (kombu 5.4 to
        5.6 removed every file whose name held ``.<queue>.msg``: purging ``default`` also
        removed ``reports.default``'s messages)."""
        folder = self.data_folder_in
        wanted = f"{queue}.msg"
        removed = 0
        for name in _listdir(folder):
            if name.partition(".")[2] == wanted:
                with contextlib.suppress(FileNotFoundError):  # taken meanwhile
                    os.unlink(os.path.join(folder, name))
                    removed += 1
        return removed

    def _release(self, claimed: str | None) -> None:
        if claimed is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(claimed)

    def basic_consume(self, queue: Any, no_ack: Any, *args: Any, **kwargs: Any) -> Any:
        """Consume ``queue``; without acknowledgements (``no_ack``) its messages keep no
        claim. The mark is the queue's current consumer's (kombu's virtual transport delivers
        a queue to its last consumer only): a queue consumed without acknowledgements and then
        with them keeps claims again, else a killed consumer's messages from it were lost."""
        if no_ack:  # nothing acknowledges what this queue delivers: no claim is kept
            self._no_ack_queues.add(queue)
        else:
            self._no_ack_queues.discard(queue)
        return super().basic_consume(  # type: ignore[no-untyped-call]
            queue, no_ack, *args, **kwargs)

    def basic_cancel(self, consumer_tag: Any) -> Any:
        """Cancel a consumer; its queue's no-ack mark goes with it (kombu drops the queue's
        delivery with any of its consumers' cancel)."""
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)  # type: ignore[no-untyped-call]
        if queue is not None and consumer_tag not in self._consumers:
            self._no_ack_queues.discard(queue)
        return result

    def basic_get(self, queue: Any, no_ack: bool = False, **kwargs: Any) -> Any:
        message = super().basic_get(  # type: ignore[no-untyped-call]
            queue, no_ack=no_ack, **kwargs)
        if message is not None and no_ack:
            self._release(_claimed.pop(message.delivery_tag, None))
        return message

    def basic_ack(self, delivery_tag: Any, multiple: bool = False) -> None:
        super().basic_ack(delivery_tag, multiple=multiple)  # type: ignore[no-untyped-call]
        self._release(_claimed.pop(delivery_tag, None))

    def basic_reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        # with requeue, the message is written back first (:meth:`_restore`)
        super().basic_reject(delivery_tag, requeue=requeue)  # type: ignore[no-untyped-call]
        self._release(_claimed.pop(delivery_tag, None))

    def _restore(self, message: Any) -> None:
        """Write the message back (a reject with requeue, the unacknowledged ones at the
        channel's close), then drop its claim; a claim whose write failed stays, for the
        restore after this process ends."""
        claimed = _claimed.pop(message.delivery_tag, None)
        try:
            super()._restore(message)  # type: ignore[no-untyped-call]
        except BaseException:
            if claimed is not None:
                _claimed[message.delivery_tag] = claimed
            raise
        self._release(claimed)

    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name, temporary_name = compat.filesystem_message_names(queue)
        final = os.path.join(self.data_folder_out, name)
        temporary = os.path.join(self.data_folder_out, temporary_name)
        try:
            with open(temporary, "wb") as handle:
                handle.write(str_to_bytes(dumps(payload)))  # type: ignore[no-untyped-call]
            os.replace(temporary, final)
        except OSError as exc:
            # a write that failed midway (the disk full) leaves no part of a file behind: kept,
            # each failed publish would hold its part of the space that ran out, for good
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            if not os.path.isdir(self.data_folder_out):
                raise BrokerFolderMissing(self.data_folder_out) from exc
            raise ChannelError(f"Cannot add file {final!r} to directory: "
                               f"{exc.strerror or exc}") from exc


class Transport(filesystem.Transport):
    Channel = Channel


def register_transport() -> None:
    """Make ``ojsfs://`` URLs use :class:`Transport` in this process (idempotent)."""
    TRANSPORT_ALIASES[SCHEME] = f"{__name__}:Transport"
