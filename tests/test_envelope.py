"""Envelope validation: every rule of the OJS envelope and the timeouts extension, by field path."""

from __future__ import annotations

import inspect
import json
import random
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from ojs_celery.envelope import (
    MAX_ENVELOPE_BYTES,
    SYSTEM_FIELDS,
    UUID7_PATTERN,
    InvalidJob,
    Job,
    RetryPolicy,
    format_epoch,
    format_timestamp,
    from_epoch,
    new_job_id,
    parse_batch,
    parse_duration,
    parse_envelope,
    parse_input,
)

UUID7 = "0190a5b2-7c3d-7e4f-8a9b-0c1d2e3f4a5b"
UUID7_B = "0190a5b2-7c3d-7e4f-8a9b-0c1d2e3f4a5c"


def env(**fields: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"type": "email.send", "args": ["a@example.com"]}
    data.update(fields)
    return data


def violations(data: Any) -> list[tuple[str, str]]:
    with pytest.raises(InvalidJob) as info:
        parse_envelope(data)
    return info.value.violations


def paths(data: Any) -> list[str]:
    return [path for path, _ in violations(data)]


def rule_for(data: Any, path: str) -> str:
    found = [rule for p, rule in violations(data) if p == path]
    assert found, f"no violation at {path!r}"
    return found[0]


def test_the_public_parse_envelope_takes_the_envelope_only() -> None:
    """Its signature showed the package's own keyword arguments (``rules``, ``celery_id``,
    ``sent``, ``typed``): they are :func:`parse_input`'s, which the package's callers use."""
    import ojs_celery

    assert ojs_celery.parse_envelope is parse_envelope
    assert list(inspect.signature(parse_envelope).parameters) == ["data"]
    assert parse_envelope(env(id=UUID7)).model_dump() == parse_input(env(id=UUID7)).model_dump()


# --------------------------------------------------------------------------- minimal / defaults


def test_minimal_envelope_gets_defaults() -> None:
    job = parse_envelope(env())
    assert job.specversion == "1.0"
    assert job.queue == "default"
    assert job.priority == 0
    assert job.timeout == 1800
    assert job.grace_period == 30
    assert job.heartbeat_timeout == 60
    assert job.visibility_timeout == 1800
    assert job.total_timeout is None
    assert job.enqueue_ttl is None
    assert job.args == ["a@example.com"]
    assert job.retry == RetryPolicy()


def test_invalid_job_is_a_value_error() -> None:
    assert issubclass(InvalidJob, ValueError)
    with pytest.raises(ValueError, match="type"):
        parse_envelope({"args": []})


def test_invalid_job_message_lists_paths_and_rules() -> None:
    with pytest.raises(InvalidJob) as info:
        parse_envelope(env(type="bad type", priority=500))
    text = str(info.value)
    assert "2 violation(s)" in text
    assert "type:" in text
    assert "priority:" in text


# --------------------------------------------------------------------------- specversion


def test_specversion_optional_defaults_to_1_0() -> None:
    assert parse_envelope(env()).specversion == "1.0"
    assert parse_envelope(env(specversion="1.0")).specversion == "1.0"


@pytest.mark.parametrize("version", ["2.0", "1", "1.0.0", ""])
def test_specversion_other_values_rejected(version: str) -> None:
    assert violations(env(specversion=version)) == [("specversion", 'must be "1.0"')]


# --------------------------------------------------------------------------- type


@pytest.mark.parametrize(
    "value",
    ["email.send", "email", "a", "billing.invoice_2.create", "x1.y_z", "a" * 255,
     # beyond OJS core (README, decisions): hyphens and upper case as real producers send
     # them, and Celery task names with ":"
     "retry.test.exponential-backoff", "Email.Send", "a-b", "proj.tasks:send_mail"],
)
def test_type_valid(value: str) -> None:
    assert parse_envelope(env(type=value)).type == value


@pytest.mark.parametrize(
    "value",
    [
        "1abc",
        "-ab",
        "email..send",
        "email.",
        ".email",
        "_a",
        "a.1b",
        "a b",
        "",
    ],
)
def test_type_invalid(value: str) -> None:
    assert paths(env(type=value)) == ["type"]


def test_type_pattern_violation_explains_rule() -> None:
    assert "email.send" in rule_for(env(type="email send"), "type")


def test_type_max_length_255() -> None:
    assert paths(env(type="a" * 256)) == ["type"]
    assert "255" in rule_for(env(type="a" * 256), "type")


def test_type_required() -> None:
    data = env()
    del data["type"]
    assert violations(data) == [("type", "is required")]


def test_type_must_be_string() -> None:
    assert paths(env(type=5)) == ["type"]


# --------------------------------------------------------------------------- queue


def test_queue_defaults_to_default() -> None:
    assert parse_envelope(env()).queue == "default"
    assert parse_envelope(env(queue=None)).queue == "default"  # explicit null = absent


@pytest.mark.parametrize("value", ["default", "critical", "emails.high", "q-1", "0", "a" * 128,
                                   "Default", "q_1", "proj:high"])  # any Celery queue name
def test_queue_valid(value: str) -> None:
    assert parse_envelope(env(queue=value)).queue == value


@pytest.mark.parametrize("value", ["-q", ".q", "_q", "q 1", "q/1", ""])
def test_queue_invalid_pattern(value: str) -> None:
    assert paths(env(queue=value)) == ["queue"]


