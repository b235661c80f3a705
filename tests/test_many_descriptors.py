"""A process with more than 1024 files open (a busy web server, a worker holding many sockets)
gets descriptors numbered 1024 and above for the job store's connections. ``select`` refuses
those: the PostgreSQL store, which waited on its sockets with it, then failed every call
("This connection is closed"). Run in a process of its own, whose descriptors the test
chooses."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests import services
from tests.workers import ROOT, unique

HELD = 1100  # descriptors opened before the store's: its sockets are numbered above 1024

SCRIPT = textwrap.dedent("""
    import json, os, resource, sys
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = {held} + 200
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range({held})]
    from ojs_celery.envelope import Job
    from ojs_celery.lifecycle import Policy
    from ojs_celery.store import open_store
    store = open_store(sys.argv[1], policy=Policy(), prefix=sys.argv[2])
    seen = {{}}
    try:
        jobs = [Job.model_validate({{"type": "e2e.add", "args": [n, 1]}}) for n in range(3)]
        seen["created"] = [store.create(job).record is not None for job in jobs]
        seen["read"] = [store.get(job.id) is not None for job in jobs]
        seen["cancelled"] = store.cancel(jobs[0].id).applied
        seen["state"] = store.get(jobs[0].id).state
        seen["held_past_1024"] = max(held) >= 1024
    finally:
        store.drop_tables()
    print(json.dumps(seen))
""").format(held=HELD)


def test_the_postgresql_store_works_in_a_process_with_many_files_open() -> None:
    url = services.postgres_url()
    done = subprocess.run([sys.executable, "-c", SCRIPT, url, unique("fd")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"created": [True] * 3, "read": [True] * 3, "cancelled": True,
                    "state": "cancelled", "held_past_1024": True}
