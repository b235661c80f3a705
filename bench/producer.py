"""Hand-run benchmark: a producer alone, ``.apply_async()`` with nobody consuming, per thread.

    .venv/bin/python bench/producer.py                                # redis-redis, 3,000 calls
    .venv/bin/python bench/producer.py --pairs redis-redis,redis-pg --rounds 3
    .venv/bin/python bench/producer.py --cpus 0                       # pinned to one CPU
    .venv/bin/python bench/producer.py --switch-interval 0.05 --gc-freeze
    .venv/bin/python bench/producer.py --setting events=false

Not part of the test suite. Needs the services of the test suite; reuses ``bench/caller.py``'s
pairings and removes what it creates. Each trial is a fresh process (``--measure``) that builds
the app, warms it with 20 calls, then times ``-n`` calls; plain Celery and OJS alternate.

Per trial it prints the rate of the loop and, per thread of the process, from
``/proc/self/task/<tid>``: the CPU time it ran (``schedstat``'s first field, in ns), the time it
waited runnable for a CPU (``schedstat``'s second field: the run queue's delay) and its
voluntary and involuntary context switches (``status``), each per call; plus the garbage
collector's collections per call (``gc.get_stats()``). The background threads' figures include
the flush after the loop (their work for the loop's calls).

Why: a producer's main thread executes about as many instructions per OJS call as per plain
call (``bench/instructions.py``) yet spends more CPU time on it; this isolates the producer from
a worker sharing the two cores, and lets the thread handoffs (``--cpus``, ``--switch-interval``,
``--setting events=false``) and the collector (``--gc-freeze``) be varied one at a time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

BENCH_DIR = pathlib.Path(__file__).resolve().parent
PAIRS = ("redis-redis", "redis-pg", "amqp-redis", "amqp-pg", "embedded")
TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def thread_stats() -> dict[str, list[int]]:
    """Per thread of this process, by name: [run ns, run-queue delay ns, voluntary and
    involuntary switches, user ns, system ns, minor page faults]."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    stats: dict[str, list[int]] = {}
    for tid in os.listdir("/proc/self/task"):
        base = f"/proc/self/task/{tid}"
        try:
            run, delay, _ = (int(v) for v in pathlib.Path(f"{base}/schedstat").read_text().split())
            status = pathlib.Path(f"{base}/status").read_text()
            stat = pathlib.Path(f"{base}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        name = names.get(int(tid), f"tid{tid}")
        if name == "MainThread":
            name = "main"
        stats[name] = [run, delay, int(fields["voluntary_ctxt_switches"]),
                       int(fields["nonvoluntary_ctxt_switches"]),
                       # utime and stime, clock ticks to ns
                       int(stat[11]) * TICK_NS, int(stat[12]) * TICK_NS,
                       int(stat[7])]  # minor page faults
    return stats


def collections() -> int:
    return sum(generation["collections"] for generation in gc.get_stats())


def measured(kind: str, pair: str, run: str, queue: str, n: int,
             options: argparse.Namespace) -> None:
    sys.path.insert(0, str(BENCH_DIR))
    from caller import WARMUP, Pairing, flush
    from callerapp import TASK_NAME, make_app

    if options.cpus:
        os.sched_setaffinity(0, {int(c) for c in options.cpus.split(",")})
    if options.switch_interval:
        sys.setswitchinterval(options.switch_interval)
    pairing = Pairing(pair, options, pathlib.Path(tempfile.mkdtemp()), run=run)
    app = make_app(pairing.config(kind, queue))
    task = app.tasks[TASK_NAME]
    for _ in range(WARMUP):
        task.apply_async()
    flush(app, kind)
    if options.gc_freeze:
        gc.collect()
        gc.freeze()
    before, gc_before = thread_stats(), collections()
    wall = time.perf_counter()
    for _ in range(n):
        task.apply_async()
    wall = time.perf_counter() - wall
    gc_after = collections()
    flush(app, kind)
    after = thread_stats()
    calls = max(n, 1)
    threads = {name: [(a - b) / calls for a, b in zip(values, before.get(name, [0] * 7),
                                                      strict=True)]
               for name, values in after.items()}
    print(json.dumps({"rate": n / wall, "gc": (gc_after - gc_before) / calls,
                      "threads": threads}))
    sys.stdout.flush()
    os._exit(0)


def trial(kind: str, pairing: Any, n: int, forwarded: list[str]) -> dict[str, Any]:
    queue = pairing.new_queue()
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--measure", kind, pairing.name, pairing.run, queue,
             "-n", str(n), *forwarded], check=True, capture_output=True, text=True).stdout
    finally:
        pairing.purge(pairing.janitor, queue)
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def describe(kind: str, result: dict[str, Any]) -> str:
    parts = [f"{kind:5} {result['rate']:6.0f}/s gc {result['gc']:.3f}/call"]
    for name, (run, delay, vol, invol, user, system, faults) in sorted(result["threads"].items()):
        if run < 1000 and name != "main":
            continue  # idle threads (< 1 µs a call)
        parts.append(f"{name}: cpu {run / 1000:.0f} µs wait {delay / 1000:.0f} µs "
                     f"vcs {vol:.2f} ics {invol:.2f} (user {user / 1000:.0f} "
                     f"sys {system / 1000:.0f}) minflt {faults:.2f}")
    return " | ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672//")
    parser.add_argument("--pairs", default="redis-redis")
    parser.add_argument("-n", type=int, default=3000, help="calls per trial")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of plain and OJS")
    parser.add_argument("--cpus", default="", help="pin the producer to these CPUs, e.g. 0")
    parser.add_argument("--switch-interval", type=float, default=0.0,
                        help="sys.setswitchinterval in the producer (default: Python's 0.005)")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.collect() and gc.freeze() after the warm-up")
    parser.add_argument("--setting", action="append", default=[], metavar="NAME=JSON",
                        help="an extra ojs setting for the OJS side, e.g. events=false")
    parser.add_argument("--measure", nargs=4, metavar=("KIND", "PAIR", "RUN", "QUEUE"),
                        help=argparse.SUPPRESS)
    options = parser.parse_args()
    options.settings = {name: json.loads(value) for name, _, value in
                        (item.partition("=") for item in options.setting)}
    if options.measure:
        kind, pair, run, queue = options.measure
        measured(kind, pair, run, queue, options.n, options)
        return
    forwarded = ["--redis", options.redis, "--postgres", options.postgres, "--amqp",
                 options.amqp, *(f"--setting={s}" for s in options.setting)]
    if options.cpus:
        forwarded.append(f"--cpus={options.cpus}")
    if options.switch_interval:
        forwarded.append(f"--switch-interval={options.switch_interval}")
    if options.gc_freeze:
        forwarded.append("--gc-freeze")
    sys.path.insert(0, str(BENCH_DIR))
    from caller import Pairing

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ojs-producer-"))
    try:
        for pair in options.pairs.split(","):
            if pair not in PAIRS:
                parser.error(f"--pairs: {pair!r} is not one of {', '.join(PAIRS)}")
            pairing = Pairing(pair, options, tmp)
            ratios: list[float] = []
            main_cpu: dict[str, list[float]] = {"plain": [], "ojs": []}
            try:
                for round_ in range(options.rounds):
                    results: dict[str, dict[str, Any]] = {}
                    for kind in ("plain", "ojs") if round_ % 2 == 0 else ("ojs", "plain"):
                        results[kind] = trial(kind, pairing, options.n, forwarded)
                        main_cpu[kind].append(results[kind]["threads"]["main"][0] / 1000)
                        print(f"{pair} round {round_ + 1} {describe(kind, results[kind])}",
                              flush=True)
                    ratios.append(results["ojs"]["rate"] / results["plain"]["rate"])
            finally:
                pairing.cleanup()
            print(f"{pair}: rate ratio OJS / plain, median {statistics.median(ratios):.2f} "
                  f"({', '.join(f'{r:.2f}' for r in ratios)}); main thread µs/call plain "
                  f"{statistics.median(main_cpu['plain']):.0f}, OJS "
                  f"{statistics.median(main_cpu['ojs']):.0f}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
