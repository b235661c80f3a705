"""Eager mode (``task_always_eager``): what a project's unit tests rely on, no worker needed."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from celery import chord
from django.test import Client
from orders.models import Order
from orders.tasks import charge_card, line_total, send_receipt, tally
from shop.celery import app


@pytest.fixture(autouse=True)
def eager() -> Iterator[None]:
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = False


def order(total: int = 1000) -> Order:
    return Order.objects.create(email="ann@example.com", total_cents=total)


def test_receipt_retries_until_the_relay_accepts() -> None:
    """Celery's eager retry runs the retry at once, inside the first call (whose own result
    stays RETRY): the test looks at what the task did."""
    placed = order()
    send_receipt.delay(placed.id, busy_times=2)
    placed.refresh_from_db()
    assert placed.receipt_sent


def test_charge_retries_transient_gateway_errors() -> None:
    placed = order()
    charge_card.delay(placed.id, failures=2)
    placed.refresh_from_db()
    assert placed.charge_attempts == 3


def test_charge_gives_up_after_max_retries() -> None:
    placed = order()
    charge_card.delay(placed.id, failures=10)
    placed.refresh_from_db()
    assert placed.charge_attempts == 4  # the first call and max_retries=3


def test_placing_an_order_sends_its_receipt_after_commit() -> None:
    response = Client().post("/orders/", json.dumps({"email": "bo@example.com",
                                                     "total_cents": 250}),
                             content_type="application/json")
    assert response.status_code == 201
    assert Order.objects.get(pk=response.json()["id"]).receipt_sent


def test_chord_adds_up_the_order_totals() -> None:
    orders = [order(100), order(250), order(650)]
    assert chord(line_total.s(o.id) for o in orders)(tally.s()).get() == 1000
