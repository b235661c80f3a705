"""HTTP endpoints: place an order (its receipt is sent once the transaction commits), and accept
OJS job envelopes posted as JSON from other services (only with ojs_celery on)."""

from __future__ import annotations

import json

from django.conf import settings
from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from shop.celery import app

from .models import Order
from .tasks import send_receipt


@csrf_exempt
@require_POST
def place_order(request: HttpRequest) -> JsonResponse:
    try:
        data = json.loads(request.body)
        email, total = str(data["email"]), int(data["total_cents"])
    except (ValueError, KeyError, TypeError) as exc:
        return JsonResponse({"errors": [{"field": "body", "rule": str(exc)}]}, status=400)
    with transaction.atomic():
        order = Order.objects.create(email=email, total_cents=total)
        transaction.on_commit(lambda: send_receipt.delay(order.id))
    return JsonResponse({"id": order.id}, status=201)


@csrf_exempt
@require_POST
def enqueue_job(request: HttpRequest) -> JsonResponse:
    """POST an OJS envelope; 202 with the job, or 400 naming every invalid field."""
    if not settings.OJS_ENABLED:
        return JsonResponse({"errors": [{"field": "", "rule": "OJS is not enabled"}]},
                            status=404)
    import ojs_celery

    try:
        job = ojs_celery.enqueue(request.body, app=app)
    except ojs_celery.InvalidJob as exc:
        return JsonResponse(
            {"errors": [{"field": field, "rule": rule} for field, rule in exc.violations]},
            status=409 if isinstance(exc, ojs_celery.DuplicateJob) else 400)
    return JsonResponse(job.to_dict(), status=202)
