"""chat_core's chat client (``chat_core._http``) against endpoints that answer in each way HTTP/1.1 allows, break
midway, drop kept connections, speak TLS and sit behind a proxy. Each endpoint is an asyncio server in the test's
event loop writing the answer's bytes as a model server could; the episode loop's own tests play whole episodes
through the client against the scripted model and slime's adapter."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import chat_core._http
import chat_core._net
import pytest
from chat_core._http import ConnectionRefused, HttpError, Route
from test_support.proxy import Proxy, started_proxy
from test_support.raw_servers import Opened, played
from test_support.waits import free_port

CERTIFICATE = Path(__file__).with_name("tls") / "localhost.pem"
COMPLETION = b'{"choices": [{"message": {"role": "assistant", "content": "hi"}}]}'


@dataclass
class Endpoint:
    """A raw endpoint: each request's head and body as it came, and the connections it took."""

    url: str
    requests: list[tuple[str, bytes]] = field(default_factory=list)
    connections: int = 0


Answering = Callable[[Endpoint, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
_opened: list[Opened] = []
pytest_plugins = ["test_support.pytest_plugin"]
pytestmark = pytest.mark.usefixtures("nothing_left_unclosed")


async def read_request(reader: asyncio.StreamReader) -> tuple[str, bytes] | None:
    """A request's head and body, or None when the connection closed first."""
    try:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    except asyncio.IncompleteReadError:
        return None
    length = next(
        (int(line.split(":", 1)[1]) for line in head.split("\r\n") if line.lower().startswith("content-length:")), 0
    )
    return head, await reader.readexactly(length)


def endpoint(answering: Answering, tls: ssl.SSLContext | None = None) -> Callable[[], Awaitable[Endpoint]]:
    """A coroutine starting the endpoint in the running loop, each connection served by ``answering``."""

    async def started() -> Endpoint:
        port = free_port()
        scheme = "https" if tls else "http"
        served = Endpoint(f"{scheme}://localhost:{port}/v1/chat/completions")

        async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            _opened.append(writer)
            served.connections += 1
            try:
                await answering(served, reader, writer)
            finally:
                writer.close()

        _opened.append(await asyncio.start_server(connected, "127.0.0.1", port, ssl=tls))
        return served

    return started


def answering_with(*pieces: bytes, keep: bool = True) -> Answering:
    """Answer every request with ``pieces`` written one after the other, a moment apart; ``keep``: serve the next
    request on the same connection."""

    async def answering(served: Endpoint, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (request := await read_request(reader)) is not None:
            served.requests.append(request)
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.01)
            if not keep:
                return

    return answering


def posted(
    start: Callable[[], Awaitable[Endpoint]],
    times: int = 1,
    headers: dict[str, str] | None = None,
    pause_s: float = 0.0,
):
    """The endpoint after ``times`` POSTs of a small body, ``pause_s`` apart, and their answers."""

    async def run() -> tuple[Endpoint, list[chat_core._http.Answer]]:
        served = await start()
        route = Route("POST", served.url, headers or {"Content-Type": "application/json"})
        answers = []
        for _ in range(times):
            answers.append(await route.send(b'{"messages": []}'))
            await asyncio.sleep(pause_s)
        return served, answers

    return played(run(), _opened)


def length_framed(body: bytes, *extra: str) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\n"
        + "".join(f"{line}\r\n" for line in extra).encode()
        + (f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    )


@pytest.mark.parametrize(
    "pieces",
    [
        pytest.param([length_framed(COMPLETION)], id="content-length"),
        pytest.param([length_framed(COMPLETION)[:30], length_framed(COMPLETION)[30:-9], COMPLETION[-9:]], id="split"),
        pytest.param(
            [
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                b"%x;ext=1\r\n%s\r\n" % (20, COMPLETION[:20]),
                b"%x\r\n%s\r\n" % (len(COMPLETION) - 20, COMPLETION[20:]),
                b"0\r\nX-Trailer: yes\r\n\r\n",
            ],
            id="chunked",
        ),
        pytest.param([b"HTTP/1.1 100 Continue\r\n\r\n", length_framed(COMPLETION)], id="after-100-continue"),
    ],
)
def test_an_answer_framed_any_way_http_allows_is_read_whole_and_its_connection_kept(pieces: list[bytes]) -> None:
    served, answers = posted(endpoint(answering_with(*pieces)), times=2)

    assert [(answer.status, answer.body) for answer in answers] == [(200, COMPLETION)] * 2
    assert served.connections == 1


def test_an_answer_ended_by_closing_the_connection_is_read_whole_and_the_next_request_connects_again() -> None:
    served, answers = posted(endpoint(answering_with(b"HTTP/1.0 200 OK\r\n\r\n" + COMPLETION, keep=False)), times=2)

    assert [answer.body for answer in answers] == [COMPLETION] * 2
    assert served.connections == 2


def test_an_answer_saying_connection_close_isnt_kept() -> None:
    served, answers = posted(endpoint(answering_with(length_framed(COMPLETION, "Connection: close"))), times=2)

    assert [answer.body for answer in answers] == [COMPLETION] * 2
    assert served.connections == 2


@pytest.mark.parametrize("later", [False, True], ids=["with-the-answer", "while-idle"])
def test_bytes_past_an_answer_retire_its_connection(later: bool) -> None:
    stray = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    pieces = (length_framed(COMPLETION), stray) if later else (length_framed(COMPLETION) + stray,)
    served, answers = posted(endpoint(answering_with(*pieces)), times=2, pause_s=0.1)

    assert [answer.body for answer in answers] == [COMPLETION] * 2
    assert served.connections == 2


def test_the_request_carries_its_headers_length_and_body_and_asks_for_no_content_coding() -> None:
    served, answers = posted(
        endpoint(answering_with(length_framed(b"{}", "Retry-After: 3", "retry-after: 4"))),
        headers={"Content-Type": "application/json", "Authorization": "Bearer ep-7"},
    )

    head, body = served.requests[0]
    lines = head.split("\r\n")
    assert lines[0] == "POST /v1/chat/completions HTTP/1.1"
    assert {"Authorization: Bearer ep-7", "Accept-Encoding: identity", f"Content-Length: {len(body)}"} <= set(lines)
    assert f"Host: {served.url.split('/')[2]}" in lines
    assert body == b'{"messages": []}'
    assert answers[0].headers["retry-after"] == "3, 4"


def test_a_kept_connection_the_endpoint_drops_unanswered_is_replaced_and_the_request_sent_again() -> None:
    async def answers_once_per_connection(served: Endpoint, reader: asyncio.StreamReader, writer) -> None:
        served.requests.append(await read_request(reader))
        writer.write(length_framed(COMPLETION))
        await writer.drain()
        served.requests.append(await read_request(reader))

    served, answers = posted(endpoint(answers_once_per_connection), times=2)

    assert [answer.body for answer in answers] == [COMPLETION] * 2
    assert served.connections == 2
    assert len([request for request in served.requests if request is not None]) == 3


def test_a_new_connection_closed_unanswered_is_a_chat_error_not_sent_again() -> None:
    async def hangs_up(served: Endpoint, reader: asyncio.StreamReader, writer) -> None:
        served.requests.append(await read_request(reader))

    with pytest.raises(HttpError, match="closed the connection without answering") as raised:
        posted(endpoint(hangs_up))

    assert not isinstance(raised.value, ConnectionRefused)


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "isn't HTTP/1.1: 'SSH-2.0-OpenSSH_9.6'"),
        (length_framed(COMPLETION)[:-10], "closed the connection midway through its answer"),
        (length_framed(b"\x1f\x8b", "Content-Encoding: gzip"), "content coding 'gzip'"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size that isn't one: b'zz'"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n", "Content-Length 'many'"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70_000, "head longer than 65536 bytes"),
    ],
    ids=["not-http", "cut", "gzip", "bad-chunk", "bad-length", "endless-head"],
)
def test_an_answer_that_cant_be_read_is_a_chat_error_saying_why(answer: bytes, says: str) -> None:
    with pytest.raises(HttpError) as raised:
        posted(endpoint(answering_with(answer, keep=False)))

    assert says in str(raised.value)