def test_queue_max_length_128() -> None:
    assert paths(env(queue="a" * 129)) == ["queue"]
    assert "128" in rule_for(env(queue="a" * 129), "queue")


# --------------------------------------------------------------------------- id


def test_id_generated_as_uuid7_when_absent() -> None:
    before = time.time_ns() // 1_000_000
    job = parse_envelope(env())
    after = time.time_ns() // 1_000_000
    assert UUID7_PATTERN.match(job.id)
    generated = uuid.UUID(job.id)
    assert generated.version == 7 and generated.variant == uuid.RFC_4122
    assert before <= generated.int >> 80 <= after  # RFC 9562: Unix milliseconds first
    assert len({parse_envelope(env()).id for _ in range(1000)}) == 1000


def test_new_ids_use_every_variant_digit() -> None:
    """The variant digit is 0b10 and two random bits: all four of 8, 9, a and b occur."""
    ids = [new_job_id() for _ in range(400)]
    assert {job_id[19] for job_id in ids} == set("89ab")
    assert len({job_id[24:] for job_id in ids}) == 400


def test_id_kept_when_given() -> None:
    assert parse_envelope(env(id=UUID7)).id == UUID7


def test_id_uppercase_accepted_and_lowercased() -> None:
    job = parse_envelope(env(id=UUID7.upper()))
    assert job.id == UUID7
    assert UUID7 in job.to_json()


@pytest.mark.parametrize(
    "value",
    [
        "3f2b8c1e-9a4d-4e6f-8b7a-1c2d3e4f5a6b",  # version 4 (fixed: pytest-xdist workers
                                                 # must collect the same ids)
        "550e8400-e29b-11d4-a716-446655440000",  # version 1
        "0190a5b2-7c3d-7e4f-ca9b-0c1d2e3f4a5b",  # bad variant
        "0190a5b27c3d7e4f8a9b0c1d2e3f4a5b",  # no hyphens
        "not-a-uuid",
        "",
    ],
)
def test_id_non_uuid7_rejected(value: str) -> None:
    assert paths(env(id=value)) == ["id"]
    assert "UUIDv7" in rule_for(env(id=value), "id")


def test_id_must_be_string() -> None:
    assert violations(env(id=7)) == [("id", "must be a string")]


# --------------------------------------------------------------------------- args


def test_args_required() -> None:
    data = env()
    del data["args"]
    assert violations(data) == [("args", "is required")]


def test_args_empty_array_ok() -> None:
    assert parse_envelope(env(args=[])).args == []


def test_args_null_rejected() -> None:
    assert paths(env(args=None)) == ["args"]


@pytest.mark.parametrize("value", [{"to": "x"}, "a string", 5, True])
def test_args_non_array_rejected_once(value: Any) -> None:
    assert violations(env(args=value)) == [("args", "must be a JSON array")]


def test_args_json_native_values_accepted() -> None:
    args = ["s", 1, -2.5, True, None, [1, [2]], {"k": {"n": [None]}}]
    assert parse_envelope(env(args=args)).args == args


@pytest.mark.parametrize("bad", [{1, 2}, object(), b"bytes", datetime.now(timezone.utc)])
def test_args_non_json_values_rejected(bad: Any) -> None:
    assert paths(env(args=["ok", bad])) == ["args[1]"]


def test_args_nested_non_json_value_path() -> None:
    assert paths(env(args=[{"a": [1, {3}]}])) == ["args[0].a[1]"]


def test_meta_non_json_value_rejected() -> None:
    assert paths(env(meta={"tags": {1, 2}})) == ["meta.tags"]


# --------------------------------------------------------------------------- priority


@pytest.mark.parametrize("value", [-100, -1, 0, 10, 100])
def test_priority_range_accepted(value: int) -> None:
    assert parse_envelope(env(priority=value)).priority == value


@pytest.mark.parametrize("value", [-101, 101, 1000])
def test_priority_out_of_range(value: int) -> None:
    assert paths(env(priority=value)) == ["priority"]


@pytest.mark.parametrize("value", [1.5, "5", True])
def test_priority_strict_int(value: Any) -> None:
    assert paths(env(priority=value)) == ["priority"]


# --------------------------------------------------------------------------- timestamps


def test_timestamp_with_zone_accepted_and_offset_preserved() -> None:
    job = parse_envelope(env(scheduled_at="2030-01-02T03:04:05+02:00"))
    assert job.scheduled_at == datetime(2030, 1, 2, 1, 4, 5, tzinfo=timezone.utc)
    assert job.scheduled_at is not None
    assert job.scheduled_at.utcoffset() == timedelta(hours=2)
    assert job.to_dict()["scheduled_at"] == "2030-01-02T03:04:05+02:00"  # as it was sent


def test_timestamp_utc_written_with_z() -> None:
    job = parse_envelope(env(expires_at="2030-01-02T03:04:05.123Z"))
    assert job.to_dict()["expires_at"] == "2030-01-02T03:04:05.123000Z"


