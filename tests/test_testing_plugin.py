"""``ojs_celery.testing`` used as a user would: a small test module of their own, run by pytest
in a subprocess with the plugin enabled, against a real prefork worker on the embedded default."""

from __future__ import annotations

import textwrap

import pytest

pytest_plugins = ["pytester"]

USER_APP = '''
from celery import Celery
from ojs_celery import OJSTask, current_job, install

app = Celery("userapp", set_as_current=False)
install(app)


@app.task(name="user.double", base=OJSTask)
def double(x):
    return {"value": 2 * x, "job": current_job().job_id}


@app.task(name="user.broken", base=OJSTask)
def broken():
    raise ValueError("broken on purpose")
'''

USER_TESTS = '''
import os

from celery.result import AsyncResult


def test_a_job_completes_on_the_real_worker(ojs_worker, ojs_enqueue, ojs_wait):
    job = ojs_enqueue({"type": "user.double", "args": [21]})
    done = ojs_wait(job.id, timeout=60)
    assert done.state == "completed"
    assert done.result == {"value": 42, "job": job.id}
    assert ojs_worker.process.pid != os.getpid()


def test_delay_and_a_discarded_job(ojs_app, ojs_worker, ojs_enqueue, ojs_wait):
    result = ojs_app.tasks["user.double"].delay(5)
    assert result.get(timeout=60)["value"] == 10
    job = ojs_enqueue({"type": "user.broken", "args": [], "retry": {"max_attempts": 1}})
    done = ojs_wait(job.id, timeout=60)
    assert done.state == "discarded" and done.error["type"] == "ValueError"
    assert AsyncResult(job.id, app=ojs_app).get(timeout=30, propagate=False) is not None
'''


