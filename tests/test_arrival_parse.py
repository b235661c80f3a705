"""What a message's ``ojs`` header is read as: a malformed one never raises, and only an
integer token may start an attempt."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from ojs_celery import arrival, parse_envelope
from ojs_celery import header as ojs_header


@pytest.mark.parametrize("raw", [
    "garbage", [1], None, 3, {}, {"token": "1"}, {"token": 1.0}, {"token": True},
    {"token": None}, {"token": [1]},
])
def test_an_unusable_header_has_no_token(raw: Any) -> None:
    parsed = arrival.parse(raw, "job-1")
    assert parsed.token is None and parsed.problem


def test_a_usable_token_with_broken_parts_reads_the_record() -> None:
    job = parse_envelope({"type": "e2e.add", "args": [1, 2]})
    raw = {**ojs_header.build(job, 4), "snapshot": "[]\n{not json", "created_at": "yesterday"}
    parsed = arrival.parse(raw, job.id)
    assert (parsed.token, parsed.snapshot, parsed.created_at, parsed.problem) == (
        4, None, None, None)
    assert not parsed.record_may_come()  # no age: an unknown job is an orphan


def test_a_record_may_come_until_the_message_is_older_than_the_orphan_bound() -> None:
    now = time.time()
    fresh = arrival.parse({"token": 1, "created_at": now - 1}, "j")
    old = arrival.parse({"token": 1, "created_at": now - arrival.ORPHAN_AFTER - 1}, "j")
    assert fresh.record_may_come(now) and not old.record_may_come(now)
    skewed = arrival.parse({"token": 1, "created_at": now + 2}, "j")  # another host's clock
    assert skewed.record_may_come(now)
    for lie in (now + arrival.ORPHAN_AFTER + 1, 1e308):  # would be requeued for ever
        assert not arrival.parse({"token": 1, "created_at": lie}, "j").record_may_come(now)


def test_headers_absent_or_present_in_any_shape() -> None:
    assert not arrival.has_header(SimpleNamespace(headers=None))
    assert arrival.has_header(SimpleNamespace(headers={"ojs": "garbage"}))
    assert arrival.has_header(SimpleNamespace(headers=None, ojs=None))


@pytest.mark.parametrize("token", ["abc", None, 1.5, True])
def test_the_main_process_reads_a_malformed_token_as_none(token: Any) -> None:
    request = SimpleNamespace(_request_dict={"ojs": {"token": token}})
    assert ojs_header.token_of(request) is None
    assert ojs_header.token_of(SimpleNamespace(_request_dict={"ojs": {"token": 7}})) == 7


def test_a_message_carries_its_job_when_its_arguments_are_the_records() -> None:
    job = parse_envelope({"type": "a.b", "args": [1, [2, 3]], "x_celery_kwargs": {"k": (4,)}})
    assert arrival.carries_call([1, [2, 3]], {"k": [4]}, job)
    assert arrival.carries_call((1, (2, 3)), {"k": (4,)}, job)  # a pickled message's tuples
    assert not arrival.carries_call([1, [2, 4]], {"k": [4]}, job)
    assert not arrival.carries_call([1, [2, 3]], {}, job)
    assert not arrival.carries_call([1, [2, 3]], {"k": [4], "extra": 1}, job)
    bare = parse_envelope({"type": "a.b", "args": []})
    assert arrival.carries_call(None, None, bare) and arrival.carries_call((), {}, bare)