@pytest.mark.parametrize("sent", [
    "2030-01-02T03:04:05.123456Z", "2030-01-02T03:04:05Z", "2030-01-02T03:04:05.5-07:30",
    "2030-01-02T03:04:05+00:00",
])
def test_timestamps_quoted_as_the_job_writes_them(sent: str) -> None:
    """Events and error entries (format_timestamp) quote a time as the job's JSON has it."""
    job = parse_envelope(env(scheduled_at=sent))
    assert job.scheduled_at is not None
    written = json.loads(job.model_dump_json())["scheduled_at"]
    assert format_timestamp(job.scheduled_at) == written == job.to_dict()["scheduled_at"]


def test_epoch_seconds_formatted_as_their_datetime() -> None:
    """format_epoch (events' and errors' times) writes what format_timestamp writes for the
    same seconds as a datetime: the rounding of microseconds, a second's carry, none when zero."""
    rng = random.Random(7)
    samples = [rng.uniform(0, 4e9) for _ in range(20000)] + [rng.uniform(1.7e9, 1.7e9 + 5)
                                                               for _ in range(2000)]
    edges = [0.0, 1.0, 1700000000.0, 1700000000.5, 1700000000.0000005, 1700000000.0000015,
             1700000000.9999995, 1700000000.9999999, 1799999999.999999, time.time()]
    for seconds in samples + edges:
        assert format_epoch(seconds) == format_timestamp(from_epoch(seconds)), seconds


@pytest.mark.parametrize("field", ["scheduled_at", "expires_at"])
@pytest.mark.parametrize("value", ["2030-01-02T03:04:05", "2030-01-02", "tomorrow", 1700000000])
def test_timestamp_needs_zone(field: str, value: Any) -> None:
    assert paths(env(**{field: value})) == [field]


@pytest.mark.parametrize("value", [
    "2030-01-02T03:04Z",  # no seconds
    "2030-01-02T03:04:05,5Z",  # a comma before the fraction
    "2030-01-02T03:04:05.Z",  # a point with no digits
    "2030-01-02T03:04:05+0100",  # an offset without its colon
    "2030-01-02T03:04:05+01",  # an offset without its minutes
    "2030-01-02T03:04:05 Z",
    "20300102T030405Z",  # ISO 8601's basic format
])
def test_what_iso_8601_allows_but_rfc_3339_does_not_is_refused(value: str) -> None:
    """pydantic's parser took these (an OJS reader in another language need not): the envelope
    must carry RFC 3339, as the rule says."""
    with pytest.raises(InvalidJob) as info:
        parse_envelope(env(scheduled_at=value))
    assert [field for field, _ in info.value.violations] == ["scheduled_at"]


@pytest.mark.parametrize("value", [
    "2030-01-02t03:04:05z", "2030-01-02 03:04:05Z", "2030-01-02T03:04:05.123456789+05:30"])
def test_what_rfc_3339_allows_is_read(value: str) -> None:
    assert parse_envelope(env(scheduled_at=value)).scheduled_at is not None


@pytest.mark.parametrize(("value", "says"), [
    ("9999-12-31T23:59:60Z", "date, time or offset is out of range"),
    ("2030-01-02T03:04:05", "the time zone is missing"),
    ("2030-01-02T03:04:05+25:00", "offsets are at most ±23:59"),
    ("2030-01-02T24:00:00Z", "date, time or offset is out of range"),
    ("2030-02-30T00:00:00Z", "date, time or offset is out of range"),
])
def test_a_timestamp_that_does_not_parse_says_which_part_is_wrong(value: str, says: str) -> None:
    """Not pydantic's parser wording ("unexpected extra characters at the end")."""
    with pytest.raises(InvalidJob) as info:
        parse_envelope(env(scheduled_at=value))
    [(field, rule)] = info.value.violations
    assert field == "scheduled_at"
    assert rule.startswith("must be an RFC 3339 timestamp string with a time zone")
    assert says in rule


@pytest.mark.parametrize(("sent", "read"), [
    ("2030-12-31T23:59:60Z", "2031-01-01T00:00:00Z"),
    ("2030-06-30T18:59:60.25-05:00", "2030-06-30T19:00:00.250000-05:00"),
])
def test_a_leap_second_is_read_as_the_next_seconds_start(sent: str, read: str) -> None:
    """RFC 3339 allows second 60; POSIX time, which every deadline here counts in, has none."""
    assert parse_envelope(env(expires_at=sent)).to_dict()["expires_at"] == read


# --------------------------------------------------------------------------- timeout fields


@pytest.mark.parametrize(
    ("field", "bad", "good"),
    [
        ("timeout", 0, 1),
        ("timeout", -5, 1),
        ("grace_period", -1, 0),
        ("heartbeat_timeout", 0, 1),
        ("enqueue_ttl", 0, 1),
        ("visibility_timeout", 0, 1),
        ("total_timeout", 0, 1800),
    ],
)
def test_timeout_field_bounds(field: str, bad: int, good: int) -> None:
    assert paths(env(**{field: bad})) == [field]
    assert getattr(parse_envelope(env(**{field: good})), field) == good


@pytest.mark.parametrize(
    "field",
    [
        "timeout",
        "grace_period",
        "heartbeat_timeout",
        "enqueue_ttl",
        "visibility_timeout",
        "total_timeout",
    ],
)
def test_timeout_fields_are_integers(field: str) -> None:
    assert paths(env(**{field: 30.5})) == [field]
    assert paths(env(**{field: "30"})) == [field]