def test_the_plugin_runs_a_users_tests_against_a_real_worker(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(userapp=USER_APP, test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-p", "ojs_celery.testing", "--ojs-app=userapp:app",
                                           "-p", "no:cacheprovider", timeout=170)
    result.assert_outcomes(passed=2)


def test_the_plugin_installs_ojs_on_an_app_that_leaves_it_to_django(
    pytester: pytest.Pytester,
) -> None:
    """A Django project's ``celery.py`` often leaves ``install(app)`` to the Django app's
    ``ready()``, which the fixtures' worker reaches too late: the fixtures install it."""
    app_without_install = USER_APP.replace("install(app)\n", "")
    assert "install(app)" not in app_without_install.split("import", 2)[-1]
    pytester.makepyfile(userapp=app_without_install, test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-p", "ojs_celery.testing", "--ojs-app=userapp:app",
                                           "-p", "no:cacheprovider", timeout=170)
    result.assert_outcomes(passed=2)


def test_the_plugin_asks_for_the_app(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user="def test_x(ojs_app):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "ojs_celery.testing", timeout=60)
    result.stdout.fnmatch_lines(["*--ojs-app=module:app*"])


def test_an_eager_app_fails_ojs_wait_at_once_saying_why(pytester: pytest.Pytester) -> None:
    """Test settings with ``task_always_eager`` make ``.delay()`` run in the test process:
    ``ojs_wait`` says so at once instead of waiting its whole timeout for an unknown job."""
    pytester.makepyfile(userapp=USER_APP + "\napp.conf.task_always_eager = True\n",
                        test_user=(
                            "def test_eager(ojs_app, ojs_wait):\n"
                            "    result = ojs_app.tasks['user.double'].delay(1)\n"
                            "    ojs_wait(result.id, timeout=120)\n"))
    result = pytester.runpytest_subprocess("-p", "ojs_celery.testing", "--ojs-app=userapp:app",
                                           "-p", "no:cacheprovider", "--durations=0",
                                           timeout=100)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the app has task_always_eager on*"])


PRODUCTION_APP = '''
from celery import Celery
from ojs_celery import OJSTask, install

app = Celery("prodapp", set_as_current=False, broker="redis://127.0.0.1:1/0",
             backend="redis://127.0.0.1:1/1")
app.conf.task_routes = {"prod.email": {"queue": "emails"}}
install(app)


@app.task(name="prod.double", base=OJSTask)
def double(x):
    return 2 * x


@app.task(name="prod.email", base=OJSTask)
def email(to):
    return "sent to " + to
'''

PRODUCTION_TESTS = '''
import textwrap

import pytest

from ojs_celery.runtime import get_runtime
from prodapp import app


@pytest.fixture(scope="session")
def ojs_worker_arguments():
    return ["-Q", "celery,emails"]


def test_an_ordinary_test_reads_the_backend_first():
    # made for the production settings, before the fixtures
    assert app.backend is not None
    assert app.pool is not None and app.amqp.producer_pool is not None


def test_results_come_from_the_test_backend(ojs_app, ojs_worker):
    assert ojs_app.tasks["prod.double"].delay(4).get(timeout=60) == 8


def test_a_routed_queue_given_to_the_worker_is_consumed(ojs_app, ojs_worker, ojs_wait):
    result = ojs_app.tasks["prod.email"].delay("a@example.com")
    assert ojs_wait(result.id, timeout=60).result == "sent to a@example.com"


def test_the_worker_drains_briefly_at_teardown(ojs_app):
    assert get_runtime(ojs_app).settings.shutdown_grace_period == 2.0
'''


def test_the_fixtures_replace_what_the_production_settings_made_and_take_worker_arguments(
    pytester: pytest.Pytester,
) -> None:
    """An app whose settings point at production servers (nothing listens there): an earlier
    test made its result backend, and a task is routed to a queue task_queues does not
    declare. The fixtures' worker consumes it when ojs_worker_arguments gives it."""
    pytester.makepyfile(prodapp=PRODUCTION_APP, test_prod=PRODUCTION_TESTS)
    result = pytester.runpytest_subprocess("-p", "ojs_celery.testing", "--ojs-app=prodapp:app",
                                           "-p", "no:cacheprovider", "-p", "no:randomly",
                                           timeout=170)
    result.assert_outcomes(passed=4)


DJANGO_STYLE_APP = '''
import os

from celery import Celery
from ojs_celery import OJSTask, install

PRODUCTION = os.environ["PROD_DIR"]


class Settings:
    """What django.conf.settings looks like to config_from_object(namespace="CELERY"): a
    Django project's CELERY_* settings, pointing at production."""

    CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
    CELERY_RESULT_BACKEND = f"db+sqlite:///{PRODUCTION}/results.sqlite3"
    CELERY_OJS = {"store_url": f"sqlite:///{PRODUCTION}/store.sqlite3"}


app = Celery("djangostyle", set_as_current=False)
app.config_from_object(Settings, namespace="CELERY")
install(app)


@app.task(name="dj.double", base=OJSTask)
def double(x):
    return 2 * x
'''


#: The test run against a production-configured app (its task ``double`` named ``{task}``).
EMBEDDED_DEFAULT_TESTS = '''
import os


def test_the_fixtures_use_the_embedded_default(ojs_app, ojs_worker, ojs_wait):
    result = ojs_app.tasks["{task}"].delay(4)
    assert ojs_wait(result.id, timeout=60).state == "completed"
    assert result.get(timeout=30) == 8
    assert os.listdir(os.environ["PROD_DIR"]) == []  # no production store or results
'''


def run_against_production(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                           module: str, app_text: str, task: str,
                           environment: dict[str, str]) -> None:
    """Run :data:`EMBEDDED_DEFAULT_TESTS` with the fixtures on the app ``module:app`` (text
    ``app_text``), whose production store and results would go to ``PROD_DIR``, with
    ``environment`` set (``{production}`` in a value: that folder); it must pass."""
    production = pytester.mkdir("production")
    monkeypatch.setenv("PROD_DIR", str(production))
    for name, value in environment.items():
        monkeypatch.setenv(name, value.format(production=production))
    pytester.makepyfile(**{module: app_text,
                           f"test_{module}": EMBEDDED_DEFAULT_TESTS.format(task=task)})
    result = pytester.runpytest_subprocess("-p", "ojs_celery.testing", f"--ojs-app={module}:app",
                                           "-p", "no:cacheprovider", timeout=170)
    result.assert_outcomes(passed=1)


def test_the_fixtures_replace_a_django_projects_namespaced_settings_and_environment(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Django project's settings (``CELERY_BROKER_URL``, ``CELERY_RESULT_BACKEND``,
    ``CELERY_OJS`` read with ``namespace="CELERY"``), and the broker's URL in the environment,
    where a twelve-factor project keeps it (Celery prefers ``CELERY_BROKER_URL`` there to any
    setting): the fixtures' worker and the test process use the embedded default, not the
    production broker, result backend and store (on Celery 5.4 to 5.6 the namespaced
    settings won over the fixtures', and on every version the environment did)."""
    run_against_production(pytester, monkeypatch, "djangostyle", DJANGO_STYLE_APP, "dj.double", {
        "CELERY_BROKER_URL": "redis://127.0.0.1:1/2",
        "CELERY_RESULT_BACKEND": "db+sqlite:///{production}/env-results.sqlite3",
    })


ENV_CONFIGURED_APP = '''
import os

from celery import Celery
from ojs_celery import OJSTask, install


class Settings:
    """A twelve-factor project's settings: the broker's URL is required from the
    environment (os.environ[...], or django-environ's env("CELERY_BROKER_URL"))."""

    CELERY_BROKER_URL = os.environ["CELERY_BROKER_URL"]
    CELERY_RESULT_BACKEND = os.environ["CELERY_RESULT_BACKEND"]


app = Celery("envconfigured", set_as_current=False)
app.config_from_object(Settings, namespace="CELERY")
install(app)


@app.task(name="env.double", base=OJSTask)
def double(x):
    return 2 * x
'''

def test_the_fixtures_worker_starts_for_settings_that_require_the_urls_from_the_environment(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Settings that read the broker's URL from the environment and require it there (a
    twelve-factor project: ``os.environ["CELERY_BROKER_URL"]``, django-environ's
    ``env("CELERY_BROKER_URL")``): the fixtures' worker, whose subprocess imports them anew,
    starts, and it and the test process still use the embedded default, whatever the
    ``celery`` command reads from the environment too. The variables were once dropped from
    the environment, so the worker's import of the settings failed."""
    run_against_production(pytester, monkeypatch, "envconfigured", ENV_CONFIGURED_APP,
                           "env.double", {
        "CELERY_BROKER_URL": "redis://127.0.0.1:1/2",
        "CELERY_RESULT_BACKEND": "db+sqlite:///{production}/env-results.sqlite3",
        # the celery command's --broker and --result-backend, which it copies to
        # CELERY_BROKER_URL and CELERY_RESULT_BACKEND (on Celery 5.4 to 5.6 after it loaded
        # the app)
        "BROKER_URL": "redis://127.0.0.1:1/3",
        "CELERY_BROKER": "redis://127.0.0.1:1/4",
        "RESULT_BACKEND": "db+sqlite:///{production}/cli-results.sqlite3",
    })


def test_the_readmes_fixture_override_is_session_scoped_as_the_plugins_fixture_is() -> None:
    """The README tells users to override ``ojs_worker_arguments`` (and ``ojs_app_path``): an
    override in the function scope, pytest's default, stops every test that uses ``ojs_worker``
    with a ``ScopeMismatch``, so the README shows the session-scoped override, which must be the
    plugin's own fixtures' scope."""
    import pathlib
    import re

    from ojs_celery import testing

    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("### Tests: eager mode and the pytest plugin"):]
    section = section[:section.index("\n## ")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    override = [block for block in blocks if "def ojs_worker_arguments" in block]
    assert override, "the README shows no override of ojs_worker_arguments"
    assert '@pytest.fixture(scope="session")' in override[0]
    namespace: dict[str, object] = {"pytest": pytest}
    exec(textwrap.dedent(override[0]), namespace)  # the README's own example compiles
    source = pathlib.Path(testing.__file__).read_text()
    for name in ("ojs_worker_arguments", "ojs_app_path"):
        assert f'@pytest.fixture(scope="session")\ndef {name}(' in source
    assert "ojs_app_path` fixture, session-scoped" in " ".join(section.split())
