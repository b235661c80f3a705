"""The ``ojsfs://`` transport's exchange tables (``control/<exchange>.exchange``) when several
processes bind queues at once: two workers started together on a new folder each bind their
remote-control queue to ``celery.pidbox``, event listeners theirs to ``celeryev``."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest
from kombu import Connection, Exchange, Producer, Queue
from kombu.transport import filesystem

from ojs_celery.embedded import embedded_settings
from tests.workers import ROOT, unique

EXCHANGES = 150

BINDER = textwrap.dedent("""
    import sys, time
    from kombu import Connection, Exchange, Queue
    from ojs_celery.embedded import embedded_settings
    settings = embedded_settings(sys.argv[1])
    name, start = sys.argv[2], float(sys.argv[3])
    with Connection(settings["broker_url"],
                    transport_options=settings["broker_transport_options"]) as connection:
        channel = connection.channel()
        while time.time() < start:  # both processes bind from the same moment
            pass
        for n in range(int(sys.argv[4])):
            Queue(f"{name}-{n}", Exchange(f"x{n}", type="fanout"))(channel).declare()
""")


def test_queues_bound_at_once_by_two_processes_are_all_in_a_whole_table(
        tmp_path: pathlib.Path) -> None:
    settings = embedded_settings(tmp_path / "ojs")
    start = time.time() + 1.5  # after both interpreters are up
    # names of different lengths: a shorter table written over a longer one broke its JSON
    binders = [subprocess.Popen([sys.executable, "-c", BINDER, str(tmp_path / "ojs"), name,
                                 str(start), str(EXCHANGES)], cwd=ROOT)
               for name in ("a", "bbbbbbbbbbbbbbbbbbbb")]
    assert [binder.wait(60) for binder in binders] == [0, 0]
    control = pathlib.Path(settings["broker_transport_options"]["control_folder"])
    broken = {}
    for n in range(EXCHANGES):
        text = (control / f"x{n}.exchange").read_text()
        try:
            queues = sorted(binding[2] for binding in json.loads(text))
        except ValueError:
            broken[n] = text
            continue
        if queues != [f"a-{n}", f"bbbbbbbbbbbbbbbbbbbb-{n}"]:
            broken[n] = text
    assert broken == {}, f"{len(broken)} of {EXCHANGES} tables lost a binding or broke"


def test_queues_bind_and_publish_on_kombus_without_an_exchange_file_helper(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kombu 5.4 to 5.6 (supported) give the filesystem channel no ``_exchange_file``: the
    exchange's file is ``control/<exchange>.exchange``, which declares and publishes find all
    the same (they failed with AttributeError)."""
    monkeypatch.delattr(filesystem.Channel, "_exchange_file", raising=False)
    settings = embedded_settings(tmp_path / "ojs")
    with Connection(settings["broker_url"],
                    transport_options=settings["broker_transport_options"]) as connection:
        channel = connection.channel()
        queue = Queue(unique("bind"), Exchange(unique("bindx")))
        queue(channel).declare()
        Producer(channel).publish({"n": 1}, exchange=queue.exchange,
                                  routing_key=queue.routing_key, retry=False)
        message = channel.basic_get(queue.name)
        assert message is not None and message.payload == {"n": 1}
        message.ack()
    control = pathlib.Path(settings["broker_transport_options"]["control_folder"])
    assert (control / f"{queue.exchange.name}.exchange").is_file()