def test_total_timeout_at_least_timeout() -> None:
    assert parse_envelope(env(timeout=30, total_timeout=30)).total_timeout == 30
    found = violations(env(timeout=30, total_timeout=29))
    assert [p for p, _ in found] == ["total_timeout"]
    assert "timeout" in found[0][1]


def test_total_timeout_compared_with_default_timeout() -> None:
    assert paths(env(total_timeout=1000)) == ["total_timeout"]  # default timeout 1800


# --------------------------------------------------------------------------- retry policy


def test_retry_defaults() -> None:
    policy = parse_envelope(env()).retry
    assert policy.max_attempts == 3
    assert policy.initial_interval == "PT1S"
    assert policy.backoff_coefficient == 2.0
    assert policy.max_interval == "PT5M"
    assert policy.jitter is True
    assert policy.non_retryable_errors == []
    assert policy.on_exhaustion == "discard"
    assert policy.initial_seconds == 1.0
    assert policy.max_seconds == 300.0


def test_retry_partial_policy_merged_with_defaults() -> None:
    policy = parse_envelope(env(retry={"max_attempts": 5, "jitter": False})).retry
    assert policy.max_attempts == 5
    assert policy.jitter is False
    assert policy.initial_interval == "PT1S"
    assert policy.backoff_coefficient == 2.0
    assert policy.max_interval == "PT5M"
    assert policy.on_exhaustion == "discard"


def test_retry_max_attempts_zero_ok_negative_rejected() -> None:
    assert parse_envelope(env(retry={"max_attempts": 0})).retry.max_attempts == 0
    assert paths(env(retry={"max_attempts": -1})) == ["retry.max_attempts"]
    assert paths(env(retry={"max_attempts": 2.5})) == ["retry.max_attempts"]


def test_retry_backoff_coefficient_at_least_one() -> None:
    assert parse_envelope(env(retry={"backoff_coefficient": 1})).retry.backoff_coefficient == 1
    assert paths(env(retry={"backoff_coefficient": 0.99})) == ["retry.backoff_coefficient"]


@pytest.mark.parametrize("value", [True, "2.0"])
def test_retry_backoff_coefficient_is_a_number(value: Any) -> None:
    assert paths(env(retry={"backoff_coefficient": value})) == ["retry.backoff_coefficient"]


def test_retry_max_interval_not_below_initial() -> None:
    ok = parse_envelope(env(retry={"initial_interval": "PT10S", "max_interval": "PT10S"}))
    assert ok.retry.max_seconds == 10
    found = violations(env(retry={"initial_interval": "PT10S", "max_interval": "PT9S"}))
    assert [p for p, _ in found] == ["retry.max_interval"]
    assert "initial_interval" in found[0][1]


def test_a_partial_policy_is_checked_as_merged_with_the_defaults() -> None:
    """A longer initial_interval alone would store a policy (the default max_interval below
    it) that no later read accepts: the job could then never be read, run or cancelled."""
    found = violations(env(retry={"initial_interval": "PT10M"}))
    assert found == [("retry.max_interval", "must be greater than or equal to initial_interval "
                                            "(PT10M); when not given it is PT5M")]
    job = parse_envelope(env(retry={"initial_interval": "PT10M", "max_interval": "PT1H"}))
    assert Job.model_validate_json(job.to_json()).retry.max_seconds == 3600


def test_an_explicit_null_in_the_retry_policy_is_absent() -> None:
    """OJS: explicit null = absent (a Go nil slice or pointer is written as null)."""
    job = parse_envelope(env(retry={"max_attempts": 4, "non_retryable_errors": None,
                                    "max_interval": None, "jitter": None}))
    assert job.retry == RetryPolicy(max_attempts=4)


def test_retry_initial_interval_positive() -> None:
    assert paths(env(retry={"initial_interval": "PT0S"})) == ["retry.initial_interval"]


@pytest.mark.parametrize(
    "value", ["1s", "300s", "P", "PT", "P1DT", "PT1.S", "T1S", "pt1s", "", "5"]
)
def test_retry_bad_iso_durations(value: str) -> None:
    found = violations(env(retry={"initial_interval": value}))
    assert [p for p, _ in found] == ["retry.initial_interval"]
    assert "ISO 8601" in found[0][1] or "zero" in found[0][1]
    assert [p for p, _ in violations(env(retry={"max_interval": value}))] == ["retry.max_interval"]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("PT1S", 1),
        ("PT0.5S", 0.5),
        ("PT5M", 300),
        ("PT1H30M", 5400),
        ("P1D", 86400),
        ("P1DT2H", 93600),
        ("P1W", 604800),
        ("P1M", 30 * 86400),
        ("P1Y", 365 * 86400),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_retry_unknown_field_rejected() -> None:
    assert paths(env(retry={"max_attempts": 2, "initial_interval_ms": 100})) == [
        "retry.initial_interval_ms"
    ]


def test_retry_on_exhaustion_enum() -> None:
    assert parse_envelope(env(retry={"on_exhaustion": "dead_letter"})).retry.on_exhaustion == (
        "dead_letter"
    )
    assert paths(env(retry={"on_exhaustion": "dlq"})) == ["retry.on_exhaustion"]


