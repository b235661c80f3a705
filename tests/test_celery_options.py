"""Differential: Celery's task options and control-flow exceptions under plain Celery and with
``base=OJSTask`` (``tests/optionsapp.py``), each on a real prefork ``celery worker`` (Redis
broker and result backend, ``result_extended=True``), compared as a caller sees them: the
result's state, value and extended fields (``name``, ``args``, ``kwargs``, ``worker``,
``retries``, ``queue``) and how many times the body ran.

``tests/test_celery_hooks.py`` compares the hooks, signals and events of the same setup. The
differences that are the OJS design (``Ignore``, ``Reject``, ``self.retry(throw=False)``, a lost
pool process without ``acks_late``: README, "Celery callers") are not compared here.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult

from ojs_celery.testing import CeleryProcess
from tests import services
from tests.hooksapp import seen
from tests.optionsapp import make_app
from tests.workers import ROOT, forget_redis_names, unique, wait_for

pytestmark = pytest.mark.timeout(120)

MODES = ("plain", "ojs")
EXTENDED = ("name", "args", "kwargs", "retries")


class Side:
    """One side of the comparison: its app, its worker and the directory its tasks note in."""

    def __init__(self, mode: str, app: Celery, worker: CeleryProcess, directory: str) -> None:
        self.mode, self.app, self.worker, self.directory = mode, app, worker, directory

    def runs(self, name: str, since: int = 0) -> list[dict[str, Any]]:
        return [o for o in seen(self.directory)[since:]
                if o["what"] == "ran" and o["name"] == name]

    def runs_of(self, task_id: str) -> int:
        return sum(o["what"] == "ran" and o.get("id") == task_id
                   for o in seen(self.directory))


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Side]]:
    """A plain Celery worker and an OJS one, started together."""
    url = services.redis_url()
    started: dict[str, Side] = {}
    with ExitStack() as stack:
        names: list[str] = []  # removed last, once the workers are stopped
        stack.callback(forget_redis_names, url, names)
        for mode in MODES:
            directory = tmp_path_factory.mktemp(f"options-{mode}")
            config = {"ojs": mode == "ojs", "queue": unique("q"), "broker_url": url,
                      "result_backend": url, "event_exchange": unique("ev"),
                      "dir": str(directory), "result_extended": True,
                      "store": {"store_url": url, "store_prefix": unique("t")}}
            names += [config["queue"], config["event_exchange"],
                      config["store"]["store_prefix"]]
            env = {**os.environ, "OJS_OPTIONS_CONFIG": json.dumps(config),
                   "PYTHONPATH": str(ROOT)}
            worker = CeleryProcess(
                ["-A", "tests.optionsapp:app", "worker", "--pool", "prefork", "--concurrency",
                 "2", "--loglevel", "INFO", "--queues", config["queue"], "--hostname",
                 f"{unique('w')}@%h", "--without-gossip", "--without-mingle"],
                directory / "worker.log", env, cwd=ROOT)
            stack.callback(worker.stop)
            started[mode] = Side(mode, make_app(config), worker, str(directory))
        for side in started.values():
            side.worker.wait_ready(60)
        yield started


def outcome(result: AsyncResult, timeout: float = 20) -> dict[str, Any]:
    """What a caller sees of a finished call: its state and value (the id left out of the
    text) and its ``result_extended`` fields (``worker`` and ``queue`` as set or not)."""
    value = repr(result.get(timeout=timeout, propagate=False)).replace(result.id, "<id>")
    seen_ = {"state": result.state, "value": value,
             **{name: getattr(result, name) for name in EXTENDED}}
    seen_["worker"] = result.worker is not None
    seen_["queue"] = result.queue is not None
    return seen_


def compared(sides: dict[str, Side], calls: dict[str, Callable[[Celery], AsyncResult]],
             ) -> dict[str, dict[str, Any]]:
    """Each call on each side (all sent first, then waited for): what the caller saw and how
    many times the body ran, the two sides asserted equal; returns the plain side's."""
    found: dict[str, dict[str, Any]] = {}
    for mode, side in sides.items():
        sent = {key: call(side.app) for key, call in calls.items()}
        found[mode] = {key: outcome(result) for key, result in sent.items()}
        for key, result in sent.items():
            found[mode][key]["runs"] = side.runs_of(result.id)
    differing = {key: {mode: found[mode][key] for mode in MODES} for key in calls
                 if found["ojs"][key] != found["plain"][key]}
    assert not differing
    return found["plain"]


