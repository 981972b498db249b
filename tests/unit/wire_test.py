"""chat_core's connections as a user of a cluster needs them: an endpoint's connection kept between requests and
no cookie carried from one request to the next, a redirect named and never followed, TLS checked against the
system's certificates (``SSL_CERT_FILE`` honoured), an opted-in http:// proxy for chat requests and env sessions
alike, credentials and line breaks refused up front, and a refused connection told apart so it can be waited out.
The hostile servers' tests hold what happens when a server breaks HTTP or WebSocket."""

from __future__ import annotations

import asyncio
import os
import ssl
import time
import tomllib
from collections.abc import Awaitable, Callable, Iterator
from importlib.metadata import version
from pathlib import Path

import chat_core.net.settings
import pytest
from chat_core import ChatEndpoint, NotAnOpenEnvServer
from chat_core.env.task_api import OpenEnvServer
from chat_core.episode.chat import post
from chat_core.net.env_socket import open_session
from chat_core.net.http_request import ConnectionRefused, HttpError, Redirected, check_url, request
from packaging.requirements import Requirement
from test_support.proxy import Proxy, started_proxy
from test_support.raw_servers import TEXT, ServerThread, accept_websocket, frame, read_frame
from test_support.waits import free_port

pytest_plugins = ["test_support.pytest_plugin"]
COMPLETION = b'{"choices": [{"message": {"role": "assistant", "content": "hi"}}]}'
LIMIT = 1 << 20


class Endpoint:
    """A raw chat endpoint answering every request with a completion, with ``head`` (header lines) in its answer's
    head: the connections it took and the request heads it read."""

    def __init__(self, head: bytes = b"") -> None:
        self.connections = 0
        self.heads: list[str] = []
        self._head = head

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        while True:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            self.heads.append(head)
            length = next(
                (int(line.split(":")[1]) for line in head.split("\r\n") if line.lower().startswith("content-length")), 0
            )
            await reader.readexactly(length)
            writer.write(
                b"HTTP/1.1 200 OK\r\n%sContent-Length: %d\r\n\r\n%s" % (self._head, len(COMPLETION), COMPLETION)
            )
            await writer.drain()


def posted(url: str, times: int = 2) -> list[bytes]:
    """The bodies of ``times`` POSTs to ``url``, made one after the other in one event loop."""

    async def run() -> list[bytes]:
        return [
            (await request("POST", url, {}, b"{}", max_body_bytes=LIMIT, limit_name="limit")).body for _ in range(times)
        ]

    return asyncio.run(run())


def test_requests_to_an_endpoint_share_one_kept_connection(raw_server_thread: ServerThread) -> None:
    endpoint = Endpoint()
    port = raw_server_thread.serve(endpoint)

    assert posted(f"http://127.0.0.1:{port}/v1/chat/completions") == [COMPLETION] * 2
    assert endpoint.connections == 1


def test_a_cookie_an_endpoint_sets_is_never_sent_back(raw_server_thread: ServerThread) -> None:
    # An endpoint behind a load balancer that pins sessions by cookie would pin every episode of the process to one
    # backend; and keeping cookies costs every request.
    endpoint = Endpoint(b"Set-Cookie: backend=3; Path=/\r\n")
    port = raw_server_thread.serve(endpoint)

    assert posted(f"http://localhost:{port}/v1/chat/completions") == [COMPLETION] * 2
    assert [line for head in endpoint.heads for line in head.lower().split("\r\n") if line.startswith("cookie")] == []


