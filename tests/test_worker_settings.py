"""``shutdown_cancel_window``: at most half of the drain (explicit values clamped, warned)."""

from __future__ import annotations

import logging

import pytest

from ojs_celery.conf import read_settings


def test_default_window_is_five_seconds_and_at_most_half_the_drain() -> None:
    assert read_settings({}).cancel_window == 5.0
    assert read_settings({"shutdown_grace_period": 4}).cancel_window == 2.0
    assert read_settings({"shutdown_grace_period": 0}).cancel_window == 0.0  # no window


def test_a_larger_window_is_clamped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ojs_celery.conf"):
        settings = read_settings({"shutdown_grace_period": 10, "shutdown_cancel_window": 8})
    assert settings.shutdown_cancel_window == 5.0 and settings.cancel_window == 5.0
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_a_window_within_half_is_kept_silently(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ojs_celery.conf"):
        settings = read_settings({"shutdown_grace_period": 10, "shutdown_cancel_window": 3})
    assert settings.cancel_window == 3.0 and caplog.records == []
