from django.db import models


class Order(models.Model):
    email = models.EmailField()
    total_cents = models.PositiveIntegerField()
    receipt_sent = models.BooleanField(default=False)
    charge_attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
