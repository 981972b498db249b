"""What chat_core's connections share: per event loop, the one aiohttp client session every HTTP request of the loop
goes through and the env sessions parked for the loop's next episodes; per process, the TLS context and the proxy.

The loop's client session and its parked sessions are closed when the loop shuts down its async generators
(``asyncio.run`` does). One session per loop keeps each endpoint's connections open between requests: a client per
request or per episode costs a connection, and more CPU than the rest of a model turn.

An env server's WebSocket session outlives the episode it played when the server ended that episode cleanly and
nothing is left unread on it: the session is parked, and the next episode on that server starts on it, since a
reset on an open session starts a new episode. That skips a connect and a close. A parked session still takes one
of the server's sessions, so it is closed once it has been idle for ``IDLE_S``, and when the loop ends.

Connections go direct unless ``CHAT_CORE_PROXY_FROM_ENV=1``: then they take their proxy from ``HTTP_PROXY``,
``HTTPS_PROXY``, ``ALL_PROXY`` and ``NO_PROXY``, read once per process, because looking it up scans the whole
environment, which costs a connection more than the rest of it. Only http:// proxies are taken: an https endpoint
and every env session are tunnelled through them with ``CONNECT``."""

from __future__ import annotations

import asyncio
import base64
import functools
import os
import ssl
import urllib.request
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import unquote, urlsplit

import aiohttp

PROXY_FROM_ENV = "CHAT_CORE_PROXY_FROM_ENV"
IDLE_S = 2.0
"""How long a parked env session waits for the next episode before it is closed."""
KEEPALIVE_S = 4.0
"""How long an idle HTTP connection is kept: less than the 5 s after which uvicorn (SGLang, the env server) closes
one, so a request is seldom written on a connection the endpoint is closing."""
CONNECT_S = 30.0
"""How long opening a connection (TLS and a proxy's tunnel included) may take."""
MAX_HEAD_LINE_BYTES = 8190
"""The longest status or header line of an HTTP answer (aiohttp's ``max_line_size`` and ``max_field_size``)."""
MAX_HEADERS = 128
"""The most header lines of an HTTP answer (aiohttp's ``max_headers``)."""


@functools.cache
def proxy_from_env() -> bool:
    """Whether connections take their proxy from the environment: ``CHAT_CORE_PROXY_FROM_ENV=1``, read once."""
    return os.environ.get(PROXY_FROM_ENV) == "1"


@dataclass(frozen=True)
class Proxy:
    """An http:// proxy: its URL as the environment names it (credentials included), the URL without credentials,
    and the header its credentials go in."""

    url: str
    address: str
    headers: dict[str, str]


def proxy_for(scheme: str, host: str) -> Proxy | None:
    """The proxy connections to ``host`` over ``scheme`` (http, https; ws and wss take http's and https') go
    through: the one the environment names when ``CHAT_CORE_PROXY_FROM_ENV=1`` and ``NO_PROXY`` doesn't leave
    ``host`` out, else None. Raises ValueError when that proxy isn't an http:// URL."""
    if not proxy_from_env():
        return None
    scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
    proxies = _environment_proxies()
    url = proxies.get(scheme) or proxies.get("all")
    if not url or urllib.request.proxy_bypass_environment(host, proxies):
        return None
    url = url if "://" in url else f"http://{url}"
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"the proxy {url!r} for {scheme}:// URLs isn't an http:// URL, the one kind chat_core takes")
    headers = {}
    if parts.username is not None:
        credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        headers["Proxy-Authorization"] = "Basic " + base64.b64encode(credentials).decode()
    address = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    return Proxy(url, address, headers)


@functools.cache
def _environment_proxies() -> dict[str, str]:
    return urllib.request.getproxies_environment()


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The system's trusted certificates (``SSL_CERT_FILE`` names others), loaded once per process, checking each
    server's certificate and host name."""
    return ssl.create_default_context()


class Parkable(Protocol):
    """A connection the loop can keep for later, close, and close at once at the loop's end."""

    async def close(self) -> None: ...

    def close_now(self) -> None: ...


@dataclass
class _LoopNet:
    """An event loop's HTTP client session, its parked env sessions by server URL (each with the timer that closes
    it, most recently parked last) and the closings under way; ``holder`` closes them all when the loop ends."""

    holder: AsyncGenerator[None, None]
    http: aiohttp.ClientSession | None = None
    parked: dict[str, list[tuple[Parkable, asyncio.TimerHandle]]] = field(default_factory=dict)
    closing: set[asyncio.Task[None]] = field(default_factory=set)


_loops: dict[asyncio.AbstractEventLoop, _LoopNet] = {}


async def http_session() -> aiohttp.ClientSession:
    """The running event loop's aiohttp client session: no limit on connections (the episodes in flight bound
    them), idle connections kept ``KEEPALIVE_S``, connects bounded by ``CONNECT_S``, answer heads by
    ``MAX_HEAD_LINE_BYTES`` and ``MAX_HEADERS``, no cookies kept (no endpoint chat_core talks to sets one, and
    keeping them costs every request). Requests and their answers' bodies are bounded by their callers."""
    net = await _net()
    if net.http is None:
        net.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_S),
            max_line_size=MAX_HEAD_LINE_BYTES,
            max_field_size=MAX_HEAD_LINE_BYTES,
            max_headers=MAX_HEADERS,
        )
    return net.http


async def _net() -> _LoopNet:
    loop = asyncio.get_running_loop()
    net = _loops.get(loop)
    if net is None:
        holder = _held_net(loop)
        net = _loops[loop] = _LoopNet(holder)
        await anext(holder)
    return net


async def park(url: str, connection: Parkable) -> None:
    """Keep ``connection``, a session on the env server at ``url`` with no episode open, for the next episode
    there, until it has been idle for ``IDLE_S`` or the loop ends."""
    loop = asyncio.get_running_loop()
    net = await _net()
    timer = loop.call_later(IDLE_S, _expire, net, url, connection)
    net.parked.setdefault(url, []).append((connection, timer))


def unpark(url: str) -> Parkable | None:
    """The session parked last on the server at ``url``, taken out of the park, or None when none is parked."""
    net = _loops.get(asyncio.get_running_loop())
    idle = net.parked.get(url) if net is not None else None
    if not idle:
        return None
    connection, timer = idle.pop()
    timer.cancel()
    return connection


def _expire(net: _LoopNet, url: str, connection: Parkable) -> None:
    idle = net.parked.get(url, [])
    for position, (parked, _) in enumerate(idle):
        if parked is connection:
            del idle[position]
            closing = asyncio.get_running_loop().create_task(connection.close())
            net.closing.add(closing)
            closing.add_done_callback(net.closing.discard)
            return


async def _held_net(loop: asyncio.AbstractEventLoop) -> AsyncGenerator[None, None]:
    """Suspended until the loop's ``shutdown_asyncgens`` closes it, the one hook asyncio gives for work at a loop's
    end, and then closes the loop's connections: each parked session is sent its close frame and closed without
    waiting for the server's (the loop takes no new async generators at this point, which websockets' own close
    would start), the closings under way are finished, then the HTTP client session is closed. The loop registers
    the generator when it first runs it, and ``_loops`` holds it (the loop holds it only weakly) until then."""
    try:
        yield
    finally:
        net = _loops.pop(loop, None)
        if net is not None:
            for idle in net.parked.values():
                for connection, _ in idle:
                    connection.close_now()
            net.parked.clear()
            await asyncio.gather(*net.closing, return_exceptions=True)
            if net.http is not None:
                await net.http.close()
