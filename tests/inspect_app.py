"""Apps for the migration report tests (``ojs-celery -A tests.inspect_app:<app> inspect``):
never connected to; they only have to be read."""

from __future__ import annotations

from typing import Any

from celery import Celery, Task
from kombu import Queue

from ojs_celery import OJSTask, install


class GatewayError(Exception):
    pass


redis_app = Celery("inspect_redis", set_as_current=False)
redis_app.conf.update(
    broker_url="redis://127.0.0.1:6379/15",
    broker_transport_options={"visibility_timeout": 600},
    task_serializer="pickle",
    accept_content=["json", "pickle"],
    worker_pool="threads",
    task_routes={"billing.*": {"queue": "billing"}},
    ojs={"store_url": "sqlite:///:memory:", "type_map": {"legacy.cleanup": "maintenance.cleanup"},
         "default_timeout": 900},
)
install(redis_app)


@redis_app.task(name="billing.charge", base=OJSTask, bind=True, soft_time_limit=900,
                time_limit=960, max_retries=5, autoretry_for=(GatewayError,), retry_backoff=2,
                retry_backoff_max=60, retry_jitter=False, expires=3600, rate_limit="10/m",
                shared=False)
def charge(self: OJSTask, order_id: int) -> None:
    return None


@redis_app.task(name="pdf.render", base=OJSTask, soft_time_limit=10.5, shared=False)
def render(doc_id: int) -> None:
    return None


@redis_app.task(name="email.send", base=OJSTask, shared=False)
def send_email(to: str) -> None:
    return None


@redis_app.task(name="maintenance.cleanup", shared=False)
def cleanup() -> None:
    return None


@redis_app.task(name="plain.report", shared=False, serializer="pickle")
def report() -> None:
    return None


amqp_app = Celery("inspect_amqp", set_as_current=False)
amqp_app.conf.update(
    broker_url="amqp://guest:guest@127.0.0.1:5672//",
    task_queues=[Queue("celery"), Queue("video", queue_arguments={"x-consumer-timeout": 600000})],
    task_create_missing_queues=False,
    task_routes={"video.encode": {"queue": "video"}},
    ojs={"store_url": "sqlite:///:memory:"},
)
install(amqp_app)


@amqp_app.task(name="video.encode", base=OJSTask, time_limit=3600, shared=False)
def encode(path: str) -> None:
    return None


@amqp_app.task(name="video.thumbnail", base=OJSTask, time_limit=7200, shared=False)
def thumbnail(path: str) -> None:
    return None


@amqp_app.task(name="video.legacy", serializer="pickle", time_limit=60, shared=False)
def legacy(path: str) -> None:
    return None


@amqp_app.task(name="video upload", base=OJSTask, time_limit=60, shared=False)
def upload(path: str) -> None:
    return None


clean_app = Celery("inspect_clean", set_as_current=False)
clean_app.conf.update(broker_url="memory://", ojs={"store_url": "sqlite:///:memory:"})
install(clean_app)


@clean_app.task(name="clean.job", base=OJSTask, time_limit=60, soft_time_limit=50, shared=False)
def clean_job() -> None:
    return None


tight_app = Celery("inspect_tight", set_as_current=False)
tight_app.conf.update(broker_url="memory://", ojs={
    "store_url": "sqlite:///:memory:", "heartbeat_interval": 5, "worker_heartbeat_timeout": 12,
    "sweep_interval": 1})
install(tight_app)


class ProjectTask(Task):  # type: ignore[misc]
    """A project's own task class (``task_cls``): every task without ``base=`` has it."""

    def on_failure(self, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        return None


class ProjectOJSTask(OJSTask, ProjectTask):  # type: ignore[misc]
    pass


custom_app = Celery("inspect_custom", set_as_current=False, task_cls=ProjectTask)
custom_app.conf.update(broker_url="memory://", ojs={"store_url": "sqlite:///:memory:"})
install(custom_app)


@custom_app.task(name="custom.lost", base=OJSTask, time_limit=60, shared=False)
def lost() -> None:
    return None


@custom_app.task(name="custom.kept", base=ProjectOJSTask, time_limit=60, shared=False)
def kept() -> None:
    return None


@custom_app.task(name="custom.plain", time_limit=60, shared=False)
def plain() -> None:
    return None


django_app = Celery("inspect_django", set_as_current=False,
                    task_cls="celery.contrib.django.task:DjangoTask")
django_app.conf.update(broker_url="memory://", ojs={"store_url": "sqlite:///:memory:"})
install(django_app)


@django_app.task(name="django.job", base=OJSTask, time_limit=60, shared=False)
def django_job() -> None:
    return None