def test_celery_retry_paths_end_as_in_celery(sides: dict[str, Side]) -> None:
    """``self.retry`` past ``max_retries`` (the task's, the call's) with and without ``exc``,
    ``autoretry_for`` with ``retry_backoff``/``retry_backoff_max``/``retry_jitter``, with
    ``retry_kwargs`` and ``dont_autoretry_for``, ``max_retries=None``, a ``max_retries`` set
    by ``task_annotations``, and a retry with new positional or keyword arguments only
    (Celery 5.7 binds them to the task's signature: with OJS they were added to the call's, a
    ``TypeError`` in the next attempt)."""
    plain = compared(sides, {
        "exc": lambda app: app.tasks["o.exhaust"].delay(True),
        "no_exc": lambda app: app.tasks["o.exhaust"].delay(False),
        "call_max": lambda app: app.tasks["o.exhaust_call"].delay(),
        "auto": lambda app: app.tasks["o.autoretry"].delay(),
        "auto_kwargs": lambda app: app.tasks["o.auto_kwargs"].delay("key"),
        "not_auto": lambda app: app.tasks["o.auto_kwargs"].delay("index"),
        "unbounded": lambda app: app.tasks["o.unbounded"].apply_async((3,), {"k": "x"}),
        "annotated": lambda app: app.tasks["o.annotated"].delay(),
        "new_args": lambda app: app.tasks["o.rebind"].apply_async((1,), {"b": 2}),
        "new_kwargs": lambda app: app.tasks["o.rebind"].apply_async((1,), {"b": 2,
                                                                           "how": "kw"}),
    })
    assert plain["no_exc"]["value"] == (
        "MaxRetriesExceededError(\"Can't retry o.exhaust[<id>] args:(False,) kwargs:{}\")")
    assert (plain["auto"]["value"], plain["auto"]["retries"]) == ("KeyError('auto')", 2)
    assert (plain["unbounded"]["value"], plain["unbounded"]["runs"]) == ("3", 4)
    assert (plain["auto_kwargs"]["runs"], plain["not_auto"]["runs"]) == (2, 1)
    assert plain["annotated"]["runs"] == 2  # the annotation's max_retries=1
    assert (plain["new_args"]["value"], plain["new_kwargs"]["value"]) == ("[5, 6]", "[7, 0]")


def test_a_pending_retry_reads_as_in_celery(sides: dict[str, Side]) -> None:
    """While a ``self.retry(exc=..., countdown=2)`` waits: RETRY, the ``exc`` as ``info``,
    ``retries`` 0 and the ``Retry`` as the traceback's last line; then the retry's result."""
    sent = {mode: side.app.tasks["o.later"].delay() for mode, side in sides.items()}
    seen_: dict[str, Any] = {}
    for mode, result in sent.items():
        wait_for(lambda result=result: result.state == "RETRY", 10, f"RETRY ({mode})")
        seen_[mode] = {"state": result.state, "info": repr(result.info),
                       "retries": result.retries,
                       "last": (result.traceback or "").strip().splitlines()[-1:]}
    for mode, result in sent.items():
        seen_[mode]["end"] = outcome(result)
    assert seen_["ojs"] == seen_["plain"]
    assert seen_["plain"]["info"] == "KeyError('wait')"


def test_expiry_limits_and_a_lost_pool_process_end_as_in_celery(sides: dict[str, Side]) -> None:
    """``expires`` in the past (REVOKED, with the worker and queue that dropped it in the
    extended result: OJS left both empty), ahead, and passed while the message waits for its
    ``countdown``, a ``time_limit`` set by ``task_annotations``, a task's ``soft_time_limit``
    that the handler survives, and a pool process lost under ``acks_late`` +
    ``reject_on_worker_lost`` (the message runs again)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    flag = unique("flag")  # a file name: each side makes it in its own directory
    plain = compared(sides, {
        "expired": lambda app: app.tasks["o.slow"].apply_async(
            (0,), expires=now - datetime.timedelta(seconds=5)),
        "expires_later": lambda app: app.tasks["o.slow"].apply_async((0,), expires=60),
        "annotated_limit": lambda app: app.tasks["o.annot_limit"].delay(3),
        "soft_survived": lambda app: app.tasks["o.soft"].delay(3),
        "expired_at_its_eta": lambda app: app.tasks["o.soft"].apply_async(
            (0,), countdown=2, expires=1),
        "lost": lambda app: app.tasks["o.lost"].delay(flag),
    })
    assert plain["expired"] == {"state": "REVOKED", "value": "TaskRevokedError('expired')",
                                "name": "o.slow", "args": [0], "kwargs": {}, "retries": 0,
                                "worker": True, "queue": True, "runs": 0}
    assert plain["annotated_limit"]["value"] == "TimeLimitExceeded(1)"
    assert plain["soft_survived"]["value"] == "'cleaned up'"
    assert plain["expired_at_its_eta"]["value"] == "TaskRevokedError('expired')"
    assert (plain["lost"]["state"], plain["lost"]["runs"]) == ("SUCCESS", 2)


def test_rate_limit_spaces_the_runs_as_in_celery(sides: dict[str, Side]) -> None:
    """``rate_limit="4/s"``: four calls run a quarter of a second apart on both sides."""
    for side in sides.values():
        since = len(seen(side.directory))
        for result in [side.app.tasks["o.rated"].delay() for _ in range(4)]:
            result.get(timeout=20)
        at = [o["at"] for o in side.runs("o.rated", since)]  # noted before each returned
        assert len(at) == 4 and max(at) - min(at) >= 0.7, (side.mode, at)

