"""On the embedded filesystem transport a message consumed by a worker is claimed (renamed) in the
broker's folder: after kill -9 of a worker holding a job for its ETA, the sweeper re-dispatches
it when the worker's beats listed it, and the transport restores the claims of a process that is
gone when they did not. The same test runs on Redis and RabbitMQ in test_e2e_worker."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from tests.conftest import Env, start_env
from tests.test_e2e_worker import SETTINGS
from tests.test_e2e_worker import (
    test_kill_9_of_a_worker_holding_an_eta_message_runs_it_once_when_due as kill_9_holding_eta,
)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("eta-filesystem")
    with start_env("filesystem", tmp, concurrency=1, beat=True,
                   config={"ojs": SETTINGS}) as started:
        yield started


@pytest.mark.parametrize("listed", [True, False], ids=["listed", "unlisted"])
def test_kill_9_on_the_embedded_transport(env: Env, tmp_path: pathlib.Path, listed: bool) -> None:
    kill_9_holding_eta(env, tmp_path, listed)