def test_retry_non_retryable_errors_rules() -> None:
    policy = parse_envelope(env(retry={"non_retryable_errors": ["auth.*", "ValueError"]})).retry
    assert policy.non_retryable_errors == ["auth.*", "ValueError"]
    assert paths(env(retry={"non_retryable_errors": ["a", "a"]})) == ["retry.non_retryable_errors"]
    assert paths(env(retry={"non_retryable_errors": [""]})) == ["retry.non_retryable_errors[0]"]


def test_retry_jitter_strict_bool() -> None:
    assert paths(env(retry={"jitter": "yes"})) == ["retry.jitter"]


def test_retry_must_be_object() -> None:
    assert paths(env(retry=[1])) == ["retry"]


def test_retry_several_violations() -> None:
    found = paths(
        env(retry={"backoff_coefficient": 0.5, "on_exhaustion": "x", "initial_interval": "1s"})
    )
    assert sorted(found) == [
        "retry.backoff_coefficient",
        "retry.initial_interval",
        "retry.on_exhaustion",
    ]


# --------------------------------------------------------------------------- size


def test_envelope_up_to_1_mib_accepted() -> None:
    job = parse_envelope(env(args=["x" * (MAX_ENVELOPE_BYTES - 2000)]))
    assert len(job.to_json().encode()) <= MAX_ENVELOPE_BYTES


@pytest.mark.parametrize("encode", [False, True])
def test_an_envelope_of_just_under_1_mib_is_accepted_whatever_the_system_adds(
    encode: bool,
) -> None:
    """The limit is on the envelope as sent: the id and defaults the system adds (some 400
    bytes) do not count against it."""
    text = json.dumps(env(args=["x"]), separators=(",", ":"))
    text = text.replace('"x"', '"' + "x" * (MAX_ENVELOPE_BYTES - len(text)) + '"')
    assert len(text) == MAX_ENVELOPE_BYTES - 1
    job = parse_envelope(text.encode() if encode else json.loads(text))
    assert len(job.to_json().encode()) > MAX_ENVELOPE_BYTES


def test_envelope_over_1_mib_rejected_dict() -> None:
    found = violations(env(args=["x" * MAX_ENVELOPE_BYTES]))
    assert [p for p, _ in found] == ["(envelope)"]
    assert "1 MiB" in found[0][1]


@pytest.mark.parametrize("encode", [False, True])
def test_envelope_over_1_mib_rejected_text(encode: bool) -> None:
    text = json.dumps(env(args=["x" * MAX_ENVELOPE_BYTES]))
    data: str | bytes = text.encode() if encode else text
    found = violations(data)
    assert [p for p, _ in found] == ["(envelope)"]
    assert "1 MiB" in found[0][1]


def test_envelope_over_1_mib_counts_bytes_not_characters() -> None:
    # 600,000 two-byte characters: under 1 Mi characters, over 1 MiB of UTF-8.
    assert paths(json.dumps(env(args=["é" * 600_000]), ensure_ascii=False)) == ["(envelope)"]


@pytest.mark.parametrize("encode", [False, True])
def test_an_envelope_under_1_mib_as_sent_is_accepted_when_its_json_grows(encode: bool) -> None:
    """The limit is on the envelope as sent: ``1e5`` (3 bytes) is kept as ``100000.0`` (8), so
    the job's own JSON may be well over 1 MiB, and the envelope is still within the limit."""
    text = '{"type":"email.send","args":[[' + ",".join(["1e5"] * 200_000) + "]]}"
    assert len(text) < MAX_ENVELOPE_BYTES
    job = parse_envelope(text.encode() if encode else text)
    assert len(job.to_json().encode()) > MAX_ENVELOPE_BYTES * 3 // 2
    assert job.args == [[100000.0] * 200_000]


@pytest.mark.parametrize("encode", [False, True])
def test_a_batch_given_as_text_measures_each_envelope_as_sent(encode: bool) -> None:
    """As for one envelope: each envelope of a batch given as text is measured in that text
    (here about 800 kB, and 1.8 MB as the job writes it); one over 1 MiB is still named."""
    grows = '{"type":"email.send","args":[[' + ",".join(["1e5"] * 200_000) + "]]}"
    text = f" [ {grows} ,\n{json.dumps(env())}, {grows}]"
    jobs = parse_batch(text.encode() if encode else text)
    assert [len(job.args[0]) for job in (jobs[0], jobs[2])] == [200_000, 200_000]
    over = json.dumps(env(args=["x" * MAX_ENVELOPE_BYTES]))
    with pytest.raises(InvalidJob) as raised:
        parse_batch(f"[{json.dumps(env())}, {over}]")
    assert raised.value.violations == [
        ("[1]", f"must not exceed 1 MiB (is {len(over)} bytes)")]


@pytest.mark.parametrize("encode", [False, True])
def test_a_batch_in_the_ojs_batch_format_measures_each_envelope_as_sent(encode: bool) -> None:
    """``{"jobs": [...]}`` (the OJS batch format) given as text is a batch given as text too:
    each envelope is measured as written there (its last ``jobs``, the one JSON keeps), not as
    the job writes it (a JavaScript producer writes ``1e-7`` where the job writes ``1e-07``)."""
    grows = '{"type":"email.send","args":[[' + ",".join(["1e5"] * 200_000) + "]]}"
    text = (f' {{"x": {{"jobs": 1}}, "jobs": [], "job\\u0073" :\n [ {json.dumps(env())} ,'
            f" {grows} ] }}")
    jobs = parse_batch(text.encode() if encode else text)
    assert [len(job.args) for job in jobs] == [len(env()["args"]), 1]
    assert len(jobs[1].args[0]) == 200_000
    over = json.dumps(env(args=["x" * MAX_ENVELOPE_BYTES]))
    with pytest.raises(InvalidJob) as raised:
        parse_batch(f'{{"jobs": [{json.dumps(env())}, {over}]}}')
    assert raised.value.violations == [
        ("[1]", f"must not exceed 1 MiB (is {len(over)} bytes)")]