def test_a_refused_connection_is_told_apart_from_other_failures() -> None:
    async def refused() -> Endpoint:
        return Endpoint(f"http://127.0.0.1:{free_port()}/v1/chat/completions")

    async def unresolvable() -> Endpoint:
        return Endpoint("http://no-such-host.invalid/v1/chat/completions")

    with pytest.raises(ConnectionRefused, match="refused the connection"):
        posted(refused)
    with pytest.raises(HttpError, match=r"can't connect to no-such-host\.invalid:80") as raised:
        posted(unresolvable)
    assert not isinstance(raised.value, ConnectionRefused)


def test_a_request_cancelled_midway_closes_its_connection() -> None:
    async def answers_second_request_only(served: Endpoint, reader: asyncio.StreamReader, writer) -> None:
        served.requests.append(await read_request(reader))
        if served.connections == 1:
            served.requests.append(await read_request(reader))
            return
        writer.write(length_framed(COMPLETION))
        await writer.drain()
        await read_request(reader)

    async def run() -> tuple[Endpoint, bytes]:
        served = await endpoint(answers_second_request_only)()
        route = Route("POST", served.url, {})
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await route.send(b"{}")
        return served, (await route.send(b"{}")).body

    served, body = played(run(), _opened)

    assert body == COMPLETION
    assert served.connections == 2
    assert served.requests[1] is None


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("ftp://host/v1/chat/completions", "isn't an absolute http(s) URL"),
        ("/v1/chat/completions", "isn't an absolute http(s) URL"),
        ("http://user:key@host/v1/chat/completions", "holds credentials"),
    ],
)
def test_a_chat_url_that_cant_be_sent_to_is_refused_up_front(url: str, says: str) -> None:
    with pytest.raises(ValueError) as raised:
        Route("POST", url, {})
    assert says in str(raised.value)


