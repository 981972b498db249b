"""chat_core's HTTP/1.1 client, for chat requests and the env server's Task API (over connections the event loop
keeps open between requests), and the connections the env sessions' WebSocket client (``chat_core._websocket``)
opens.

A model turn is one chat request, so what the HTTP client costs per request is most of the loop's own cost per
turn.
aiohttp's request path cost 0.34-0.45 ms of CPU per request here, against 0.14-0.19 ms for writing the request in
one write and reading the answer in the protocol's callback, which is what this client does: the request's head is
encoded once per endpoint, and an answer is read as it arrives, without a task, a stream or a timer per request.

It speaks what chat endpoints answer with (SGLang, vLLM, slime's adapter, Miles' session server, hosted APIs over
TLS): answers framed by ``Content-Length``, chunked, or ended by closing the connection; ``Connection: close``;
informational answers before the real one. It asks for no content coding and refuses an answer that uses one. The
caller bounds each request's time; a request cancelled midway closes its connection, whose answer is then unknown.

The proxy follows ``chat_core._net.proxy_from_env``: when a user opts in, ``HTTP_PROXY``, ``HTTPS_PROXY``,
``ALL_PROXY`` and ``NO_PROXY`` are read once, and an https endpoint is reached through a ``CONNECT`` tunnel."""

from __future__ import annotations

import asyncio
import base64
import functools
import ssl
import threading
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import SplitResult, unquote, urlsplit

from chat_core._net import idle_connections, proxy_from_env
from chat_core._wire import described

_MAX_HEAD_BYTES = 64 * 1024
C = TypeVar("C", bound="Connection")
_ASKED = {"Accept": "application/json", "Accept-Encoding": "identity", "User-Agent": "chat_core"}


class HttpError(Exception):
    """A request that got no whole HTTP answer: no connection, a connection lost midway, or an answer that isn't
    HTTP/1.1."""


class ConnectionRefused(HttpError):
    """The endpoint refused (or reset) the connection before the request was sent: worth sending again, since a
    server that is starting or restarting does this for a moment."""


@dataclass(frozen=True)
class Answer:
    """An endpoint's answer: its status, its headers by lower-case name, and its body."""

    status: int
    headers: dict[str, str]
    body: bytes


class Route:
    """Requests of ``method`` to ``url`` with ``headers``, their head encoded once. Raises ValueError when ``url``
    isn't an absolute http(s) URL without credentials, a header holds a line break, or the proxy the environment
    names for it (when ``CHAT_CORE_PROXY_FROM_ENV=1``) isn't an http:// URL."""

    def __init__(self, method: str, url: str, headers: Mapping[str, str]):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the URL {url!r} isn't an absolute http(s) URL")
        if "@" in parts.netloc:
            raise ValueError(f"the URL {url!r} holds credentials; send them in a header instead")
        self.url = url
        self._origin, self._proxy = origin_and_proxy(parts)
        authority = parts.netloc
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        sent = {**_ASKED, **headers}
        if self._proxy is not None and parts.scheme == "http":
            target = parts._replace(fragment="").geturl()
            sent.update(self._proxy.authorization)
        lines = [f"{method} {target} HTTP/1.1", f"Host: {authority}"]
        lines += [f"{name}: {value}" for name, value in sent.items() if name.lower() not in ("host", "content-length")]
        if any("\r" in line or "\n" in line for line in lines):
            raise ValueError(f"a header for {url} holds a line break")
        self._head = ("\r\n".join(lines) + "\r\nContent-Length: ").encode("latin-1")

    async def send(self, body: bytes) -> Answer:
        """The endpoint's answer to a request carrying ``body`` (empty for none). Raises ConnectionRefused when
        the endpoint refused the connection, and HttpError when the request got no whole answer otherwise. A kept
        connection that the endpoint closed just as the request went out is replaced by a new one, and the request
        sent once more."""
        request = b"".join((self._head, str(len(body)).encode(), b"\r\n\r\n", body))
        idle = await idle_connections(self._origin)
        while idle:
            connection = idle.pop()
            if connection.open:
                try:
                    return await self._exchanged(connection, request, idle)
                except _Stale:
                    break
        return await self._exchanged(await self._connect(), request, idle)

    async def _exchanged(self, connection: Connection, request: bytes, idle: list[Connection]) -> Answer:
        answer = await connection.exchange(request)
        if connection.open:
            idle.append(connection)
        return answer

    async def _connect(self) -> Connection:
        return await connect(Connection, self._origin, self._proxy)


def origin_and_proxy(parts: SplitResult) -> tuple[tuple[str, str, int], Proxy | None]:
    """The origin (scheme, host, port) of the http(s) or ws(s) URL split as ``parts``, and the proxy connections to
    it go through: the one the environment names for its host when ``CHAT_CORE_PROXY_FROM_ENV=1`` (a ws or wss URL
    takes http's or https'), else None."""
    secure = parts.scheme in ("https", "wss")
    origin = (parts.scheme, parts.hostname, parts.port or (443 if secure else 80))
    proxy = _proxy_of("https" if secure else "http", parts.hostname) if proxy_from_env() else None
    return origin, proxy


