"""Redis redelivers a running acks_late task after its visibility timeout: fencing drops it."""

from __future__ import annotations

import pathlib

from tests.conftest import start_env
from tests.workers import wait_for


def test_redis_redelivery_of_a_running_task_is_dropped(tmp_path: pathlib.Path) -> None:
    options = {"visibility_timeout": 2, "unacked_restore_interval": 1,
               "unacked_restore_throttle": 1}
    with start_env("redis", tmp_path, concurrency=2,
                   config={"broker_transport_options": options}) as env:
        callback = env.app.tasks["e2e.callback"].s(tag="redelivered")
        result = env.app.tasks["e2e.sleep"].apply_async(args=[7.0, "done"], link=callback)

        def copies() -> list[str]:
            return [line for line in env.lines("received") if result.id in line]

        wait_for(lambda: len(copies()) >= 2, 15, "kombu to redeliver the running task")
        job = env.wait_state(result.id, "completed", timeout=30)
        assert job.attempt == 1 and job.result == "done"
        assert any("redelivered=True" in line for line in copies()[1:])
        assert len([r for r in env.lines("runs") if result.id in r]) == 1
        wait_for(lambda: env.lines("callbacks"), 10, "the link callback")
        assert env.lines("callbacks") == ['redelivered "done"']
        assert result.get(timeout=10) == "done"
        assert env.events.types(result.id).count("job.started") == 1
