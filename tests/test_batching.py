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

    def _open(self) -> Handler[int]:
        def handle(batch: list[int]) -> None:
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