def test_a_batch_after_a_byte_order_mark_measures_each_envelope_as_sent() -> None:
    """A batch file may start with a UTF-8 byte order mark (read as :func:`decode_json` reads
    it): its envelopes are still measured as written, with no ``IndexError`` from the mark."""
    grows = '{"type":"email.send","args":[[' + ",".join(["1e5"] * 200_000) + "]]}"
    for text in (f"\ufeff[{grows}]", f'\ufeff{{"jobs": [{grows}]}}'):
        [job] = parse_batch(text.encode())
        assert len(job.args[0]) == 200_000


def test_an_envelope_over_1_mib_as_sent_names_its_size() -> None:
    text = json.dumps(env(args=["é" * 600_000]), ensure_ascii=False)
    [(path, rule)] = violations(text)
    assert path == "(envelope)"
    assert rule == f"must not exceed 1 MiB (is {len(text.encode())} bytes)"


# --------------------------------------------------------------------------- JSON text input


def test_parse_from_json_text_and_bytes() -> None:
    text = json.dumps(env(id=UUID7))
    assert parse_envelope(text).id == UUID7
    assert parse_envelope(text.encode()).id == UUID7


def test_invalid_json_text() -> None:
    found = violations('{"type": "email.send", "args": [}')
    assert [p for p, _ in found] == ["(envelope)"]
    assert "not valid JSON" in found[0][1]


@pytest.mark.parametrize("data", ["[1, 2]", '"text"', "null", [1]])
def test_envelope_must_be_object(data: Any) -> None:
    assert violations(data) == [("(envelope)", "must be a JSON object")]


@pytest.mark.parametrize("data", [
    '[{"type": "a.b", "args": []}]', [{"type": "a.b", "args": []}],
    {"jobs": [{"type": "a.b", "args": []}]}, '{"jobs": [{"type": "a.b", "args": []}]}'])
def test_a_batch_sent_as_one_envelope_is_told_where_batches_go(data: Any) -> None:
    """It was told only "type: is required" and "args: is required" for ``{"jobs": [...]}``."""
    [(path, rule)] = violations(data)
    assert path == "(envelope)" and "batch" in rule and "enqueue --batch" in rule


# ----------------------------------------------------------------- unknown and system fields


def test_unknown_fields_preserved_on_round_trip() -> None:
    ext = {"x_custom_field": {"nested": [1, "two", None]}, "vendor_flag": True}
    job = parse_envelope(env(id=UUID7, **ext))
    assert job.extensions == ext
    data = json.loads(job.to_json())
    assert data["x_custom_field"] == ext["x_custom_field"]
    assert data["vendor_flag"] is True
    again = parse_envelope(job.to_json())
    assert again.extensions == ext
    assert again.id == UUID7
    assert again.to_dict() == job.to_dict()


def test_round_trip_of_full_envelope() -> None:
    original = env(
        id=UUID7,
        queue="emails",
        meta={"trace_id": "abc", "tags": ["a"]},
        priority=7,
        timeout=60,
        scheduled_at="2030-01-01T00:00:00Z",
        expires_at="2030-01-02T00:00:00+01:00",
        retry={"max_attempts": 5, "non_retryable_errors": ["auth.*"]},
        schema="urn:ojs:schema:email.send:v1",
        visibility_timeout=120,
        total_timeout=600,
        enqueue_ttl=30,
        grace_period=0,
        heartbeat_timeout=20,
        x_custom_field=1,
    )
    job = parse_envelope(original)
    again = parse_envelope(job.to_json())
    assert again.to_dict() == job.to_dict()
    data = job.to_dict()
    assert data["schema"] == "urn:ojs:schema:email.send:v1"
    for key in (
        "meta",
        "priority",
        "timeout",
        "total_timeout",
        "enqueue_ttl",
        "grace_period",
        "heartbeat_timeout",
        "visibility_timeout",
        "x_custom_field",
    ):
        assert data[key] == original[key], key


def test_whole_numbers_written_as_floats_are_integers() -> None:
    """JSON Schema's integer takes 30.0 and 1e3: a producer whose numbers are doubles writes
    them so. 1.5 and true are still refused."""
    job = parse_envelope(env(timeout=30.0, priority=1e1, enqueue_ttl=2e3,
                             retry={"max_attempts": 5.0}))
    assert (job.timeout, job.priority, job.enqueue_ttl, job.retry.max_attempts) == (30, 10, 2000, 5)
    assert isinstance(job.timeout, int) and '"timeout":30,' in job.to_json()
    assert paths(env(timeout=1.5)) == ["timeout"]
    assert paths(env(retry={"max_attempts": True})) == ["retry.max_attempts"]


