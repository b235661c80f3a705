"""The shop's tasks: what a real project has (routing, retries, backoff, time limits, a chord)."""

from __future__ import annotations

import time
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from django.db.models import F
from shop.celery import app, task_base

from .models import Order

Base = task_base()


class MailServerBusy(Exception):
    """The mail relay said "try again later"."""


class PaymentGatewayError(Exception):
    """A transient payment gateway error."""


@app.task(bind=True, base=Base, max_retries=5, default_retry_delay=0.2)
def send_receipt(self: Any, order_id: int, busy_times: int = 0) -> str:
    """Routed to ``emails_high``; retries itself while the (simulated) relay is busy."""
    order = Order.objects.get(pk=order_id)
    if self.request.retries < busy_times:
        raise self.retry(exc=MailServerBusy(f"relay busy for order {order_id}"))
    Order.objects.filter(pk=order_id).update(receipt_sent=True)
    return f"receipt sent to {order.email}"


@app.task(base=Base, autoretry_for=(PaymentGatewayError,), retry_backoff=0.1,
          retry_backoff_max=1, retry_jitter=False, max_retries=3)
def charge_card(order_id: int, failures: int = 0) -> int:
    """Transient gateway errors retry with exponential backoff, at most 3 times."""
    Order.objects.filter(pk=order_id).update(charge_attempts=F("charge_attempts") + 1)
    attempts = Order.objects.get(pk=order_id).charge_attempts
    if attempts <= failures:
        raise PaymentGatewayError(f"gateway timeout (attempt {attempts})")
    return attempts


@app.task(base=Base, soft_time_limit=2, time_limit=4)
def build_sales_report(seconds: float = 0.0) -> dict[str, Any]:
    """Routed to ``reports_slow``; a report that runs past its soft limit returns what it has."""
    try:
        time.sleep(seconds)
        return {"orders": Order.objects.count(), "complete": True}
    except SoftTimeLimitExceeded:
        return {"orders": None, "complete": False}


@app.task(base=Base)
def line_total(order_id: int) -> int:
    return int(Order.objects.get(pk=order_id).total_cents)


@app.task(base=Base)
def tally(totals: list[int]) -> int:
    """The chord's callback: the sum of the header's results."""
    return sum(totals)


@app.task(base=Base)
def record_tick(tag: str) -> str:
    """Scheduled from django-celery-beat's database in the tests."""
    Order.objects.create(email=f"{tag}@beat.example", total_cents=0)
    return tag
