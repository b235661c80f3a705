"""Hand-run throughput benchmark: OJS tasks and enqueue vs plain Celery, on Redis.

    .venv/bin/python bench/throughput.py              # the benchmark (about a minute)
    .venv/bin/python bench/throughput.py --diagnose   # also OJS with ojs.events = False
    .venv/bin/python bench/throughput.py --profile    # then cProfile the OJS paths

Not part of the test suite. Needs Redis at ``--redis`` (default redis://127.0.0.1:6379/0), used
as broker and as OJS job store (unique key prefix); every key it creates is removed at the end.

What is measured
----------------
Worker throughput: N no-op tasks through ONE ``celery worker`` subprocess (prefork,
concurrency 2, ``--without-gossip --without-mingle --without-heartbeat``, loglevel WARNING),
for (a) a plain Celery task and (b) an ``OJSTask`` with the Redis job store. Both tasks are
``ignore_result`` with no result backend, and each trial has its own queue. The queue is
pre-loaded with all N messages *before* the worker starts, so worker boot time is not measured.
The clock runs from the first ``task_prerun`` to the last ``task_postrun`` in the pool children
(wall-clock stamps written to local files, see ``benchapp.py``). Those signals bracket the whole
task call, so every OJS store round trip and event emission is inside the window; what is
outside is only the first message's fetch and the last message's ack, one task's worth each,
the same for both. Rate = N / window. ``OJSTask`` is ``acks_late`` and its messages carry time
limits; the plain task keeps Celery's defaults (early ack, no limits): that is part of the cost
of OJS. Also printed: mean wall time per task inside the child, and the CPU the worker used
per task (main process and children, from /proc, boot excluded), which is steadier than rates
on a shared machine.

Enqueue rate: ``ojs_celery.enqueue(envelope)`` vs ``app.send_task(name, args)``, 5,000 each
(``--enqueue-n``), from this process, same broker, same queue (nobody consumes it; it is
purged after each trial), after a short warm-up. OJS event publishing happens on a background
thread; its GIL time during the loop counts, what is still buffered when the loop ends does
not.

Noise: trials alternate (plain/OJS, then OJS/plain) ``--rounds`` times (3) and the best rate of
each kind is kept. The machine, Redis and the worker's main process are shared by both kinds.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pathlib
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis
from kombu.transport.redis import PRIORITY_STEPS
from kombu.transport.redis import Channel as RedisChannel

BENCH_DIR = pathlib.Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from benchapp import make_app  # noqa: E402

import ojs_celery  # noqa: E402
from ojs_celery.runtime import get_runtime  # noqa: E402
from ojs_celery.store.redis import RedisStore  # noqa: E402

WORKER_TARGET = 0.75
ENQUEUE_TARGET = 0.6
WORKER_TIMEOUT = 90.0


def unique(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


# ---------------------------------------------------------------------------------- bookkeeping


class Keys:
    """Everything this run creates in Redis, so that it can all be removed."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.queues: list[str] = []
        self.exchanges: list[str] = []
        self.hostnames: list[str] = []
        self.store_prefixes: list[str] = []

    def purge_queue(self, queue: str) -> None:
        """Delete the queue's lists (kombu keeps one per priority step: ``queue`` and
        ``queue\\x06\\x16N``), by name: a ``SCAN`` walks the whole keyspace, which
        ``bench/scale.py`` fills with a million jobs (a second of server CPU per purge)."""
        self.client.unlink(queue, *(f"{queue}{RedisChannel.sep}{step}"
                                    for step in PRIORITY_STEPS if step))

    def cleanup(self) -> None:
        client = self.client
        for queue in self.queues:
            self.purge_queue(queue)
            client.unlink(f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
        for exchange in self.exchanges:
            client.unlink(f"_kombu.binding.{exchange}")
        # Messages a stopped worker had not acked (only after an aborted trial).
        mine = tuple(self.queues)
        if mine:
            for tag, raw in client.hscan_iter("unacked"):
                try:
                    routing_key = json.loads(raw)[2]
                except (ValueError, IndexError, TypeError):
                    continue
                if routing_key in mine:
                    client.hdel("unacked", tag)
                    client.zrem("unacked_index", tag)
        # The workers' remote-control (pidbox) bindings and reply queues.
        for key in ("_kombu.binding.celery.pidbox", "_kombu.binding.reply.celery.pidbox"):
            for member in client.smembers(key):
                text = member.decode(errors="replace")
                if any(host in text for host in self.hostnames):
                    client.srem(key, member)
        for host in self.hostnames:
            for key in client.scan_iter(match=_glob(host) + "*", count=1000):
                client.unlink(key)
        for prefix in self.store_prefixes:
            for key in client.scan_iter(match=_glob(prefix) + ":*", count=1000):
                client.unlink(key)


def _glob(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


def make_config(redis_url: str, queue: str, exchange: str, store_prefix: str,
                events: bool = True, store_url: str | None = None) -> dict[str, Any]:
    """The bench app's config: a Redis broker, and the job store at ``store_url`` (the same
    Redis when None)."""
    return {
        "broker_url": redis_url,
        "queue": queue,
        "event_exchange": exchange,
        "ojs": {"store_url": store_url or redis_url, "store_prefix": store_prefix,
                "events": events},
    }


# ---------------------------------------------------------------------------------- worker


@dataclass
class WorkerTrial:
    kind: str
    n: int
    window: float
    child_ms: float  # mean time per task inside the pool child (prerun to postrun)
    cpu_ms: float  # CPU (user+sys) of the worker's main process and children, per task
    main_cpu_ms: float  # the worker's main process alone, per task
    states: dict[str, int]
    store_ok: int | None = None  # OJS only: jobs the store shows as completed

    @property
    def rate(self) -> float:
        return self.n / self.window


def is_ojs(kind: str) -> bool:
    return kind.startswith("ojs")


def publish_all(app: Any, kind: str, n: int) -> list[str]:
    ids: list[str] = []
    if not is_ojs(kind):
        for _ in range(n):
            ids.append(app.send_task("bench.plain", args=[]).id)
    else:
        for _ in range(n):
            ids.append(ojs_celery.enqueue({"type": "bench.ojs", "args": []}, app=app).id)
        get_runtime(app).bus.flush()
    return ids


@contextmanager
def worker_process(config: dict[str, Any], hostname: str, log: pathlib.Path,
                   extra_env: dict[str, str], *, app: str = "benchapp:app",
                   config_var: str = "OJS_BENCH_CONFIG") -> Iterator[subprocess.Popen[bytes]]:
    """One prefork ``celery worker`` (concurrency 2, no gossip, mingle or heartbeat) of the
    bench app ``app``, which reads ``config`` from the environment variable ``config_var``;
    stopped with SIGTERM (SIGKILL after 30 s) when the block ends."""
    env = {**os.environ, config_var: json.dumps(config),
           "PYTHONPATH": os.pathsep.join([str(BENCH_DIR), str(ROOT)]), **extra_env}
    command = [
        sys.executable, "-m", "celery", "-A", app, "worker",
        "--pool", "prefork", "--concurrency", "2", "--loglevel", "WARNING",
        "--queues", config["queue"], "--hostname", hostname,
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]
    with open(log, "ab") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(5)


def read_stamps(directory: pathlib.Path) -> tuple[dict[str, float], dict[str, tuple[float, str]]]:
    starts: dict[str, float] = {}
    ends: dict[str, tuple[float, str]] = {}
    for path in directory.glob("stamps-*.txt"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "S":
                starts[parts[1]] = float(parts[2])
            elif len(parts) >= 4 and parts[0] == "E":
                ends[parts[1]] = (float(parts[2]), parts[3])
    return starts, ends


def count_ends(directory: pathlib.Path) -> int:
    total = 0
    for path in directory.glob("stamps-*.txt"):
        total += sum(line.startswith(b"E ") for line in path.read_bytes().split(b"\n"))
    return total


HERTZ = os.sysconf("SC_CLK_TCK")


def proc_stat(pid: int | str) -> tuple[str, list[str]] | None:
    """A process's name and the fields of ``/proc/<pid>/stat`` after it (``[1]`` the parent,
    ``[11]``/``[12]`` user and system ticks, ``[13]``/``[14]`` those of its reaped children);
    None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            head, _, rest = handle.read().rpartition(")")
    except OSError:
        return None
    return head.partition("(")[2], rest.split()


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by one process (0 if it is gone)."""
    stat = proc_stat(pid)
    return 0.0 if stat is None else (int(stat[1][11]) + int(stat[1][12])) / HERTZ


def tree_cpu(root: int) -> tuple[float, float]:
    """CPU seconds (user + system) used so far by ``root`` and by its children (Linux /proc)."""
    ticks = [0, 0]
    for entry in os.scandir("/proc"):
        stat = proc_stat(entry.name) if entry.name.isdigit() else None
        if stat is None:
            continue
        fields = stat[1]
        used = int(fields[11]) + int(fields[12])
        if int(entry.name) == root:
            ticks[0] += used
        elif int(fields[1]) == root:
            ticks[1] += used
    return ticks[0] / HERTZ, ticks[1] / HERTZ


def worker_trial(kind: str, n: int, redis_url: str, keys: Keys, tmp: pathlib.Path,
                 store_prefix: str, exchange: str,
                 extra_env: dict[str, str] | None = None,
                 store_url: str | None = None) -> WorkerTrial:
    """kind: ``plain``, ``ojs``, or ``ojs-noevents`` (OJS with ``events: False``, diagnostic);
    ``store_url``: the job store (the broker's Redis when None)."""
    queue = unique(f"bench_{kind.replace('-', '_')}_")
    keys.queues.append(queue)
    hostname = unique("benchw") + "@bench"
    keys.hostnames.append(hostname)
    config = make_config(redis_url, queue, exchange, store_prefix,
                         events=kind != "ojs-noevents", store_url=store_url)
    app = make_app(config)
    try:
        ids = publish_all(app, kind, n)
        stamps = tmp / queue
        stamps.mkdir()
        log = tmp / f"{queue}.log"
        env = {"OJS_BENCH_STAMPS": str(stamps), **(extra_env or {})}
        # CPU from the first finished task to the last (boot excluded), per task in between.
        cpu_from: tuple[int, tuple[float, float]] | None = None
        with worker_process(config, hostname, log, env) as process:
            deadline = time.monotonic() + WORKER_TIMEOUT
            while (done := count_ends(stamps)) < n:
                if cpu_from is None and done:
                    cpu_from = (done, tree_cpu(process.pid))
                if process.poll() is not None:
                    raise RuntimeError(f"worker exited early:\n{log.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker did not finish {n} tasks in {WORKER_TIMEOUT}s:\n"
                                       f"{log.read_text()[-3000:]}")
                time.sleep(0.2)
            cpu_to = tree_cpu(process.pid)
        if cpu_from is None:  # everything finished before the first look
            cpu_from = (0, cpu_to)
        counted = max(n - cpu_from[0], 1)
        main_ms = (cpu_to[0] - cpu_from[1][0]) / counted * 1000
        cpu_ms = main_ms + (cpu_to[1] - cpu_from[1][1]) / counted * 1000
        starts, ends = read_stamps(stamps)
        window = max(t for t, _ in ends.values()) - min(starts.values())
        per_task = [ends[i][0] - starts[i] for i in ends if i in starts]
        states: dict[str, int] = {}
        for _, state in ends.values():
            states[state] = states.get(state, 0) + 1
        trial = WorkerTrial(kind, len(ends), window, statistics.fmean(per_task) * 1000, cpu_ms,
                            main_ms, states)
        if is_ojs(kind):
            trial.store_ok = completed_in_store(app, ids)
        keys.purge_queue(queue)
        return trial
    finally:
        runtime = get_runtime(app)
        runtime.bus.flush()
        runtime.close()
        app.close()


def completed_in_store(app: Any, ids: list[str]) -> int:
    store = get_runtime(app).store
    if not isinstance(store, RedisStore):  # a SQL store: read the records, a chunk at a time
        return sum(1 for start in range(0, len(ids), 1000)
                   for record in store.get_records(ids[start:start + 1000])
                   if record is not None and record.job.state == "completed")
    client = store.client
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        pipe.hget(store._job_prefix + job_id, "state")  # type: ignore[attr-defined]
    return sum(1 for state in pipe.execute() if state == "completed")


# ---------------------------------------------------------------------------------- enqueue


def enqueue_call(app: Any, kind: str) -> Callable[[], Any]:
    if not is_ojs(kind):
        return lambda: app.send_task("bench.plain", args=[])
    return lambda: ojs_celery.enqueue({"type": "bench.ojs", "args": []}, app=app)


def enqueue_trial(app: Any, kind: str, n: int, keys: Keys, queue: str) -> float:
    """Messages per second of ``n`` enqueues (see :func:`enqueue_trial_cpu`)."""
    return enqueue_trial_cpu(app, kind, n, keys, queue)[0]


def enqueue_trial_cpu(app: Any, kind: str, n: int, keys: Keys, queue: str
                      ) -> tuple[float, float]:
    """``(messages per second, CPU ms per message)`` of ``n`` enqueues from this process. The
    CPU is the whole process's (every thread: the event and outbox batching included), from the
    first call to the flush of what the calls left buffered."""
    call = enqueue_call(app, kind)
    for _ in range(20):  # warm-up: connections, Lua script load, cached broker driver
        call()
    get_runtime(app).bus.flush()
    cpu = time.process_time()
    start = time.perf_counter()
    for _ in range(n):
        call()
    elapsed = time.perf_counter() - start
    get_runtime(app).bus.flush()
    get_runtime(app).acks.flush()
    cpu_ms = (time.process_time() - cpu) * 1000 / n
    keys.purge_queue(queue)
    return n / elapsed, cpu_ms


# ---------------------------------------------------------------------------------- profiling


def print_stats(stats: pstats.Stats, title: str, limit: int) -> None:
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        stats.stream = out  # type: ignore[attr-defined]
        stats.sort_stats(order).print_stats(limit)
        text = out.getvalue()
        start = text.find("   ncalls")
        print(f"\n--- {title}, by {order} ---")
        print(text[start:] if start >= 0 else text)


def profile_enqueue(app: Any, n: int) -> None:
    call = enqueue_call(app, "ojs")
    for _ in range(20):
        call()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        call()
    profile.disable()
    get_runtime(app).bus.flush()
    print_stats(pstats.Stats(profile), f"cProfile: {n} x ojs_celery.enqueue (this process)", 30)


def profile_worker(n: int, redis_url: str, keys: Keys, tmp: pathlib.Path, store_prefix: str,
                   exchange: str) -> None:
    """cProfile in each pool child's main thread (not the worker's main process, not the
    event thread: use py-spy for those)."""
    folder = tmp / "profiles"
    folder.mkdir()
    trial = worker_trial("ojs", n, redis_url, keys, tmp, store_prefix, exchange,
                         {"OJS_BENCH_PROFILE": str(folder)})
    dumps = sorted(str(p) for p in folder.glob("child-*.prof"))
    if not dumps:
        print("\n(no child profiles written)")
        return
    print(f"\n(profiled OJS worker trial: {trial.rate:.0f} tasks/s under cProfile, "
          f"{len(dumps)} children)")
    print_stats(pstats.Stats(*dumps), f"cProfile: pool children running {n} OJS tasks", 35)


# ---------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("-n", type=int, default=2000, help="tasks per worker trial")
    parser.add_argument("--enqueue-n", type=int, default=5000,
                        help="messages per enqueue trial (a trial of 2,000 lasts about a second: "
                             "too short to be steady on a shared machine)")
    parser.add_argument("--rounds", type=int, default=3, help="trials per kind (best is kept)")
    parser.add_argument("--diagnose", action="store_true",
                        help="also run OJS with events off (ojs.events = False)")
    parser.add_argument("--profile", action="store_true",
                        help="after the benchmark, cProfile the OJS enqueue loop and workers")
    options = parser.parse_args()
    n = options.n
    kinds = ["plain", "ojs", *(["ojs-noevents"] if options.diagnose else [])]

    client = redis.Redis.from_url(options.redis)
    client.ping()
    keys = Keys(client)
    run = uuid.uuid4().hex[:8]
    store_prefix = f"bench_{run}"
    exchange = f"benchev_{run}"
    keys.store_prefixes.append(store_prefix)
    keys.exchanges.append(exchange)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ojs-bench-"))
    began = time.monotonic()
    worker: dict[str, list[WorkerTrial]] = {kind: [] for kind in kinds}
    enqueue: dict[str, list[float]] = {kind: [] for kind in kinds}
    enqueue_cpu: dict[str, list[float]] = {kind: [] for kind in kinds}

    def order(round_: int) -> list[str]:
        return kinds if round_ % 2 == 0 else kinds[::-1]

    try:
        for round_ in range(options.rounds):
            for kind in order(round_):
                trial = worker_trial(kind, n, options.redis, keys, tmp, store_prefix, exchange)
                worker[kind].append(trial)
                extra = f", store: {trial.store_ok} completed" if is_ojs(kind) else ""
                print(f"worker  {kind:12} round {round_ + 1}: {trial.rate:6.0f} tasks/s "
                      f"({trial.n} in {trial.window:.2f}s; per task {trial.child_ms:.2f} ms in "
                      f"child, {trial.cpu_ms:.2f} ms CPU; {trial.states}{extra})", flush=True)

        queue = unique("bench_enq_")
        keys.queues.append(queue)
        apps = {kind: make_app(make_config(options.redis, queue, exchange, store_prefix,
                                           events=kind != "ojs-noevents")) for kind in kinds}
        try:
            for round_ in range(options.rounds):
                for kind in order(round_):
                    rate, cpu_ms = enqueue_trial_cpu(apps[kind], kind, options.enqueue_n, keys,
                                                     queue)
                    enqueue[kind].append(rate)
                    enqueue_cpu[kind].append(cpu_ms)
                    print(f"enqueue {kind:12} round {round_ + 1}: {rate:6.0f} msgs/s, "
                          f"{cpu_ms:.3f} ms CPU per message", flush=True)
            if options.profile:
                profile_enqueue(apps["ojs"], n)
        finally:
            for app in apps.values():
                get_runtime(app).close()
                app.close()
        if options.profile:
            profile_worker(n, options.redis, keys, tmp, store_prefix, exchange)
    finally:
        keys.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)

    report(n, options.enqueue_n, options.rounds, worker, enqueue, enqueue_cpu,
           time.monotonic() - began)
    return 0


def report(n: int, enqueue_n: int, rounds: int, worker: dict[str, list[WorkerTrial]],
           enqueue: dict[str, list[float]], enqueue_cpu: dict[str, list[float]],
           took: float) -> None:
    best_worker = {kind: max(t.rate for t in trials) for kind, trials in worker.items()}
    best_enqueue = {kind: max(rates) for kind, rates in enqueue.items()}
    print(f"\nBest of {rounds}, {n} tasks per worker trial, {enqueue_n} messages per enqueue "
          f"trial, Redis broker + Redis job store, {os.cpu_count()} CPUs ({took:.0f}s in all)")
    print(f"{'':22} {'plain':>7} {'OJS':>7} {'OJS/plain':>10} {'target':>8}")
    for name, best, target in (("worker  (tasks/s)", best_worker, WORKER_TARGET),
                               ("enqueue (msgs/s)", best_enqueue, ENQUEUE_TARGET)):
        ratio = best["ojs"] / best["plain"]
        verdict = "ok" if ratio >= target else "MISSED"
        print(f"{name:22} {best['plain']:7.0f} {best['ojs']:7.0f} {ratio:10.2f} "
              f"{'>= ' + str(target):>8}  {verdict}")
        if "ojs-noevents" in best:
            other = best["ojs-noevents"]
            print(f"{'  OJS, events off':22} {'':7} {other:7.0f} {other / best['plain']:10.2f}")
    print("\nworker, per task (median of trials)  wall in child  CPU main+children  CPU main")
    for kind, trials in worker.items():
        print(f"  {kind:34} {statistics.median(t.child_ms for t in trials):6.2f} ms "
              f"{statistics.median(t.cpu_ms for t in trials):14.2f} ms "
              f"{statistics.median(t.main_cpu_ms for t in trials):8.2f} ms")
    print("\nenqueue, CPU per message in the producer process (median of trials)")
    for kind, values in enqueue_cpu.items():
        print(f"  {kind:34} {statistics.median(values):6.3f} ms")


if __name__ == "__main__":
    sys.exit(main())
