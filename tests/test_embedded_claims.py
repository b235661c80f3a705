"""The ``ojsfs://`` transport keeps a message on disk, claimed, until it is acknowledged: a
consumer killed after taking messages does not lose them (kombu's filesystem transport deleted
a message once read, before its task ran, and a killed worker's jobs waited for the sweeper's
hourly redispatch)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from kombu import Connection, Exchange, Producer, Queue

from ojs_celery import ojsfs
from ojs_celery.embedded import embedded_settings
from ojs_celery.ojsfs import CLAIMS
from tests.workers import ROOT, unique, wait_for


def new_queue() -> str:
    """A queue name of the test's own: kombu's virtual transports remember the bindings made
    in a process whatever the folder (a second test's declare of the same name writes none)."""
    return unique("claims")

CONSUMER = textwrap.dedent("""
    import os, sys, time
    from kombu import Connection
    from ojs_celery.embedded import embedded_settings
    settings = embedded_settings(sys.argv[1])
    with Connection(settings["broker_url"],
                    transport_options=settings["broker_transport_options"]) as connection:
        message = connection.channel().basic_get(sys.argv[2])  # taken, never acknowledged
        # a forked child (as a prefork pool process) that outlives its parent: --fork
        child = os.fork() if "--fork" in sys.argv else None
        if child != 0:
            print(message.payload if message is not None else None, child, flush=True)
        time.sleep(120)
""")


@contextmanager
def channel(settings: dict[str, Any]) -> Iterator[Any]:
    with Connection(settings["broker_url"],
                    transport_options=settings["broker_transport_options"]) as connection:
        yield connection.channel()


def publish(settings: dict[str, Any], name: str, body: dict[str, Any]) -> None:
    with channel(settings) as chan:
        queue = Queue(name, Exchange(name), name)
        queue(chan).declare()
        Producer(chan).publish(body, exchange=queue.exchange, routing_key=name, retry=False)


def claimed(settings: dict[str, Any]) -> list[str]:
    """The message files in every claim folder."""
    claims = pathlib.Path(settings["broker_transport_options"]["data_folder_in"]) / CLAIMS
    return sorted(p.name for p in claims.glob("*/*.msg"))


@pytest.mark.parametrize("fork", [False, True], ids=["alone", "with-a-forked-child"])
def test_a_message_a_killed_consumer_took_is_delivered_again(
        tmp_path: pathlib.Path, fork: bool) -> None:
    """With a forked child still running (a pool process that has not yet noticed its
    worker is gone), the killed consumer's messages are delivered again all the same."""
    settings = embedded_settings(tmp_path / "ojs")
    queue = new_queue()
    publish(settings, queue, {"n": 1})
    consumer = subprocess.Popen(
        [sys.executable, "-c", CONSUMER, str(tmp_path / "ojs"), queue, *(["--fork"] * fork)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        assert consumer.stdout is not None
        payload, _, child_pid = consumer.stdout.readline().strip().rpartition(" ")
        assert payload == "{'n': 1}"
        child = int(child_pid) if fork else None
        with channel(settings) as chan:  # while its consumer lives, nobody else gets it
            assert chan.basic_get(queue) is None
    finally:
        consumer.send_signal(signal.SIGKILL)
        consumer.wait(10)
    try:
        delivered_again(settings, queue)
    finally:
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def delivered_again(settings: dict[str, Any], queue: str) -> None:
    with channel(settings) as chan:
        message = wait_for(lambda: chan.basic_get(queue), 10, "the killed consumer's message")
        assert message.payload == {"n": 1}
        assert claimed(settings) != []  # claimed again, by this process now
        message.ack()
        assert claimed(settings) == []
        assert chan.basic_get(queue) is None  # once


def test_acknowledged_rejected_and_unacknowledged_gets_leave_no_claim(
        tmp_path: pathlib.Path) -> None:
    settings = embedded_settings(tmp_path / "ojs")
    queue = new_queue()
    publish(settings, queue, {"n": 2})
    with channel(settings) as chan:
        message = chan.basic_get(queue)
        assert message.payload == {"n": 2} and len(claimed(settings)) == 1
        message.reject(requeue=True)  # back in the queue, not claimed
        assert claimed(settings) == []
        again = chan.basic_get(queue, no_ack=True)
        assert again.payload == {"n": 2}
        assert claimed(settings) == []
        assert chan.basic_get(queue) is None


def test_a_consumer_whose_claim_folder_was_removed_takes_messages_again(
        tmp_path: pathlib.Path) -> None:
    """The claim folder removed under a running consumer (the broker folder removed and made
    again, a cleaner of old files): its next messages are taken all the same, into a new claim
    folder, instead of being skipped for ever as "taken by another consumer"."""
    settings = embedded_settings(tmp_path / "ojs")
    queue = new_queue()
    broker = pathlib.Path(settings["broker_transport_options"]["data_folder_in"])
    with channel(settings) as chan:
        publish(settings, queue, {"n": 1})
        chan.basic_get(queue).ack()  # the claim folder is made
        shutil.rmtree(broker / CLAIMS)
        publish(settings, queue, {"n": 2})
        message = chan.basic_get(queue)
        assert message is not None and message.payload == {"n": 2}
        assert len(claimed(settings)) == 1  # claimed again, in a new folder
        message.ack()
        assert claimed(settings) == [] and chan.basic_get(queue) is None


def test_a_consumer_never_restores_its_own_claims(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ``flock`` locks for the whole process (NFS emulates it with ``fcntl`` locks,
    which a process's second open of its own lock file takes at once), a consumer's look for
    the claims of processes gone must not put back the messages it holds itself: they would
    be delivered to a second consumer while the first runs them."""
    monkeypatch.setattr(ojsfs, "fcntl", types.SimpleNamespace(
        LOCK_EX=fcntl.LOCK_EX, LOCK_SH=fcntl.LOCK_SH, LOCK_NB=fcntl.LOCK_NB,
        flock=fcntl.lockf))  # lockf: POSIX record locks, the process's own, as on NFS
    settings = embedded_settings(tmp_path / "ojs")
    queue = new_queue()
    publish(settings, queue, {"n": 1})
    with channel(settings) as chan:
        message = chan.basic_get(queue)
        assert message.payload == {"n": 1}
        assert ojsfs.restore_claims(
            settings["broker_transport_options"]["data_folder_in"]) == 0
        assert len(claimed(settings)) == 1
        message.ack()
        assert claimed(settings) == [] and chan.basic_get(queue) is None


@pytest.mark.parametrize("content", [b"", b"{\"body\": ", b"[1, 2]", b"\xff\xfe"],
                         ids=["empty", "cut", "no-message", "no-text"])
def test_an_unreadable_message_file_is_set_aside_and_the_next_message_delivered(
        tmp_path: pathlib.Path, content: bytes, caplog: pytest.LogCaptureFixture) -> None:
    """A message file that is no message (empty or cut short after a power loss, written by
    something else) is moved to ``.unreadable/`` with an error logged: it made every consumer
    that took it fail (a Celery worker stops with "Unrecoverable error: JSONDecodeError"), and
    claimed, it came back at each start, so that no message after it ever ran."""
    settings = embedded_settings(tmp_path / "ojs")
    queue = new_queue()
    broker = pathlib.Path(settings["broker_transport_options"]["data_folder_in"])
    publish(settings, queue, {"n": 1})
    (broker / f"0_bad.{queue}.msg").write_bytes(content)  # sorts first
    with channel(settings) as chan:
        message = chan.basic_get(queue)
        assert message is not None and message.payload == {"n": 1}
        message.ack()
        assert chan.basic_get(queue) is None
    assert claimed(settings) == []
    assert [p.name for p in (broker / ojsfs.UNREADABLE).iterdir()] == [f"0_bad.{queue}.msg"]
    assert f"0_bad.{queue}.msg" in caplog.text


def test_a_message_rejected_on_another_channel_than_the_one_that_took_it_leaves_no_claim(
        tmp_path: pathlib.Path) -> None:
    """kombu's transport sends a message that arrives for a queue nobody consumes any more (a
    worker's quiet or drain cancels its task consumer while messages are on their way) back
    with the first channel it has, not the one that took it: the claim goes all the same, and
    the message is delivered once more, not again after the process ends."""
    settings = embedded_settings(tmp_path / "ojs")
    queue = new_queue()
    publish(settings, queue, {"n": 3})
    with Connection(settings["broker_url"],
                    transport_options=settings["broker_transport_options"]) as connection:
        first = connection.channel()
        second = connection.channel()
        raw = second._get(queue)  # taken by the second channel, as its consumer's poll does
        assert len(claimed(settings)) == 1
        connection.transport._reject_inbound_message(raw)  # kombu's path, on `first`
        assert claimed(settings) == []
        again = first.basic_get(queue)
        assert again is not None and again.payload == {"n": 3}
        again.ack()
        assert claimed(settings) == [] and first.basic_get(queue) is None


SWITCHING_CONSUMER = textwrap.dedent("""
    import sys, time
    from kombu import Connection, Consumer, Queue
    from ojs_celery.embedded import embedded_settings
    settings = embedded_settings(sys.argv[1])
    queue = Queue(sys.argv[2])
    with Connection(settings["broker_url"],
                    transport_options=settings["broker_transport_options"]) as connection:
        channel = connection.channel()
        got = []
        for no_ack in (True, False):  # first without acknowledgements, then with them
            consumer = Consumer(channel, [queue], no_ack=no_ack,
                                callbacks=[lambda body, message: got.append(body)])
            consumer.consume()
            while len(got) < (1 if no_ack else 2):
                connection.drain_events(timeout=10)
            consumer.cancel()
            print(got[-1], flush=True)  # the second: taken with acknowledgements, never acked
        time.sleep(120)
""")


def test_a_queue_consumed_without_acks_then_with_them_keeps_its_claims(
        tmp_path: pathlib.Path) -> None:
    """A queue's consumer without acknowledgements (``no_ack``) keeps no claims; the next
    consumer of the queue, with acknowledgements, does: a message it took and its process
    never acknowledged is delivered again once the process is killed (the queue's no-ack
    mark stayed, and the message was lost until the sweeper's redispatch)."""
    settings = embedded_settings(tmp_path / "ojs")
    queue = new_queue()
    publish(settings, queue, {"n": 0})
    consumer = subprocess.Popen(
        [sys.executable, "-c", SWITCHING_CONSUMER, str(tmp_path / "ojs"), queue],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert consumer.stdout is not None
        assert consumer.stdout.readline().strip() == "{'n': 0}"
        publish(settings, queue, {"n": 1})
        assert consumer.stdout.readline().strip() == "{'n': 1}"
        assert len(claimed(settings)) == 1
    finally:
        consumer.send_signal(signal.SIGKILL)
        consumer.wait(10)
    delivered_again(settings, queue)


@pytest.mark.parametrize("left", [(), (".locking",)], ids=["folder", "folder-and-locking"])
def test_a_claim_folder_whose_process_died_before_its_lock_is_removed(
        tmp_path: pathlib.Path, left: tuple[str, ...]) -> None:
    """A process killed between making its claim folder and naming its lock file left the
    folder (and perhaps its half-made ``.locking`` file) under ``broker/.claimed/`` for ever:
    a consumer's look for the claims of processes gone removes them once they are older than
    any process takes to make them; a folder made just now, and a live consumer's, stay."""
    settings = embedded_settings(tmp_path / "ojs")
    queue = new_queue()
    broker = pathlib.Path(settings["broker_transport_options"]["data_folder_in"])
    claims = broker / CLAIMS
    claims.mkdir()
    old = time.time() - ojsfs.ABANDONED_AFTER - 60
    dead = claims / "999999-dead"
    young = claims / "999998-young"
    for folder in (dead, young):
        folder.mkdir()
        for suffix in left:
            pathlib.Path(f"{folder}{suffix}").touch()
    for path in [dead, *(pathlib.Path(f"{dead}{suffix}") for suffix in left)]:
        os.utime(path, (old, old))
    publish(settings, queue, {"n": 1})
    with channel(settings) as chan:
        message = chan.basic_get(queue)  # this consumer's claim folder, and a look for leftovers
        assert message is not None and message.payload == {"n": 1}
        remaining = sorted(p.name for p in claims.iterdir())
        assert not any(name.startswith(dead.name) for name in remaining), remaining
        assert young.name in remaining
        assert len([name for name in remaining if name.endswith(".lock")]) == 1  # this one's
        message.ack()


def test_purging_a_queue_leaves_a_queue_whose_name_ends_like_it(tmp_path: pathlib.Path) -> None:
    """Purging ``<q>`` removes its messages only: kombu 5.4 to 5.6 also removed those of a
    queue named ``<x>.<q>`` (its rule is a substring of the file name; ``_get`` takes files
    by their exact queue part), whose jobs then waited for the redispatch backstop."""
    settings = embedded_settings(tmp_path / "ojs")
    short = new_queue()
    longer = f"reports.{short}"
    publish(settings, short, {"n": 1})
    publish(settings, longer, {"n": 2})
    with channel(settings) as chan:
        assert chan.queue_purge(short) == 1
        assert chan.basic_get(short) is None
        message = chan.basic_get(longer)
        assert message is not None and message.payload == {"n": 2}
        message.ack()
