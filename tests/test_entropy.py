"""The block-read random hex digits behind write nonces and ids: never handed out twice, not even
across a fork (a child that reused its parent's block would repeat its nonces)."""

from __future__ import annotations

import os
import threading

from ojs_celery import entropy
from ojs_celery.store.base import new_nonce


def test_values_are_distinct_across_blocks_and_threads() -> None:
    seen: list[str] = []

    def take() -> None:
        seen.extend(new_nonce() for _ in range(2000))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 8000
    assert len(set(seen)) == 8000  # > 8000 * 8 bytes: several blocks were read


def test_a_forked_child_does_not_repeat_its_parents_bytes() -> None:
    entropy.random_hex(16)  # the parent holds a block with digits left in it
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write, entropy.random_hex(64).encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert len(child) == 64
    assert child != entropy.random_hex(64)
