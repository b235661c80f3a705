"""The ETA-held requests a worker lists, read from the consumer's timer as ``celery inspect
scheduled`` does (the only place Celery < 5.7 keeps them), with a real kombu timer."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kombu.asynchronous.timer import Timer

from ojs_celery.worker.node import eta_held


@dataclass(eq=False)
class Held:
    id: str


def test_requests_waiting_on_the_timer_are_held_and_cancelled_entries_are_not() -> None:
    timer = Timer()
    waiting, cancelled = Held("a"), Held("b")
    timer.call_at(time.time() + 60, lambda request: None, (waiting,), priority=6)
    timer.call_at(time.time() + 60, lambda request: None, (cancelled,), priority=6).cancel()
    timer.call_repeatedly(60, lambda: None)  # an entry without a request
    assert eta_held(timer) == [waiting]
    assert eta_held(None) == []