async def connect(
    make: Callable[[], C], origin: tuple[str, str, int], proxy: Proxy | None, *, tunnel: bool = False
) -> C:
    """A new connection (``make``'s protocol) to ``origin`` (scheme, host, port; https and wss over TLS), through
    ``proxy`` when one is named: a tunnel through it (``CONNECT``) for a TLS origin or when ``tunnel`` asks, else a
    connection to the proxy itself. Raises ConnectionRefused when the connection was refused, HttpError when it
    can't be made otherwise."""
    scheme, host, port = origin
    secure = scheme in ("https", "wss")
    where = proxy.address if proxy is not None else (host, port)
    tls = _tls_context() if secure and proxy is None else None
    try:
        _, connection = await asyncio.get_running_loop().create_connection(
            make, *where, ssl=tls, server_hostname=host if tls else None
        )
    except ConnectionError as e:
        raise ConnectionRefused(f"{where[0]}:{where[1]} refused the connection ({e})") from None
    except OSError as e:
        raise HttpError(f"can't connect to {where[0]}:{where[1]} ({described(e)})") from None
    if proxy is not None and (secure or tunnel):
        await _tunnel(connection, host, port, proxy, secure)
    return connection


async def _tunnel(connection: Connection, host: str, port: int, proxy: Proxy, secure: bool) -> None:
    """Ask ``proxy`` on ``connection`` for a tunnel to ``host:port``, and start TLS through it when ``secure``."""
    authority = f"{host}:{port}"
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
    lines += [f"{name}: {value}" for name, value in proxy.authorization.items()]
    try:
        answer = await connection.exchange(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"), head_only=True)
        if answer.status != 200:
            raise HttpError(f"the proxy {proxy.url} answered CONNECT {authority} with HTTP {answer.status}")
        if secure:
            connection.transport = await asyncio.get_running_loop().start_tls(
                connection.transport, connection, _tls_context(), server_hostname=host
            )
    except BaseException:
        connection.drop()
        raise


class _Stale(HttpError):
    """The connection closed before any of the answer came: on a kept connection, the endpoint dropped it while it
    was idle."""


@dataclass(frozen=True)
class _Head:
    """An answer's status line and headers, and how its body is framed: ``length`` bytes, chunked, or until the
    connection closes (neither)."""

    status: int
    headers: dict[str, str]
    length: int | None
    chunked: bool
    keep_alive: bool


class Connection(asyncio.BufferedProtocol):
    """One connection to an endpoint (or its proxy), carrying one request at a time. The answer is read in
    ``received`` as its bytes arrive, and hands the waiting request its ``Answer`` once whole. A subclass takes
    the connection over once an answer of only a head (``head_only``) has come, by overriding ``answered`` and
    ``received``.

    The transport reads into the thread's receive buffer (``get_buffer``), whose bytes ``received`` consumes before
    the next read: reading into a new bytes object of the transport's 256 KiB each time costs an ``mmap``, an
    ``mremap`` and a ``munmap`` per read."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.open = True
        self._buffer = bytearray()
        self._into = _per_thread.receive_buffer
        self._waiter: asyncio.Future[Answer] | None = None
        self._head: _Head | None = None
        self._head_only = False

    async def exchange(self, request: bytes, *, head_only: bool = False) -> Answer:
        """The answer to ``request``, written on this connection. Raises _Stale when the connection closed before
        any answer came, and HttpError when the answer was cut or isn't HTTP/1.1; closes the connection when
        the answer doesn't come whole, the wait for it cancelled included."""
        self._waiter = asyncio.get_running_loop().create_future()
        self._head_only = head_only
        self.transport.write(request)
        try:
            return await self._waiter
        except BaseException:
            self.drop()
            raise
        finally:
            self._waiter = None

    def drop(self) -> None:
        """Close the connection now, whatever it was doing."""
        self.open = False
        if self.transport is not None:
            self.transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._into

    def buffer_updated(self, nbytes: int) -> None:
        self.received(self._into[:nbytes])

    def received(self, data: memoryview) -> None:
        """Take the bytes just read, which are the receive buffer's until this returns."""
        self._buffer += data
        if self._waiter is None or self._waiter.done():
            self.drop()
            return
        try:
            self._read(ended=False)
        except HttpError as e:
            self._fail(e)

    def eof_received(self) -> bool:
        self.open = False
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        if self._waiter is None or self._waiter.done():
            return
        try:
            self._read(ended=True)
        except HttpError as e:
            self._fail(e)
            return
        if not self._waiter.done():
            why = f": {described(exc)}" if exc is not None else ""
            if self._head is None and not self._buffer:
                self._fail(_Stale(f"the endpoint closed the connection without answering{why}"))
            else:
                self._fail(HttpError(f"the endpoint closed the connection midway through its answer{why}"))

    def _fail(self, error: HttpError) -> None:
        self.drop()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(error)

    def _read(self, *, ended: bool) -> None:
        """Hand the waiter the answer if the buffer holds it whole (``ended``: the connection has closed)."""
        buffer = self._buffer
        while self._head is None:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > _MAX_HEAD_BYTES:
                    raise HttpError(f"answered with a head longer than {_MAX_HEAD_BYTES} bytes")
                return
            head = _head_of(bytes(buffer[:end]))
            del buffer[: end + 4]
            if not 100 <= head.status < 200 or head.status == 101:
                self._head = head
        head = self._head
        if self._head_only or head.status in (204, 304):
            body = b""
        elif head.length is not None:
            if len(buffer) < head.length:
                return
            body = bytes(buffer[: head.length])
            del buffer[: head.length]
        elif head.chunked:
            dechunked = _dechunked(buffer)
            if dechunked is None:
                return
            body, used = dechunked
            del buffer[:used]
        elif ended:
            body = bytes(buffer)
            buffer.clear()
        else:
            return
        self._head = None
        if not self._head_only and (not head.keep_alive or buffer):
            self.drop()
        self.answered(Answer(head.status, head.headers, body))

    def answered(self, answer: Answer) -> None:
        """Hand ``answer`` to the request waiting for it."""
        self._waiter.set_result(answer)


_RECEIVE_BYTES = 256 * 1024


class _PerThread(threading.local):
    """Each thread's receive buffer: its event loop reads one connection at a time and consumes what it read before
    reading the next."""

    def __init__(self) -> None:
        self.receive_buffer = memoryview(bytearray(_RECEIVE_BYTES))


_per_thread = _PerThread()


def _head_of(raw: bytes) -> _Head:
    """An answer's head; raises HttpError when it isn't an HTTP/1.x head."""
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if version not in ("HTTP/1.1", "HTTP/1.0") or not code.isdigit():
        raise HttpError(f"answered with something that isn't HTTP/1.1: {lines[0][:200]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon:
            raise HttpError(f"answered with a header line that isn't one: {line[:200]!r}")
        name, value = name.strip().lower(), value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    coding = headers.get("content-encoding", "identity").lower()
    if coding != "identity":
        raise HttpError(f"answered with content coding {coding!r}, which chat_core asks not to get")
    chunked = "chunked" in headers.get("transfer-encoding", "").lower()
    length = None
    if not chunked and "content-length" in headers:
        try:
            length = int(headers["content-length"])
        except ValueError:
            raise HttpError(f"answered with Content-Length {headers['content-length']!r}") from None
    tokens = {token.strip() for token in headers.get("connection", "").lower().split(",")}
    keep_alive = "keep-alive" in tokens if version == "HTTP/1.0" else "close" not in tokens
    return _Head(int(code), headers, length, chunked, keep_alive)


def _dechunked(buffer: bytearray) -> tuple[bytes, int] | None:
    """A chunked body at the start of ``buffer`` and the bytes it took, or None while it isn't all there. Raises
    HttpError when a chunk's size line isn't one."""
    parts: list[bytes] = []
    position = 0
    while True:
        line_end = buffer.find(b"\r\n", position)
        if line_end < 0:
            return None
        size_text = bytes(buffer[position:line_end]).split(b";")[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise HttpError(f"answered with a chunk size that isn't one: {size_text[:40]!r}") from None
        if size == 0:
            trailers_end = buffer.find(b"\r\n\r\n", line_end)
            return None if trailers_end < 0 else (b"".join(parts), trailers_end + 4)
        start = line_end + 2
        if len(buffer) < start + size + 2:
            return None
        parts.append(bytes(buffer[start : start + size]))
        position = start + size + 2


@dataclass(frozen=True)
class Proxy:
    """An http:// proxy: its URL, where it listens, and the header its credentials go in."""

    url: str
    address: tuple[str, int]
    authorization: dict[str, str]


def _proxy_of(scheme: str, host: str) -> Proxy | None:
    """The proxy the environment names for ``scheme`` URLs on ``host``; None when it names none or ``NO_PROXY``
    leaves ``host`` out."""
    proxies = _environment_proxies()
    url = proxies.get(scheme) or proxies.get("all")
    if not url or urllib.request.proxy_bypass_environment(host, proxies):
        return None
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"the proxy {url!r} for {scheme}:// URLs isn't an http:// URL, the one kind chat_core takes")
    authorization = {}
    if parts.username is not None:
        credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        authorization["Proxy-Authorization"] = "Basic " + base64.b64encode(credentials).decode()
    return Proxy(url, (parts.hostname, parts.port or 80), authorization)


@functools.cache
def _environment_proxies() -> dict[str, str]:
    return urllib.request.getproxies_environment()


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """The system's trusted certificates (``SSL_CERT_FILE`` names others), loaded once per process."""
    return ssl.create_default_context()
