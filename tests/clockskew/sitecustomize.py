"""Loaded by a worker subprocess whose ``PYTHONPATH`` starts with this directory: moves that
process's wall clock (``time.time``, ``time.time_ns``, ``datetime.now``) by
``OJS_TEST_CLOCK_SKEW`` seconds, as on a host whose clock is ahead (positive) or behind
(negative). Monotonic clocks are left alone."""

import datetime as _datetime
import os
import time as _time

_SKEW = float(os.environ.get("OJS_TEST_CLOCK_SKEW") or 0)

if _SKEW:
    _time_time, _time_ns = _time.time, _time.time_ns

    def _skewed_time() -> float:
        return _time_time() + _SKEW

    def _skewed_time_ns() -> int:
        return _time_ns() + int(_SKEW * 1e9)

    _time.time = _skewed_time
    _time.time_ns = _skewed_time_ns

    class _SkewedDatetime(_datetime.datetime):
        @classmethod
        def now(cls, tz=None):  # type: ignore[no-untyped-def,override]
            return _datetime.datetime.fromtimestamp(_skewed_time(), tz)

    _datetime.datetime = _SkewedDatetime  # type: ignore[misc]