def redirecting(location: str) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """A raw server answering every request with a 307 to ``location``."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(
                b"HTTP/1.1 307 Temporary Redirect\r\nLocation: %s\r\nContent-Length: 0\r\n\r\n" % location.encode()
            )
            await writer.drain()

    return handler


def test_a_chat_endpoint_that_redirects_is_named_and_not_followed(raw_server_thread: ServerThread) -> None:
    # Following it would send the chat, with the model's key, wherever the answer points.
    elsewhere = Endpoint()
    location = f"http://127.0.0.1:{raw_server_thread.serve(elsewhere)}/v1/chat/completions"
    chat = ChatEndpoint(f"http://127.0.0.1:{raw_server_thread.serve(redirecting(location))}/v1", "policy")

    async def sent() -> None:
        await post(chat, chat.request_headers(), b"{}", deadline=time.monotonic() + 10, max_answer_bytes=LIMIT)

    with pytest.raises(Redirected, match=f"HTTP 307, a redirect to {location}"):
        asyncio.run(sent())
    assert elsewhere.connections == 0


def test_a_task_api_that_redirects_is_named_and_not_followed(raw_server_thread: ServerThread) -> None:
    elsewhere = Endpoint()
    location = f"http://127.0.0.1:{raw_server_thread.serve(elsewhere)}/list_environments"
    server = OpenEnvServer(f"http://127.0.0.1:{raw_server_thread.serve(redirecting(location))}")

    with pytest.raises(NotAnOpenEnvServer, match=f"GET /list_environments .*HTTP 307, a redirect to {location}"):
        asyncio.run(server.env_name())
    assert elsewhere.connections == 0


def test_an_https_endpoint_the_system_trusts_is_spoken_to_over_tls(
    raw_server_thread: ServerThread, trusted_tls: ssl.SSLContext
) -> None:
    endpoint = Endpoint()
    port = raw_server_thread.serve(endpoint, tls=trusted_tls)

    assert posted(f"https://localhost:{port}/v1/chat/completions") == [COMPLETION] * 2
    assert endpoint.connections == 1


@pytest.mark.parametrize(
    ("host", "trusted", "says"),
    [("localhost", False, "CERTIFICATE_VERIFY_FAILED"), ("127.0.0.1", True, "IP address mismatch")],
    ids=["a certificate the system doesn't trust", "a trusted certificate for another host"],
)
def test_an_https_endpoint_whose_certificate_doesnt_hold_is_refused(
    host: str,
    trusted: bool,
    says: str,
    raw_server_thread: ServerThread,
    trusted_tls: ssl.SSLContext,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not trusted:
        monkeypatch.delenv("SSL_CERT_FILE")
        chat_core.net.settings.tls_context.cache_clear()
    endpoint = Endpoint()
    port = raw_server_thread.serve(endpoint, tls=trusted_tls)

    with pytest.raises(HttpError, match=says) as raised:
        posted(f"https://{host}:{port}/v1/chat/completions", times=1)
    assert not isinstance(raised.value, ConnectionRefused)
    assert endpoint.heads == []


def test_a_refused_connection_is_told_apart_from_other_failures() -> None:
    with pytest.raises(ConnectionRefused, match="refused the connection"):
        posted(f"http://127.0.0.1:{free_port()}/v1/chat/completions", times=1)


@pytest.mark.parametrize(
    ("url", "headers", "says"),
    [
        ("ftp://host/v1", {}, "isn't an absolute http"),
        ("/v1/chat/completions", {}, "isn't an absolute http"),
        ("http://user:secret@host/v1", {}, "holds credentials"),
        ("http://host/v1", {"Authorization": "Bearer x\r\nX-Injected: 1"}, "holds a line break"),
    ],
    ids=["another scheme", "no host", "credentials", "a header with a line break"],
)
def test_a_request_that_cant_be_sent_is_refused_up_front(url: str, headers: dict[str, str], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        check_url(url, headers)


@pytest.fixture
def proxied(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int], None]]:
    """Opt in to the environment's proxy and name the one at a port for http and https, with credentials."""

    def named(port: int) -> None:
        for name in ("HTTP_PROXY", "HTTPS_PROXY"):
            monkeypatch.setenv(name, f"http://agent:p%40ss@127.0.0.1:{port}")
        monkeypatch.setenv(chat_core.net.settings.PROXY_FROM_ENV, "1")
        for name in ("http_proxy", "https_proxy", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
            monkeypatch.delenv(name, raising=False)
        chat_core.net.settings.proxy_from_env.cache_clear()
        chat_core.net.settings.check_proxies.cache_clear()

    yield named
    monkeypatch.undo()
    chat_core.net.settings.proxy_from_env.cache_clear()
    chat_core.net.settings.check_proxies.cache_clear()


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https-tunnel"])
def test_with_the_proxy_opted_in_requests_go_through_it_with_its_credentials(
    raw_server_thread: ServerThread, proxied: Callable[[int], None], trusted_tls: ssl.SSLContext, tls: bool
) -> None:
    proxy = raw_server_thread.run(started_proxy(free_port()))
    proxied(proxy.port)
    endpoint = Endpoint()
    port = raw_server_thread.serve(endpoint, tls=trusted_tls if tls else None)
    url = f"{'https' if tls else 'http'}://localhost:{port}/v1/chat/completions"

    assert posted(url) == [COMPLETION] * 2

    first_line = proxy.asked[0].split("\r\n")[0]
    assert first_line == (f"CONNECT localhost:{port} HTTP/1.1" if tls else f"POST {url} HTTP/1.1")
    assert "Proxy-Authorization: Basic YWdlbnQ6cEBzcw==" in proxy.asked[0].split("\r\n")
    assert endpoint.connections == 1
    raw_server_thread.run(proxy.close())


def test_without_opting_in_or_for_a_host_no_proxy_names_requests_go_direct(
    raw_server_thread: ServerThread, proxied: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = raw_server_thread.run(started_proxy(free_port()))
    for opt_in in (False, True):
        proxied(proxy.port)
        if opt_in:
            monkeypatch.setenv("NO_PROXY", "localhost")
            chat_core.net.settings.check_proxies.cache_clear()
        else:
            monkeypatch.delenv(chat_core.net.settings.PROXY_FROM_ENV)
            chat_core.net.settings.proxy_from_env.cache_clear()
        endpoint = Endpoint()
        port = raw_server_thread.serve(endpoint)

        assert posted(f"http://localhost:{port}/v1", times=1) == [COMPLETION]
        assert proxy.asked == [] and endpoint.connections == 1
    raw_server_thread.run(proxy.close())


def test_a_proxy_that_isnt_an_http_url_is_refused_up_front(
    proxied: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    proxied(1)
    monkeypatch.setenv("HTTPS_PROXY", "socks5://127.0.0.1:1080")
    chat_core.net.settings.check_proxies.cache_clear()

    with pytest.raises(ValueError, match="isn't an http:// URL"):
        check_url("https://api.example.com/v1/chat/completions", {})


def test_with_the_proxy_opted_in_an_env_session_is_tunnelled_through_it(
    raw_server_thread: ServerThread, proxied: Callable[[int], None]
) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accept_websocket(reader, writer)
        _, payload = await read_frame(reader)
        writer.write(frame(TEXT, payload))
        await writer.drain()
        await reader.read()

    proxy: Proxy = raw_server_thread.run(started_proxy(free_port()))
    proxied(proxy.port)
    port = raw_server_thread.serve(echo)

    async def exchanged() -> str:
        session = await open_session(f"ws://localhost:{port}/ws", max_message_bytes=LIMIT)
        try:
            await session.send(b'{"type": "state"}')
            return await session.receive(5)
        finally:
            await session.close()

    assert asyncio.run(exchanged()) == '{"type": "state"}'
    assert proxy.asked[0].split("\r\n")[0] == f"CONNECT localhost:{port} HTTP/1.1"
    assert "Proxy-Authorization: Basic YWdlbnQ6cEBzcw==" in proxy.asked[0].split("\r\n")
    raw_server_thread.run(proxy.close())


def test_websockets_is_a_release_chat_cores_env_sessions_were_checked_against() -> None:
    # chat_core.net.env_socket relies on websockets behaving as the releases its requirements admit do (a recv with
    # a message queued returns it without waiting, its queue pauses reading through the transport it was given). On
    # any other release, check that module's hooks against it (the hostile servers' tests), then widen the pin.
    pyproject = Path(os.environ["TEST_SRCDIR"]) / "trainer_helpers" / "packages" / "chat_core" / "pyproject.toml"
    requirements = [Requirement(line) for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]
    pinned = next(requirement.specifier for requirement in requirements if requirement.name == "websockets")

    assert version("websockets") in pinned, f"websockets {version('websockets')} isn't in chat_core's pin {pinned}"
