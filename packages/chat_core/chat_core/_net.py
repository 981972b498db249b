"""How chat_core's connections are set up: once per process, not per episode or per connection.

Every episode of an event loop shares one chat client (an aiohttp session with an unbounded connection pool), made
by the loop's first chat request and closed when the loop shuts down its async generators (``asyncio.run`` does).
A client per episode cost more CPU than the rest of the episode's requests; one httpx client shared by many
episodes went quadratic in its pool (httpcore's request assignment scans every idle connection per request).

Connections go direct unless ``CHAT_CORE_PROXY_FROM_ENV=1``: then the chat client, the WebSocket sessions and the
Task API take their proxy from ``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY`` and ``NO_PROXY`` as their libraries do
by default. Looking the proxy up scans the whole environment on every connection, which was 30% of a WebSocket
connect here, so it is opt-in."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncGenerator

import aiohttp

PROXY_FROM_ENV = "CHAT_CORE_PROXY_FROM_ENV"

_Held = tuple[AsyncGenerator[aiohttp.ClientSession, None], aiohttp.ClientSession]
_chat_clients: dict[asyncio.AbstractEventLoop, _Held] = {}


@functools.cache
def proxy_from_env() -> bool:
    """Whether connections take their proxy from the environment: ``CHAT_CORE_PROXY_FROM_ENV=1``, read once."""
    return os.environ.get(PROXY_FROM_ENV) == "1"


async def chat_client() -> aiohttp.ClientSession:
    """The running event loop's chat client, made on its first call. It sets no timeout of its own: the caller
    bounds each request."""
    loop = asyncio.get_running_loop()
    held = _chat_clients.get(loop)
    if held is None or held[1].closed:
        holder = _held_client(loop)
        held = _chat_clients[loop] = (holder, await anext(holder))
    return held[1]


async def _held_client(loop: asyncio.AbstractEventLoop) -> AsyncGenerator[aiohttp.ClientSession, None]:
    """The loop's chat client, held open by this suspended generator until the loop's ``shutdown_asyncgens``
    closes it: the one hook asyncio gives for work at a loop's end. The loop registers the generator when it first
    runs it, and ``_chat_clients`` holds it (the loop holds it only weakly) until then."""
    client = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(),
        trust_env=proxy_from_env(),
    )
    try:
        yield client
    finally:
        _chat_clients.pop(loop, None)
        await client.close()