def test_unique_jobs_are_refused_as_not_supported() -> None:
    """Accepted and ignored, two identical "on_conflict": "reject" jobs both ran."""
    found = violations(env(unique={"key": "k", "on_conflict": "reject"}))
    assert found == [("unique", "is not supported: ojs_celery does not implement unique jobs "
                                "(OJS level 4); a client-chosen id makes an enqueue idempotent")]
    stored = parse_envelope(env()).to_dict()
    stored["unique"] = {"key": "k"}  # a record an earlier version stored still reads
    assert Job.model_validate(stored).unique == {"key": "k"}


def test_an_extension_named_schema_uri_stays_one() -> None:
    job = parse_envelope(env(schema_uri="urn:b", schema="urn:a"))
    assert job.to_dict()["schema"] == "urn:a" and job.to_dict()["schema_uri"] == "urn:b"
    assert "schema" not in parse_envelope(env(schema_uri="urn:b")).to_dict()
    other = parse_envelope(env(schema_uri="urn:b", schema="urn:z", id=job.id))
    assert not job.same_request(other)  # the schema differs


def test_the_queue_rpc_replies_to_is_not_part_of_the_request() -> None:
    """The same call from another thread or process (another reply queue) is the same job."""
    job = parse_envelope(env(id=UUID7))
    one = job.model_copy(update={"x_celery_options": {"reply_to": "a", "link": None}})
    two = job.model_copy(update={"x_celery_options": {"reply_to": "b", "link": None}})
    assert one.same_request(two)
    linked = job.model_copy(update={"x_celery_options": {"reply_to": "a", "link": "x"}})
    assert not one.same_request(linked)


def test_to_json_is_compact_one_line_and_omits_absent_fields() -> None:
    text = parse_envelope(env()).to_json()
    assert "\n" not in text
    assert ", " not in text
    data = json.loads(text)
    for absent in (
        "meta",
        "scheduled_at",
        "expires_at",
        "total_timeout",
        "enqueue_ttl",
        "result",
        "error",
        "unique",
        "schema",
    ):
        assert absent not in data


def test_non_json_extension_rejected_with_path() -> None:
    assert violations(env(x_thing=object())) == [("x_thing", "must be JSON data")]
    # Celery keyword arguments are JSON data, as args are: stored as text, a Python caller's
    # datetime or bytes would no longer match its own message
    rule = "input was not a valid JSON value"
    assert violations(env(x_celery_kwargs={"when": datetime.now(timezone.utc)})) == [
        ("x_celery_kwargs.when", rule)]
    assert violations(env(x_celery_kwargs={"b": [1, {"raw": b"bytes"}]}, x_ok=[1])) == [
        ("x_celery_kwargs.b[1].raw", rule)]


def test_extensions_are_kept_as_json_writes_them() -> None:
    """Tuples are arrays, number keys are text (as Celery's JSON serializer sends them); an
    extension other than the Celery kwargs may hold what pydantic writes as text."""
    job = parse_envelope(env(x_celery_kwargs={"k": (4, 5), "m": {1: "a", None: "b"}},
                             x_meta={"at": datetime(2026, 1, 1, tzinfo=timezone.utc)},
                             x_pair=(1, 2)))
    assert job.extensions["x_celery_kwargs"] == {"k": [4, 5], "m": {"1": "a", "null": "b"}}
    stored = json.loads(job.to_json())
    assert stored["x_meta"] == {"at": "2026-01-01T00:00:00Z"} and stored["x_pair"] == [1, 2]


def test_system_fields_from_client_ignored() -> None:
    sent = env(
        state="completed",
        attempt=7,
        created_at="2000-01-01T00:00:00Z",
        enqueued_at="not even a timestamp",
        started_at="2000-01-01T00:00:00Z",
        completed_at="2000-01-01T00:00:00Z",
        cancelled_at="2000-01-01T00:00:00Z",
        discarded_at="2000-01-01T00:00:00Z",
        next_retry_at="2000-01-01T00:00:00Z",
        error={"type": "x", "message": "y"},
        errors=[{"type": "x"}],
        result={"ok": True},
        last_checkpoint=5,
        progress={"progress": 0.5},
    )
    assert set(sent) - {"type", "args"} == SYSTEM_FIELDS
    job = parse_envelope(sent)
    assert job.state == "available"
    assert job.attempt == 0
    assert job.created_at is None
    assert job.enqueued_at is None
    assert job.started_at is None
    assert job.completed_at is None
    assert job.error is None
    assert job.errors == []
    assert job.result is None
    assert job.last_checkpoint is None
    assert job.progress is None
    assert job.extensions == {}


def test_parse_envelope_from_job_instance() -> None:
    job = parse_envelope(env(id=UUID7, x_custom_field="v"))
    job.state = "completed"
    job.attempt = 3
    copy = parse_envelope(job)
    assert copy is not job
    assert copy.id == UUID7
    assert copy.state == "available"
    assert copy.attempt == 0
    assert copy.extensions == {"x_custom_field": "v"}


def test_job_terminal_property() -> None:
    job = parse_envelope(env())
    assert not job.terminal
    for state in ("completed", "cancelled", "discarded"):
        job.state = state
        assert job.terminal


# --------------------------------------------------------------------------- several violations