def test_a_header_with_a_line_break_is_refused_up_front() -> None:
    with pytest.raises(ValueError, match="holds a line break"):
        Route("POST", "http://host/v1/chat/completions", {"Authorization": "Bearer x\r\nX-Injected: 1"})


@pytest.fixture
def tls_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[ssl.SSLContext]:
    """The TLS context of an endpoint the client trusts: ``SSL_CERT_FILE`` names its certificate, a self-signed one
    for ``localhost`` kept beside this file (``openssl req -x509 -days 36500``)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(CERTIFICATE, CERTIFICATE.with_suffix(".key"))
    monkeypatch.setenv("SSL_CERT_FILE", str(CERTIFICATE))
    chat_core._http._tls_context.cache_clear()
    yield context
    chat_core._http._tls_context.cache_clear()


def test_an_https_endpoint_is_spoken_to_over_tls_and_its_connection_kept(tls_server: ssl.SSLContext) -> None:
    served, answers = posted(endpoint(answering_with(length_framed(COMPLETION)), tls=tls_server), times=2)

    assert [answer.body for answer in answers] == [COMPLETION] * 2
    assert served.connections == 1


def test_an_https_endpoint_whose_certificate_isnt_trusted_is_a_chat_error(
    tls_server: ssl.SSLContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SSL_CERT_FILE")
    chat_core._http._tls_context.cache_clear()

    with pytest.raises(HttpError, match="CERTIFICATE_VERIFY_FAILED") as raised:
        posted(endpoint(answering_with(length_framed(COMPLETION)), tls=tls_server))
    assert not isinstance(raised.value, ConnectionRefused)


async def opened_proxy() -> Proxy:
    """A proxy (``test_support.proxy``) closed with the test's loop."""
    proxy = await started_proxy(free_port())
    _opened.append(proxy)
    return proxy


@pytest.fixture
def proxied(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Proxy], None]]:
    """Opt in to the environment's proxy and name ``proxy`` for http and https, with credentials."""

    def named(proxy: Proxy) -> None:
        for name in ("HTTP_PROXY", "HTTPS_PROXY"):
            monkeypatch.setenv(name, f"http://agent:p%40ss@127.0.0.1:{proxy.port}")
        monkeypatch.setenv(chat_core._net.PROXY_FROM_ENV, "1")
        for name in ("http_proxy", "https_proxy", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
            monkeypatch.delenv(name, raising=False)
        chat_core._net.proxy_from_env.cache_clear()
        chat_core._http._environment_proxies.cache_clear()

    yield named
    monkeypatch.undo()
    chat_core._net.proxy_from_env.cache_clear()
    chat_core._http._environment_proxies.cache_clear()


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https-tunnel"])
def test_with_the_proxy_opted_in_requests_go_through_it_with_its_credentials(
    proxied: Callable[[Proxy], None], tls_server: ssl.SSLContext, tls: bool
) -> None:
    async def run() -> tuple[Proxy, Endpoint, list[bytes]]:
        proxy = await opened_proxy()
        proxied(proxy)
        served = await endpoint(answering_with(length_framed(COMPLETION)), tls=tls_server if tls else None)()
        route = Route("POST", served.url, {})
        return proxy, served, [(await route.send(b"{}")).body for _ in range(2)]

    proxy, served, bodies = played(run(), _opened)

    assert bodies == [COMPLETION] * 2
    assert len(proxy.asked) == 1 and served.connections == 1
    first_line = proxy.asked[0].split("\r\n")[0]
    authority = served.url.split("/")[2]
    assert first_line == (f"CONNECT {authority} HTTP/1.1" if tls else f"POST {served.url} HTTP/1.1")
    assert "Proxy-Authorization: Basic YWdlbnQ6cEBzcw==" in proxy.asked[0].split("\r\n")


def test_without_opting_in_or_for_a_host_no_proxy_names_requests_go_direct(
    proxied: Callable[[Proxy], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def run(opt_in: bool) -> tuple[Proxy, Endpoint]:
        proxy = await opened_proxy()
        proxied(proxy)
        if opt_in:
            monkeypatch.setenv("NO_PROXY", "localhost")
            chat_core._http._environment_proxies.cache_clear()
        else:
            monkeypatch.delenv(chat_core._net.PROXY_FROM_ENV)
            chat_core._net.proxy_from_env.cache_clear()
        served = await endpoint(answering_with(length_framed(COMPLETION)))()
        await Route("POST", served.url, {}).send(b"{}")
        return proxy, served

    for opt_in in (False, True):
        proxy, served = played(run(opt_in), _opened)
        assert proxy.asked == [] and served.connections == 1


def test_a_proxy_that_isnt_an_http_url_is_refused_up_front(
    proxied: Callable[[Proxy], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    proxied(Proxy(1))
    monkeypatch.setenv("HTTPS_PROXY", "socks5://127.0.0.1:1080")
    chat_core._http._environment_proxies.cache_clear()

    with pytest.raises(ValueError, match="isn't an http:// URL"):
        Route("POST", "https://api.example.com/v1/chat/completions", {})
