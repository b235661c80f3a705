"""The background batcher (``ojs_celery/batching.py``) that the event bus, the outbox
acknowledgements and the removals of acknowledged Redis deliveries share: a batch waits its
linger, and a flush hands over everything queued before it at once."""

from __future__ import annotations

import threading

from ojs_celery.batching import Batcher, Handler


class Recording(Batcher[int]):
    """Records each batch it is handed."""

    def __init__(self, linger: float) -> None:
        super().__init__(linger=linger, max_batch=100)
        self.batches: list[list[int]] = []
        self.handled = threading.Event()
        self.gate = threading.Event()  # a batch's handling waits for it
        self.gate.set()

    def _open(self) -> Handler[int]:
        def handle(batch: list[int]) -> None:
            self.gate.wait()
            self.batches.append(list(batch))
            self.handled.set()

        return handle


def test_a_flush_of_an_idle_batcher_leaves_the_next_batch_its_linger() -> None:
    """A flush made while the thread has nothing to do (a runtime's flush at exit or between
    tests) must not cut short the linger of the batch after it: the item put next waits, and
    the next flush hands it over."""
    batcher = Recording(linger=600.0)
    batcher.put(1)
    assert batcher.flush()
    assert batcher.batches == [[1]]
    assert batcher.flush()  # idle: the thread's first item is this flush's marker
    batcher.handled.clear()
    batcher.put(2)
    assert not batcher.handled.wait(0.5)  # lingering (600 s), not sent at once
    assert batcher.flush()
    assert batcher.batches == [[1], [2]]


def test_a_backlog_of_full_batches_goes_without_lingering() -> None:
    """Items queued while a batch is handled (a burst, a slow server) must not wait a linger
    per batch: every full batch already waiting goes at once. Lingering there would hold a
    backlog of events to ``max_batch`` per linger (4,000 a second for the event bus), and a
    flush at exit behind it would time out."""
    batcher = Recording(linger=600.0)
    batcher.gate.clear()
    batcher.put(0)
    assert not batcher.flush(timeout=0)  # ends the linger: [0] is handed over, and held
    for number in range(1, 301):  # three full batches queue behind it
        batcher.put(number)
    batcher.gate.set()
    assert batcher.flush(timeout=5.0)
    assert batcher.batches == [[0], list(range(1, 101)), list(range(101, 201)),
                               list(range(201, 301))]
