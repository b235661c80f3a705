"""The same tasks against a real prefork ``celery worker`` (and ``celery beat`` with
django-celery-beat's DatabaseScheduler), with Redis as broker and result backend."""

from __future__ import annotations

import json
import uuid
from contextlib import contextmanager

import pytest
from celery import chord
from celery.result import AsyncResult
from conftest import start_beat, wait_for
from django.test import Client
from django_celery_beat.models import IntervalSchedule, PeriodicTask
from orders.models import Order
from orders.tasks import (
    PaymentGatewayError,
    build_sales_report,
    charge_card,
    line_total,
    send_receipt,
    tally,
)

pytestmark = [pytest.mark.worker, pytest.mark.usefixtures("worker")]
TIMEOUT = 30


def order(total: int = 1000) -> Order:
    return Order.objects.create(email="ann@example.com", total_cents=total)


def test_receipt_retries_until_the_relay_accepts() -> None:
    placed = order()
    result = send_receipt.delay(placed.id, busy_times=2)
    assert result.get(timeout=TIMEOUT) == "receipt sent to ann@example.com"
    placed.refresh_from_db()
    assert placed.receipt_sent


def test_receipts_run_from_the_routed_queue() -> None:
    result = send_receipt.delay(order().id)
    result.get(timeout=TIMEOUT)
    assert AsyncResult(result.id).queue == "emails_high"


def test_charge_retries_transient_gateway_errors_with_backoff() -> None:
    placed = order()
    assert charge_card.delay(placed.id, failures=2).get(timeout=TIMEOUT) == 3


def test_charge_gives_up_after_max_retries() -> None:
    placed = order()
    result = charge_card.delay(placed.id, failures=10)
    with pytest.raises(PaymentGatewayError):
        result.get(timeout=TIMEOUT)
    placed.refresh_from_db()
    assert placed.charge_attempts == 4


def test_report_past_its_soft_limit_returns_what_it_has() -> None:
    result = build_sales_report.delay(seconds=6)
    assert result.get(timeout=TIMEOUT) == {"orders": None, "complete": False}


def test_a_receipt_due_after_it_expires_is_revoked() -> None:
    result = send_receipt.apply_async((order().id,), countdown=2, expires=0.5)
    wait_for(lambda: result.state == "REVOKED", TIMEOUT, "the expired receipt revoked")


def test_chord_adds_up_the_order_totals() -> None:
    orders = [order(100), order(250), order(650)]
    assert chord(line_total.s(o.id) for o in orders)(tally.s()).get(timeout=TIMEOUT) == 1000


def test_placing_an_order_sends_its_receipt_after_commit() -> None:
    response = Client().post("/orders/", json.dumps({"email": "cy@example.com",
                                                     "total_cents": 990}),
                             content_type="application/json")
    assert response.status_code == 201
    order_id = response.json()["id"]
    wait_for(lambda: Order.objects.get(pk=order_id).receipt_sent, TIMEOUT, "the receipt")


def test_database_schedule_runs_through_beat() -> None:
    """A periodic task stored in django-celery-beat's tables (written before beat starts: one
    SQLite file has one writer at a time) runs on the worker."""
    tag = f"tick{uuid.uuid4().hex[:8]}"
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(name=tag, task="orders.tasks.record_tick", interval=every,
                                args=json.dumps([tag]))
    with contextmanager(start_beat)():
        wait_for(lambda: Order.objects.filter(email=f"{tag}@beat.example").exists(), TIMEOUT,
                 "a tick scheduled from the database")