def test_several_violations_reported_together() -> None:
    data = {
        "specversion": "2.0",
        "type": "email send",
        "queue": "Bad Queue",
        "id": "nope",
        "args": {"not": "array"},
        "priority": 101,
        "timeout": 0,
        "grace_period": -1,
        "scheduled_at": "2030-01-01T00:00:00",
        "retry": {"backoff_coefficient": 0.5, "bogus": 1},
    }
    with pytest.raises(InvalidJob) as info:
        parse_envelope(data)
    assert isinstance(info.value, ValueError)
    found = [p for p, _ in info.value.violations]
    assert sorted(found) == sorted(
        [
            "args",
            "specversion",
            "type",
            "queue",
            "id",
            "priority",
            "timeout",
            "grace_period",
            "scheduled_at",
            "retry.backoff_coefficient",
            "retry.bogus",
        ]
    )
    assert found.count("args") == 1


# --------------------------------------------------------------------------- batches


def test_parse_batch_array_and_jobs_object() -> None:
    jobs = parse_batch([env(id=UUID7), env(id=UUID7_B)])
    assert [j.id for j in jobs] == [UUID7, UUID7_B]
    assert [j.id for j in parse_batch({"jobs": [env(id=UUID7)]})] == [UUID7]  # type: ignore[arg-type]
    assert len(parse_batch(json.dumps({"jobs": [env(), env()]}))) == 2
    assert len(parse_batch(json.dumps([env()]).encode())) == 1


def test_parse_batch_rejects_whole_batch_naming_the_index() -> None:
    with pytest.raises(InvalidJob) as info:
        parse_batch([env(), env(type="b d"), env(), env(priority=200, queue="Q!")])
    assert sorted(p for p, _ in info.value.violations) == ["[1].type", "[3].priority", "[3].queue"]


def test_parse_batch_non_object_item() -> None:
    with pytest.raises(InvalidJob) as info:
        parse_batch([env(), 5])
    assert info.value.violations == [("[1]", "must be a JSON object")]


def test_parse_batch_duplicate_ids() -> None:
    with pytest.raises(InvalidJob) as info:
        parse_batch([env(id=UUID7), env(id=UUID7_B), env(id=UUID7.upper())])
    assert [p for p, _ in info.value.violations] == ["[2].id"]
    assert "[0]" in info.value.violations[0][1]


def test_parse_batch_duplicate_index_counts_invalid_items() -> None:
    with pytest.raises(InvalidJob) as info:
        parse_batch([env(type="b d"), env(id=UUID7), env(id=UUID7)])
    assert [p for p, _ in info.value.violations] == ["[0].type", "[2].id"]


@pytest.mark.parametrize("data", [[], "[]", {"jobs": []}, "{}", "5", "[", {"nope": 1}])
def test_parse_batch_must_be_non_empty_array(data: Any) -> None:
    with pytest.raises(InvalidJob) as info:
        parse_batch(data)
    assert [p for p, _ in info.value.violations] == ["(batch)"]


def test_job_model_validate_keeps_system_fields() -> None:
    """The store loads jobs with ``Job.model_validate``: system fields survive that path."""
    job = parse_envelope(env(id=UUID7))
    job.state = "retryable"
    job.attempt = 2
    loaded = Job.model_validate(json.loads(job.to_json()))
    assert loaded.state == "retryable"
    assert loaded.attempt == 2


def test_envelopes_and_settings_share_one_translation_of_pydantic_errors() -> None:
    from celery.exceptions import ImproperlyConfigured

    from ojs_celery.conf import read_settings

    assert violations(env(retry={"max_attempts": 1, "bogus": 1})) == [
        ("retry.bogus", "is not a known field")]
    with pytest.raises(ImproperlyConfigured) as info:
        read_settings({"labels": ["ok", 1], "retention": {"completed": 1, "forever": 1}})
    message = str(info.value)
    assert "ojs.labels[1]: " in message
    assert "ojs.retention.forever: unknown setting" in message


@pytest.mark.parametrize("field", ["x_celery_link", "x_celery_link_error", "x_celery_options",
                                   "x_celery_queue", "x_celery_routing_key", "X_Celery_Link"])
def test_an_envelope_cannot_set_celery_callbacks_or_options(field: str) -> None:
    sig = {"task": "proj.delete_everything", "args": [], "kwargs": {}, "options": {}}
    found = violations(env(**{field: sig}))
    assert [p for p, _ in found] == [field]
    assert "only x_celery_kwargs" in found[0][1]


def test_a_disguised_celery_field_is_seen_after_json_decoding() -> None:
    text = '{"type": "email.send", "args": [], "x_celery_\\u006cink": {"task": "x"}}'
    assert [p for p, _ in violations(text)] == ["x_celery_link"]


@pytest.mark.parametrize("value", [[1], "a=1", 3, True])
def test_celery_kwargs_must_be_a_json_object(value: Any) -> None:
    assert violations(env(x_celery_kwargs=value)) == [
        ("x_celery_kwargs", "must be a JSON object (the Celery keyword arguments)")]


def test_celery_kwargs_keys_must_be_strings() -> None:
    assert [p for p, _ in violations(env(x_celery_kwargs={1: "a"}))] == ["x_celery_kwargs"]


def test_celery_kwargs_and_other_extensions_are_kept() -> None:
    job = parse_envelope(env(x_celery_kwargs={"flag": True}, x_trace={"id": 1}, x_celery=1))
    assert job.extensions == {"x_celery_kwargs": {"flag": True}, "x_trace": {"id": 1},
                              "x_celery": 1}
