"""Pytest fixtures for the sample bundle's server and the scripted model; enable them with
``pytest_plugins = ["test_support.pytest_plugin"]`` in a ``conftest.py``.

``sample_env`` is one server per test module, checked after each test: a test that leaves an episode, a session or
a sandbox open fails in its teardown with ``LeftOpen``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from . import raw_servers
from .env_server import ServedBundle, serve_bundle
from .scripted_model import ScriptedModel


@pytest.fixture(scope="module")
def sample_env_server() -> Iterator[ServedBundle]:
    """The sample bundle's server, shared by a module's tests."""
    with serve_bundle() as served:
        yield served


@pytest.fixture
def sample_env(sample_env_server: ServedBundle) -> Iterator[ServedBundle]:
    """The module's sample server, with nothing left open once the test is over."""
    yield sample_env_server
    sample_env_server.wait_until_closed()


@pytest.fixture
def scripted_model() -> Iterator[ScriptedModel]:
    """A scripted model with no script yet, closed after the test."""
    with ScriptedModel() as model:
        yield model


@pytest.fixture
def nothing_left_unclosed() -> Iterator[None]:
    """The test leaves no socket or transport for the garbage collector to find unclosed."""
    with raw_servers.nothing_left_unclosed():
        yield
