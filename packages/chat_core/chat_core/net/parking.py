"""The env sessions an event loop keeps for its next episodes.

An env server's WebSocket session outlives the episode it played when the server ended that episode cleanly and
nothing is left unread on it: the session is parked, and the next episode on that server starts on it, since a
reset on an open session starts a new episode. That skips a connect and a close. A parked session still takes one
of the server's sessions, so it is dropped (its connection closed without the closing handshake, which the server
takes as the client leaving, as it does a closed one) once it has been idle for ``IDLE_S``, and when the loop ends.
Dropping takes no task, so nothing is left running for the loop's shutdown to meet."""

from __future__ import annotations

import asyncio

from chat_core.net.env_socket import EnvSocket
from chat_core.net.loop_end import at_loop_end

IDLE_S = 2.0
"""How long a parked env session waits for the next episode before it is dropped."""


Park = dict[str, list[tuple[EnvSocket, asyncio.TimerHandle]]]
"""A loop's parked sessions by server URL, each with the timer that drops it, most recently parked last."""

_parks: dict[asyncio.AbstractEventLoop, Park] = {}


async def park(url: str, connection: EnvSocket) -> None:
    """Keep ``connection``, a session on the env server at ``url`` with no episode open, for the next episode
    there, until it has been idle for ``IDLE_S`` or the loop ends."""
    loop = asyncio.get_running_loop()
    here = _parks.get(loop)
    if here is None:
        here = _parks[loop] = {}
        await at_loop_end(lambda: _drop_all(loop))
    timer = loop.call_later(IDLE_S, _expire, here, url, connection)
    here.setdefault(url, []).append((connection, timer))


def unpark(url: str) -> EnvSocket | None:
    """The session parked last on the server at ``url``, taken out of the park, or None when none is parked."""
    here = _parks.get(asyncio.get_running_loop())
    idle = here.get(url) if here is not None else None
    if not idle:
        return None
    connection, timer = idle.pop()
    timer.cancel()
    return connection


def _expire(here: Park, url: str, connection: EnvSocket) -> None:
    idle = here.get(url, [])
    for position, (parked, _) in enumerate(idle):
        if parked is connection:
            del idle[position]
            connection.drop()
            return


async def _drop_all(loop: asyncio.AbstractEventLoop) -> None:
    for idle in _parks.pop(loop).values():
        for connection, timer in idle:
            timer.cancel()
            connection.drop()
