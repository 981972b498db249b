"""How chat_core's connections are kept: per event loop, not per episode or per request.

Every HTTP request an event loop makes (to a chat endpoint, or to an env server's Task API) goes through
``chat_core._http``, whose idle connections the loop keeps here by endpoint, and every env session through
``chat_core._websocket``. What the loop keeps is closed when the loop shuts down its async generators
(``asyncio.run`` does). A client per episode cost more CPU than the rest of the episode's requests; one httpx client
shared by many episodes went quadratic in its pool (httpcore's request assignment scans every idle connection per
request), and aiohttp's request path cost twice what a request written in one write and read in the protocol's
callback costs.

An env server's WebSocket session outlives the episode it played when the server ended that episode cleanly: the
connection is parked, and the next episode on that server starts on it, since a reset on an open session starts a
new episode. That skips a connect and a close, which together cost this process more CPU than an episode's other
env calls. A parked connection still takes one of the server's sessions, so it is closed once it has been idle for
``IDLE_S``, and when the loop ends.

Connections go direct unless ``CHAT_CORE_PROXY_FROM_ENV=1``: then they take their proxy from ``HTTP_PROXY``,
``HTTPS_PROXY``, ``ALL_PROXY`` and ``NO_PROXY``, read once per process. Looking the proxy up scans the whole
environment, which cost 30% of a WebSocket connect when aiohttp did it per connection, so it is opt-in."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol

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
    """An event loop's parked WebSocket connections by server URL, each with the timer that closes it, most
    recently parked last, and its idle HTTP connections by endpoint (scheme, host, port); ``holder`` closes them
    all when the loop ends."""

    holder: AsyncGenerator[None, None]
    parked: dict[str, list[tuple[Parkable, asyncio.TimerHandle]]] = field(default_factory=dict)
    idle: dict[tuple[str, str, int], list[Any]] = field(default_factory=dict)
    closing: set[asyncio.Task[None]] = field(default_factory=set)


_loops: dict[asyncio.AbstractEventLoop, _LoopNet] = {}


async def idle_connections(endpoint: tuple[str, str, int]) -> list[Any]:
    """The running event loop's idle HTTP connections to ``endpoint``, most recently used last: the list itself,
    which the caller takes connections from and gives them back to."""
    return (await _net()).idle.setdefault(endpoint, [])


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
    end, and then closes the loop's connections: parked sessions first (each with its closing handshake, so each
    server hears its sessions end), then idle HTTP connections. The loop registers the generator when it first runs
    it, and ``_loops`` holds it (the loop holds it only weakly) until then."""
    try:
        yield
    finally:
        net = _loops.pop(loop, None)
        if net is not None:
            parked = [connection for idle in net.parked.values() for connection, _ in idle]
            net.parked.clear()
            await asyncio.gather(*(each.close() for each in parked), *net.closing, return_exceptions=True)
            for idle in net.idle.values():
                for connection in idle:
                    connection.drop()
