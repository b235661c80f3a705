"""Job ids: an envelope from outside needs a UUIDv7; a Celery caller's task id (canvas assigns
UUIDv4s, ``task_id=`` may be any word) is accepted, and read back from the store."""

from __future__ import annotations

import uuid

import pytest

from ojs_celery.envelope import InvalidJob, Job, new_job_id, parse_envelope, parse_input


def test_an_envelope_from_outside_needs_a_uuid7() -> None:
    with pytest.raises(InvalidJob, match="UUIDv7"):
        parse_envelope({"type": "a.b", "args": [], "id": str(uuid.uuid4())})
    assert parse_envelope({"type": "a.b", "args": [], "id": new_job_id()}).id


@pytest.mark.parametrize("task_id", ["3f2b8c1e-9a4d-4e6f-8b7a-1c2d3e4f5a6b",  # Celery's uuid4
                                     "7D1E2F3A-4B5C-4D6E-9F70-8192A3B4C5D6",
                                     "report:2024-01", "nightly.export@eu"])
def test_a_celery_callers_task_id_is_kept(task_id: str) -> None:
    job = parse_input({"type": "a.b", "args": [], "id": task_id}, celery_id=True)
    expected = task_id.lower() if len(task_id) == 36 else task_id
    assert job.id == expected
    assert Job.model_validate_json(job.to_json()).id == expected  # as the store reads it


@pytest.mark.parametrize("task_id", ["Report-1", "has space", "", "x" * 256, "a/b"])
def test_task_ids_no_store_key_should_carry_are_refused(task_id: str) -> None:
    with pytest.raises(InvalidJob, match="id"):
        parse_input({"type": "a.b", "args": [], "id": task_id}, celery_id=True)
