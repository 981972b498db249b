"""Pytest fixtures for the sample bundle's server and the scripted model; enable them with
``pytest_plugins = ["test_support.pytest_plugin"]`` in a ``conftest.py``.

``sample_env`` is one server per test module, checked after each test: a test that leaves an episode, a session or
a sandbox open fails in its teardown with ``LeftOpen``. ``raw_servers`` is a thread of raw servers for the client
tests, ``trusted_tls`` a server TLS context for ``localhost`` whose certificate chat_core trusts for the test.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import chat_core.net.settings
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


CERTIFICATE = Path(__file__).with_name("tls") / "localhost.pem"
"""A self-signed certificate for ``localhost`` (``openssl req -x509 -days 36500``), its key beside it."""


@pytest.fixture
def raw_server_thread() -> Iterator[raw_servers.ServerThread]:
    """An event loop of its own for the test's raw servers, closed with everything it serves after the test."""
    with raw_servers.ServerThread() as thread:
        yield thread


@pytest.fixture
def trusted_tls(monkeypatch: pytest.MonkeyPatch) -> Iterator[ssl.SSLContext]:
    """The TLS context of a server for ``localhost`` that chat_core trusts during the test: ``SSL_CERT_FILE`` names
    its certificate, and chat_core's TLS context is loaded again from it (and again after the test)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(CERTIFICATE, CERTIFICATE.with_suffix(".key"))
    monkeypatch.setenv("SSL_CERT_FILE", str(CERTIFICATE))
    chat_core.net.settings.tls_context.cache_clear()
    yield context
    monkeypatch.undo()
    chat_core.net.settings.tls_context.cache_clear()
