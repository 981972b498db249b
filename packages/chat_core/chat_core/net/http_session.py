"""The one aiohttp client session of each event loop, which every HTTP request of the loop goes through, closed when
the loop ends. One session per loop keeps each endpoint's connections open between requests: a client per request
or per episode costs a connection, and more CPU than the rest of a model turn."""

from __future__ import annotations

import asyncio

import aiohttp

from chat_core.net.loop_end import at_loop_end
from chat_core.net.settings import proxy_from_env

KEEPALIVE_S = 4.0
"""How long an idle HTTP connection is kept: less than the 5 s after which uvicorn (SGLang, the env server) closes
one, so a request is seldom written on a connection the endpoint is closing."""
CONNECT_S = 30.0
"""How long opening a connection (TLS and a proxy's tunnel included) may take."""
MAX_HEAD_LINE_BYTES = 8190
"""The longest status or header line of an HTTP answer (aiohttp's ``max_line_size`` and ``max_field_size``)."""
MAX_HEADERS = 128
"""The most header lines of an HTTP answer (aiohttp's ``max_headers``)."""

_sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}


async def http_session() -> aiohttp.ClientSession:
    """The running event loop's aiohttp client session: no limit on connections (the episodes in flight bound
    them), idle connections kept ``KEEPALIVE_S``, connects bounded by ``CONNECT_S``, answer heads by
    ``MAX_HEAD_LINE_BYTES`` and ``MAX_HEADERS``, no cookies kept (no endpoint chat_core talks to sets one, and
    keeping them costs every request), and the environment's proxy taken by aiohttp (``trust_env``) only when
    ``CHAT_CORE_PROXY_FROM_ENV=1`` (``chat_core.net.settings``). Requests and their answers' bodies are bounded by
    their callers."""
    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None:
        session = _sessions[loop] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_S),
            max_line_size=MAX_HEAD_LINE_BYTES,
            max_field_size=MAX_HEAD_LINE_BYTES,
            max_headers=MAX_HEADERS,
            trust_env=proxy_from_env(),
        )

        async def close() -> None:
            await _sessions.pop(loop).close()

        await at_loop_end(close)
    return session
