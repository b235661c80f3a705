"""Test settings: the project's settings with test overrides, as projects usually do. The
overrides of ``CELERY_*`` (``CELERY_OJS`` included) are what Celery and ojs_celery read."""

import json
import os

from shop.settings import *  # noqa: F403
from shop.settings import CELERY_OJS

CELERY_OJS = {**CELERY_OJS, "sweep_interval": 0.5}
CELERY_TASK_SOFT_TIME_LIMIT = 20
CELERY_TASK_TIME_LIMIT = 30
CELERY_RESULT_EXTENDED = True  # the tests read the queue a task ran from

# A test may pass extra CELERY_OJS keys (to check that a bad one stops `manage.py` at start).
if os.environ.get("SHOP_OJS_EXTRA"):
    CELERY_OJS = {**CELERY_OJS, **json.loads(os.environ["SHOP_OJS_EXTRA"])}
