"""Random hex digits for write nonces and ids, read from the OS in blocks instead of per value.

A job costs its worker two write nonces and two event ids; one ``os.urandom`` system call per
value is a measurable part of that. The digits are the same kernel randomness, hex-encoded once
per block (ids and nonces are text) and handed out once each: a lock keeps two threads from
taking the same slice, and a forked child drops what its parent had read (it would otherwise
hand out the very nonces its parent and siblings use).
"""

from __future__ import annotations

import os
import threading

#: Bytes read from the OS at a time (a few hundred values).
BLOCK = 4096

_lock = threading.Lock()
_block = ""  # hex digits of the last block read
_at = 0


def random_hex(n: int) -> str:
    """``n`` lowercase hex digits of ``os.urandom`` (4 random bits each), never handed out
    twice in any process."""
    global _block, _at
    with _lock:
        end = _at + n
        if end > len(_block):
            _block = os.urandom(max(BLOCK, (n + 1) // 2)).hex()
            _at, end = 0, n
        taken = _block[_at:end]
        _at = end
        return taken


def _forget_after_fork() -> None:
    global _lock, _block, _at
    _lock = threading.Lock()
    _block, _at = "", 0


os.register_at_fork(after_in_child=_forget_after_fork)
