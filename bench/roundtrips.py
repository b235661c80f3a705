"""Hand-run count of what one job costs the Redis server: commands, round trips and bytes.

    .venv/bin/python bench/roundtrips.py            # 500 jobs per kind
    .venv/bin/python bench/roundtrips.py -n 2000

Not part of the test suite. The design's lower bound (issue 12) is stated in round trips and
bytes per job against plain Celery; this measures them instead of reading them off the code.
It starts a PRIVATE ``redis-server`` (no persistence) on a free port, used as broker and as
OJS job store, so that nobody else's commands are counted, and stops it at the end.

Per kind (a plain Celery task; the same no-op task as an ``OJSTask`` through ``enqueue``), two
phases, each between a ``CONFIG RESETSTAT`` and a read of ``INFO``:

- publish: N messages from this process, nobody consuming (for OJS: until its background
  outbox acknowledgements and events are flushed);
- run: ONE prefork ``celery worker`` (concurrency 2, without gossip, mingle and heartbeat)
  drains them; read when the last task has finished (its boot is in the phase: a few dozen
  commands, spread over N).

Printed per job: commands (``INFO commandstats`` calls; a pipeline or script counts each
command it runs, a script once as EVALSHA), read events (``total_reads_processed``: about one
per round trip, a pipeline is one), bytes in and out (``total_net_input_bytes`` /
``total_net_output_bytes``) and the server's CPU (``INFO cpu``, user + system; it includes
the event loop's idle polling, so compare the kinds within one run), with the commands that
make them up.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import redis

BENCH_DIR = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from benchapp import make_app  # noqa: E402
from chaos import RedisServer, free_port  # noqa: E402
from throughput import count_ends, make_config, publish_all, unique, worker_process  # noqa: E402

from ojs_celery.runtime import get_runtime  # noqa: E402

KINDS = ("plain", "ojs")


@dataclass
class Phase:
    commands: Counter[str]
    reads: int
    bytes_in: int
    bytes_out: int
    cpu: float = 0.0  # the server's CPU seconds (user + system) in the phase


def server_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def reset(client: redis.Redis) -> float:
    """Zero the counters; returns the server's CPU seconds so far (INFO cannot reset them)."""
    client.config_resetstat()
    return server_cpu(client)


def read_phase(client: redis.Redis, cpu_before: float) -> Phase:
    cpu = server_cpu(client) - cpu_before
    stats = client.info("commandstats")
    commands = Counter({name.removeprefix("cmdstat_"): int(value["calls"])
                        for name, value in stats.items()})
    info = client.info("stats")
    # the INFO calls of this read itself are not the job's
    commands["info"] -= 4
    commands["config|resetstat"] = 0
    return Phase(+commands, int(info["total_reads_processed"]) - 4,
                 int(info["total_net_input_bytes"]), int(info["total_net_output_bytes"]), cpu)


def run_kind(kind: str, n: int, url: str, tmp: pathlib.Path) -> tuple[Phase, Phase]:
    client = redis.Redis.from_url(url)
    queue = unique(f"rt_{kind}_")
    config = make_config(url, queue, unique("rtev_"), unique("rt_"))
    app = make_app(config)
    try:
        # warm-up outside the counts: connections, script loads, the queue's bindings
        publish_all(app, kind, 5)
        client.delete(queue)
        cpu = reset(client)
        publish_all(app, kind, n)
        if kind == "ojs":
            get_runtime(app).bus.flush()
            get_runtime(app).acks.flush()
        published = read_phase(client, cpu)
        stamps = tmp / queue
        stamps.mkdir()
        cpu = reset(client)
        with worker_process(config, unique("rtw") + "@bench", tmp / f"{queue}.log",
                            {"OJS_BENCH_STAMPS": str(stamps)}) as process:
            deadline = time.monotonic() + 300
            while count_ends(stamps) < n:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker did not finish: see {tmp / queue}.log")
                time.sleep(0.2)
            time.sleep(0.5)  # the last acks and the event batch of the last tasks
            ran = read_phase(client, cpu)
        return published, ran
    finally:
        runtime = get_runtime(app)
        runtime.close()
        app.close()
        client.close()


def describe(phase: Phase, n: int) -> str:
    top = ", ".join(f"{name} {calls / n:.2f}" for name, calls in phase.commands.most_common(8)
                    if calls / n >= 0.01)
    return (f"{sum(phase.commands.values()) / n:5.2f} commands, {phase.reads / n:5.2f} reads, "
            f"{phase.bytes_in / n:6.0f} B in, {phase.bytes_out / n:6.0f} B out, "
            f"{phase.cpu / n * 1e6:4.0f} us server CPU  ({top})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("-n", type=int, default=500, help="jobs per kind")
    options = parser.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ojs-rt-"))
    server = RedisServer(tmp, free_port(), durable=False)
    server.start()
    results: dict[str, Any] = {}
    try:
        for kind in KINDS:
            results[kind] = run_kind(kind, options.n, server.url, tmp)
    finally:
        server.stop()
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"Per job, {options.n} jobs per kind, Redis broker and Redis job store:")
    for kind in KINDS:
        published, ran = results[kind]
        print(f"  {kind:5} publish: {describe(published, options.n)}")
        print(f"  {kind:5} run:     {describe(ran, options.n)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
