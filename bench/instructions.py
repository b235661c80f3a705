"""Hand-run benchmark: the producer's cost per call in CPU instructions, counted by valgrind.

    .venv/bin/python bench/instructions.py                      # redis-redis, 300 calls
    .venv/bin/python bench/instructions.py --pairs redis-redis,redis-pg,amqp-redis -n 200
    .venv/bin/python bench/instructions.py --batch              # enqueue_batch vs send_task

Not part of the test suite. Needs ``valgrind`` and the services of the test suite; everything
it creates is removed (it reuses ``bench/caller.py``'s pairings).

Why instructions
----------------
Rates and CPU seconds on a shared 2-core machine move by ±20 % with other people's load, which
hides the few-percent changes that hot-path work is made of. ``valgrind --tool=callgrind``
counts the instructions a thread executes, which does not depend on the load (the same run
twice agrees within about 1 %). It counts no cache misses, system-call time or waiting, so it
complements ``bench/caller.py`` (the rates users see) and does not replace it.

What is counted: the main thread of a process that makes ``-n`` calls (``.apply_async()`` of
``bench/callerapp.py``'s task, or with ``--batch`` one ``enqueue_batch`` against ``-n``
``send_task``), minus the same process making none (start-up, imports and warm-up cancel out),
divided by ``-n``. Background threads (OJS's outbox acknowledgements and events) are left out:
they batch their work, so their count per job depends on timing under valgrind; their CPU is in
``bench/caller.py``'s producer column.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys
import tempfile

BENCH_DIR = pathlib.Path(__file__).resolve().parent
PAIRS = ("redis-redis", "redis-pg", "amqp-redis", "amqp-pg")


def calls(kind: str, pair: str, n: int, batch: bool, services: argparse.Namespace) -> None:
    """The measured process: ``n`` calls of ``kind`` on ``pair`` (run under valgrind)."""
    sys.path.insert(0, str(BENCH_DIR))
    from caller import TASK_NAME, WARMUP, Pairing, flush, make_app

    import ojs_celery
    from ojs_celery.runtime import get_runtime

    pairing = Pairing(pair, services, pathlib.Path(tempfile.mkdtemp()))
    queue = pairing.new_queue()
    app = make_app(pairing.config(kind, queue))
    task = app.tasks[TASK_NAME]
    try:
        for _ in range(WARMUP):
            task.apply_async()
        if batch and kind == "ojs":
            ojs_celery.enqueue_batch([{"type": TASK_NAME, "args": []}] * WARMUP, app=app)
        flush(app, kind)
        if batch and kind == "ojs" and n:
            ojs_celery.enqueue_batch([{"type": TASK_NAME, "args": []}] * n, app=app)
        elif batch:
            for _ in range(n):
                app.send_task(TASK_NAME, args=[])
        else:
            for _ in range(n):
                task.apply_async()
        flush(app, kind)
    finally:
        pairing.purge(app, queue)
        if kind == "ojs":
            get_runtime(app).close()
        app.close()
        pairing.cleanup()


def main_thread_instructions(args: list[str]) -> int:
    """Instructions executed by the main thread of ``bench/instructions.py --calls ...``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "callgrind.out"
        subprocess.run(
            ["valgrind", "--tool=callgrind", "--separate-threads=yes",
             f"--callgrind-out-file={out}", sys.executable, __file__, "--calls", *args],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        text = (pathlib.Path(tmp) / "callgrind.out-01").read_text(errors="replace")
    match = re.search(r"^summary: (\d+)", text, re.MULTILINE)
    if match is None:
        raise SystemExit("valgrind wrote no summary for the main thread")
    return int(match.group(1))


def per_call(kind: str, pair: str, n: int, batch: bool, services: list[str]) -> float:
    common = [kind, pair, *(["--batch"] if batch else []), *services]
    return (main_thread_instructions([*common, "-n", str(n)])
            - main_thread_instructions([*common, "-n", "0"])) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672//")
    parser.add_argument("--pairs", default="redis-redis")
    parser.add_argument("-n", type=int, default=300, help="calls per measured run")
    parser.add_argument("--batch", action="store_true",
                        help="one enqueue_batch of n jobs against n send_task calls")
    parser.add_argument("--calls", nargs=2, metavar=("KIND", "PAIR"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    services = argparse.Namespace(redis=options.redis, postgres=options.postgres,
                                  amqp=options.amqp)
    if options.calls:
        calls(options.calls[0], options.calls[1], options.n, options.batch, services)
        return
    forwarded = ["--redis", options.redis, "--postgres", options.postgres, "--amqp", options.amqp]
    what = "enqueue_batch vs send_task" if options.batch else ".apply_async()"
    print(f"{what}, n = {options.n}: main-thread instructions per call; the last column is "
          "the rate ratio OJS / plain if the producer were CPU-bound\n\n"
          "| pairing | plain | OJS | plain / OJS |\n|---|---|---|---|")
    for pair in options.pairs.split(","):
        if pair not in PAIRS:
            parser.error(f"--pairs: {pair!r} is not one of {', '.join(PAIRS)}")
        plain = per_call("plain", pair, options.n, options.batch, forwarded)
        ojs = per_call("ojs", pair, options.n, options.batch, forwarded)
        print(f"| {pair} | {plain / 1e6:.2f} M | {ojs / 1e6:.2f} M | {plain / ojs:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
