"""A queue a worker was told to consume at run time (``celery control add_consumer``) stops
with the others when the worker goes quiet or drains, and a queue it was told to drop
(``cancel_consumer``) stays dropped when it resumes."""

from __future__ import annotations

import pathlib
import re
import signal
import time

from ojs_celery import enqueue
from ojs_celery.runtime import get_runtime
from tests.conftest import Env, start_env
from tests.workers import unique, wait_for

#: Long enough for a consumer that still listens on a queue to take a job from it.
SETTLE = 4.0
#: How long a log line may take after the signal or command that causes it: generous, as the
#: worker's event loop answers it after whatever else a loaded machine gives it first.
LOG_WAIT = 30.0


def _read_nodename(env: Env) -> str:
    """The worker's Celery node name, from its log (a broadcast ``ping`` on a shared broker
    would be answered by other runs' workers too)."""
    found = re.search(r"(\S+@\S+) ready\.", env.worker.log())
    assert found, "the worker's node name is not in its log"
    return found.group(1)


def _await_log(env: Env, text: str, count: int, what: str) -> None:
    """Wait until the worker's log holds ``text`` ``count`` times; fail with the log's tail
    (two waits of this kind failed once each under load, in whole-suite runs)."""
    try:
        wait_for(lambda: env.worker.log().count(text) == count, LOG_WAIT, what)
    except AssertionError as missed:
        raise AssertionError(f"{missed}; the worker's log ends:\n"
                             f"{env.worker.log()[-3000:]}") from None


def _registered_queues(env: Env, node: str) -> list[str]:
    """The queues the job store's worker registry lists for the worker ``node``."""
    return [name for info in get_runtime(env.app).store.workers.all()
            if info.nodename == node for name in info.queues]


def test_quiet_stops_a_queue_added_at_run_time_and_resume_keeps_a_dropped_one(
    tmp_path: pathlib.Path,
) -> None:
    with start_env("redis", tmp_path, concurrency=2) as env:
        node = _read_nodename(env)
        added = unique("q")
        replies = env.app.control.add_consumer(added, destination=[node], reply=True)
        assert replies and "ok" in replies[0][node], replies
        ran = enqueue({"type": "e2e.add", "args": [1, 1], "queue": added}, app=env.app)
        env.wait_state(ran.id, "completed")  # the worker consumes the added queue
        wait_for(lambda: added in _registered_queues(env, node), 20,
                 "the registry to list the added queue")

        env.worker.process.send_signal(signal.SIGTSTP)  # quiet
        _await_log(env, f"Canceling queue {added}", 1,
                   "the quiet worker to cancel the added queue")  # Celery's own line
        held = enqueue({"type": "e2e.add", "args": [2, 2], "queue": added}, app=env.app)
        time.sleep(SETTLE)
        assert env.job(held.id).state == "available", "a quiet worker started a job"

        env.worker.process.send_signal(signal.SIGCONT)  # running again: the job runs
        env.wait_state(held.id, "completed")

        # an operator drops the app's own queue; quiet and resume do not bring it back
        replies = env.app.control.cancel_consumer(env.config["queue"], destination=[node],
                                                  reply=True)
        assert replies and "ok" in replies[0][node], replies
        env.worker.process.send_signal(signal.SIGTSTP)
        _await_log(env, " is quiet ", 2, "quiet again")
        env.worker.process.send_signal(signal.SIGCONT)
        # the added queue consumed again (add_consumer, then each resume), in Celery's words
        _await_log(env, f"Started consuming from {added}", 3, "the second resume")
        wait_for(lambda: _registered_queues(env, node) == [added], 20,
                 "the registry to list the queues it serves, the dropped one not")
        dropped = enqueue({"type": "e2e.add", "args": [3, 3]}, app=env.app)
        time.sleep(SETTLE)
        assert env.job(dropped.id).state == "available", "resume consumed a dropped queue"
        env.app.control.add_consumer(env.config["queue"], destination=[node], reply=True)
        env.wait_state(dropped.id, "completed")


def test_the_drain_stops_a_queue_added_at_run_time(tmp_path: pathlib.Path) -> None:
    with start_env("redis", tmp_path, concurrency=2) as env:
        node = _read_nodename(env)
        added = unique("q")
        env.app.control.add_consumer(added, destination=[node], reply=True)
        long = enqueue({"type": "e2e.sleep", "args": [SETTLE + 2]}, app=env.app)
        wait_for(lambda: env.lines("runs"), 10, "the long job started")
        env.worker.process.send_signal(signal.SIGTERM)  # drains while the long job runs
        _await_log(env, f"Canceling queue {added}", 1, "the drain to cancel the added queue")
        late = enqueue({"type": "e2e.add", "args": [4, 4], "queue": added}, app=env.app)
        env.wait_state(long.id, "completed")
        assert env.worker.process.wait(30) == 0
        assert env.job(late.id).state == "available", "a draining worker started a job"
        assert not [line for line in env.lines("runs") if late.id in line]
