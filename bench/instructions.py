"""Hand-run benchmark: the producer's cost per call in CPU instructions, counted by valgrind.

    .venv/bin/python bench/instructions.py                      # redis-redis, 300 calls
    .venv/bin/python bench/instructions.py --pairs redis-redis,redis-pg,amqp-redis -n 200
    .venv/bin/python bench/instructions.py --batch              # enqueue_batch vs send_task
    .venv/bin/python bench/instructions.py --worker             # the worker's side of a job
    .venv/bin/python bench/instructions.py --cache -n 150       # plus simulated cache misses

Not part of the test suite. Needs ``valgrind`` and the services of the test suite; everything
it creates is removed (it reuses ``bench/caller.py``'s pairings).

Why instructions
----------------
Rates and CPU seconds on a shared 2-core machine move by ±20 % with other people's load, which
hides the few-percent changes that hot-path work is made of. ``valgrind --tool=callgrind``
counts the instructions a thread executes, which does not depend on the load (the same run
twice agrees within about 1 %). It counts no cache misses, system-call time or waiting, so it
complements ``bench/caller.py`` (the rates users see) and does not replace it. ``--cache`` adds
valgrind's simulation of the caches and branch predictor (the last level sized as this
machine's 1 MiB L2): same instructions can cost different times when one loop touches more
memory than the other.

What is counted: the main thread of a process that makes ``-n`` calls (``.apply_async()`` of
``bench/callerapp.py``'s task, or with ``--batch`` one ``enqueue_batch`` against ``-n``
``send_task``), minus the same process making none (start-up, imports and warm-up cancel out),
divided by ``-n``. Background threads (OJS's outbox acknowledgements and events) are left out:
they batch their work, so their count per job depends on timing under valgrind; their CPU is in
``bench/caller.py``'s producer column.

``--worker`` counts the worker's side instead: the process publishes ``-n`` jobs, takes their
messages from the broker and runs each as Celery's worker does (``Request(message)`` then
``Request.execute()``: the task's request, the OJS start, the handler, the outcome, the ack),
minus the same process taking the messages without running them. A prefork worker splits that
between its main process and a pool child and adds the pickling between them (the same for
both kinds, bigger for OJS's larger header); the OJS events thread is left out as above.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import Any

from kombu.utils.imports import symbol_by_name

BENCH_DIR = pathlib.Path(__file__).resolve().parent
PAIRS = ("redis-redis", "redis-pg", "amqp-redis", "amqp-pg", "embedded")


def measured(kind: str, pair: str, run: str, queue: str, n: int, mode: str,
             services: argparse.Namespace) -> None:
    """The measured process (run under valgrind): ``n`` calls of ``mode`` by ``kind`` on
    ``pair``, in the pairing ``run`` and on ``queue`` that the driver made and cleans up.

    It ends with ``os._exit`` right after its work: cleaning up (a scan of the store's keys,
    the broker's restore of unacknowledged messages) costs what the shared servers happen to
    hold, which would make the count vary from run to run."""
    sys.path.insert(0, str(BENCH_DIR))
    from caller import TASK_NAME, WARMUP, Pairing, flush, make_app

    import ojs_celery

    pairing = Pairing(pair, services, pathlib.Path(tempfile.mkdtemp()), run=run)
    config = pairing.config(kind, queue)
    app = make_app(config)
    task = app.tasks[TASK_NAME]
    with app.connection_for_read() as connection:
        channel = connection.default_channel

        def take(count: int) -> list[Any]:
            messages: list[Any] = []
            while len(messages) < count:
                message = channel.basic_get(queue)
                if message is not None:  # py-amqp's is raw, kombu's virtual one is not
                    messages.append(channel.message_to_python(message)
                                    if hasattr(message, "frame_method") else message)
            return messages

        def execute(message: Any) -> None:
            """What the worker does with a message: Celery's ``Request``, then ``execute``
            (the task's request, the OJS start, the handler, the outcome, the ack)."""
            request_class = symbol_by_name(task.Request)
            request_class(message, app=app, task=task, hostname="bench@instructions",
                          on_ack=message.ack_log_error, on_reject=message.reject_log_error,
                          connection_errors=()).execute()

        def publish(count: int) -> None:
            if mode == "batch" and kind == "ojs":
                if count:
                    ojs_celery.enqueue_batch([{"type": TASK_NAME, "args": []}] * count, app=app)
            elif mode == "batch":
                for _ in range(count):
                    app.send_task(TASK_NAME, args=[])
            else:
                for _ in range(count):
                    task.apply_async()
            flush(app, kind)

        publish(WARMUP)
        if mode in ("worker", "take"):
            for message in take(WARMUP):
                execute(message)
            publish(n)
            for message in take(n):
                if mode == "worker":
                    execute(message)
                else:
                    message.ack()
            flush(app, kind)
            expected = WARMUP + (n if mode == "worker" else 0)
            counted = int(pairing.counter_client.get(config["counter_key"]) or 0)
            if counted != expected:
                print(f"{kind}: {counted} jobs ran, not {expected}", file=sys.stderr)
                os._exit(1)
        else:
            publish(n)
    os._exit(0)


#: ``--cache``: valgrind's cache and branch simulation, its last level sized as this machine's
#: L2 (1 MiB a core, 8-way), so that "LL" misses are what a core fetches from beyond its L2.
CACHE_OPTIONS = ("--cache-sim=yes", "--branch-sim=yes", "--LL=1048576,8,64")
#: The counts ``--cache`` prints per call (valgrind's names): instructions, L1 instruction and
#: data misses, last-level misses, mispredicted conditional and indirect branches.
CACHE_EVENTS = ("Ir", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw", "Bcm", "Bim")


def main_thread_counts(args: list[str], cache: bool = False) -> dict[str, int]:
    """valgrind's counts for the main thread of ``bench/instructions.py --measure ...``:
    ``Ir`` (instructions) alone, or with ``cache`` the simulated misses too."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "callgrind.out"
        subprocess.run(
            ["valgrind", "--tool=callgrind", "--separate-threads=yes",
             *(CACHE_OPTIONS if cache else ()),
             f"--callgrind-out-file={out}", sys.executable, __file__, "--measure", *args],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        text = (pathlib.Path(tmp) / "callgrind.out-01").read_text(errors="replace")
    events = re.search(r"^events: (.+)$", text, re.MULTILINE)
    summary = re.search(r"^summary: ([\d ]+)$", text, re.MULTILINE)
    if events is None or summary is None:
        raise SystemExit("valgrind wrote no summary for the main thread")
    return dict(zip(events.group(1).split(), (int(v) for v in summary.group(1).split()),
                    strict=True))


def per_call(pairing: Any, kind: str, n: int, mode: str, services: list[str],
             cache: bool = False) -> dict[str, float]:
    """valgrind's counts per call: ``n`` calls minus none (``worker``: taking and running
    ``n`` messages minus taking and acknowledging them)."""

    def count(what: str, calls: int) -> dict[str, int]:
        queue = pairing.new_queue()
        return main_thread_counts(
            [kind, pairing.name, pairing.run, queue, what, *services, "-n", str(calls)], cache)

    if mode == "worker":
        done, base = count("worker", n), count("take", n)
    else:
        done, base = count(mode, n), count(mode, 0)
    return {event: (done[event] - base[event]) / n for event in done}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672//")
    parser.add_argument("--pairs", default="redis-redis")
    parser.add_argument("-n", type=int, default=300, help="calls per measured run")
    parser.add_argument("--batch", action="store_true",
                        help="one enqueue_batch of n jobs against n send_task calls")
    parser.add_argument("--kinds", default="plain,ojs",
                        help="which to count (plain, ojs; a change to OJS alone needs only ojs)")
    parser.add_argument("--worker", action="store_true",
                        help="the worker's side: take and run n jobs' messages")
    parser.add_argument("--cache", action="store_true",
                        help="also simulate the caches (last level sized as a 1 MiB L2) and "
                             "branch prediction; print the misses per call (slower)")
    parser.add_argument("--measure", nargs=5, metavar=("KIND", "PAIR", "RUN", "QUEUE", "MODE"),
                        help=argparse.SUPPRESS)
    options = parser.parse_args()
    services = argparse.Namespace(redis=options.redis, postgres=options.postgres,
                                  amqp=options.amqp)
    if options.measure:
        kind, pair, run, queue, mode = options.measure
        measured(kind, pair, run, queue, options.n, mode, services)
        return
    forwarded = ["--redis", options.redis, "--postgres", options.postgres, "--amqp", options.amqp]
    mode = "worker" if options.worker else "batch" if options.batch else "apply"
    what = {"worker": "the worker's side of a job (Request.execute)",
            "batch": "enqueue_batch vs send_task", "apply": ".apply_async()"}[mode]
    print(f"{what}, n = {options.n}: main-thread instructions per call; the last column is "
          "the rate ratio OJS / plain if the producer were CPU-bound\n\n"
          "| pairing | plain | OJS | plain / OJS |\n|---|---|---|---|")
    pairs = options.pairs.split(",")
    for pair in pairs:
        if pair not in PAIRS:
            parser.error(f"--pairs: {pair!r} is not one of {', '.join(PAIRS)}")
    sys.path.insert(0, str(BENCH_DIR))
    from caller import Pairing

    kinds = options.kinds.split(",")
    cache_rows: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in pairs:
            pairing = Pairing(pair, services, pathlib.Path(tmp))
            try:
                counts = {kind: per_call(pairing, kind, options.n, mode, forwarded,
                                         options.cache) if kind in kinds else {}
                          for kind in ("plain", "ojs")}
            finally:
                pairing.cleanup()
            plain, ojs = (counts[kind].get("Ir", 0.0) for kind in ("plain", "ojs"))
            ratio = f"{plain / ojs:.2f}" if plain and ojs else "–"
            print(f"| {pair} | {plain / 1e6:.2f} M | {ojs / 1e6:.2f} M | {ratio} |", flush=True)
            if options.cache:
                for kind, values in counts.items():
                    if values:
                        cache_rows.append(f"| {pair} | {kind} | " + " | ".join(
                            f"{values[e]:,.0f}" for e in CACHE_EVENTS) + " |")
    if cache_rows:
        print("\nsimulated per call, main thread (--cache; LL = a 1 MiB L2):\n\n| pairing | kind | "
              + " | ".join(CACHE_EVENTS) + " |\n|---|---|" + "---|" * len(CACHE_EVENTS))
        print("\n".join(cache_rows))


if __name__ == "__main__":
    main()
