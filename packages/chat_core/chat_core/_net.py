"""How chat_core's connections are set up: once per event loop, not per episode or per connection.

Every Task API request an event loop makes to an env server goes through one aiohttp client (a session with an
unbounded connection pool), every chat request through ``chat_core._http``, whose idle connections the loop keeps
here by endpoint, and every env session through ``chat_core._websocket``. The client and the idle connections are
made by the loop's first request and closed when the loop shuts down its async generators (``asyncio.run`` does).
A client per episode cost more CPU than the rest of the episode's requests; one httpx client shared by many
episodes went quadratic in its pool (httpcore's request assignment scans every idle connection per request).

An env server's WebSocket session outlives the episode it played when the server ended that episode cleanly: the
connection is parked, and the next episode on that server starts on it, since a reset on an open session starts a
new episode. That skips a connect and a close, which together cost this process more CPU than an episode's other
env calls. A parked connection still takes one of the server's sessions, so it is closed once it has been idle for
``IDLE_S``, and when the loop ends.

Connections go direct unless ``CHAT_CORE_PROXY_FROM_ENV=1``: then the client takes its proxy from ``HTTP_PROXY``,
``HTTPS_PROXY``, ``ALL_PROXY`` and ``NO_PROXY`` as aiohttp does by default, and chat requests and env sessions
from the same variables, read once. aiohttp's lookup scans the whole environment on every connection, which was 30%
of a WebSocket connect here, so it is opt-in."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

PROXY_FROM_ENV = "CHAT_CORE_PROXY_FROM_ENV"
IDLE_S = 2.0


@functools.cache
def proxy_from_env() -> bool:
    """Whether connections take their proxy from the environment: ``CHAT_CORE_PROXY_FROM_ENV=1``, read once."""
    return os.environ.get(PROXY_FROM_ENV) == "1"


class Parkable(Protocol):
    """A connection the loop can keep for later and close."""

    async def close(self) -> None: ...


@dataclass
class _LoopNet:
    """An event loop's client, its parked WebSocket connections by server URL, each with the timer that closes it,
    most recently parked last, and its idle chat connections by endpoint (scheme, host, port)."""

    holder: AsyncGenerator[aiohttp.ClientSession, None]
    client: aiohttp.ClientSession
    parked: dict[str, list[tuple[Parkable, asyncio.TimerHandle]]] = field(default_factory=dict)
    idle: dict[tuple[str, str, int], list[Any]] = field(default_factory=dict)
    closing: set[asyncio.Task[None]] = field(default_factory=set)


_loops: dict[asyncio.AbstractEventLoop, _LoopNet] = {}


async def client() -> aiohttp.ClientSession:
    """The running event loop's client, made on its first call. It sets no timeout of its own: the caller bounds
    each request."""
    return (await _net()).client


async def idle_connections(endpoint: tuple[str, str, int]) -> list[Any]:
    """The running event loop's idle chat connections to ``endpoint``, most recently used last: the list itself,
    which the caller takes connections from and gives them back to."""
    return (await _net()).idle.setdefault(endpoint, [])


async def _net() -> _LoopNet:
    loop = asyncio.get_running_loop()
    net = _loops.get(loop)
    if net is None or net.client.closed:
        holder = _held_client(loop)
        net = _loops[loop] = _LoopNet(holder, await anext(holder))
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


async def _held_client(loop: asyncio.AbstractEventLoop) -> AsyncGenerator[aiohttp.ClientSession, None]:
    """The loop's client, held open by this suspended generator until the loop's ``shutdown_asyncgens`` closes it:
    the one hook asyncio gives for work at a loop's end. The loop registers the generator when it first runs it,
    and ``_loops`` holds it (the loop holds it only weakly) until then. Parked sessions are closed first, so each
    server hears its sessions end."""
    client = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(),
        trust_env=proxy_from_env(),
    )
    try:
        yield client
    finally:
        net = _loops.pop(loop, None)
        if net is not None:
            parked = [connection for idle in net.parked.values() for connection, _ in idle]
            net.parked.clear()
            await asyncio.gather(*(each.close() for each in parked), *net.closing, return_exceptions=True)
            for idle in net.idle.values():
                for connection in idle:
                    connection.drop()
        await client.close()
