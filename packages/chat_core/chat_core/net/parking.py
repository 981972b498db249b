"""The env sessions an event loop keeps for its next episodes.

An env server's WebSocket session outlives the episode it played when the server ended that episode cleanly and
nothing is left unread on it: the session is parked, and the next episode on that server starts on it, since a
reset on an open session starts a new episode. That skips a connect and a close. A parked session still takes one
of the server's sessions, so it is closed once it has been idle for ``IDLE_S``, and when the loop ends."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from chat_core.net.loop_end import at_loop_end

IDLE_S = 2.0
"""How long a parked env session waits for the next episode before it is closed."""


class Parkable(Protocol):
    """A connection the loop can keep for later, close, and close at once at the loop's end."""

    async def close(self) -> None: ...

    def close_now(self) -> None: ...


@dataclass
class _Park:
    """An event loop's parked sessions by server URL, each with the timer that closes it, most recently parked
    last, and the closings under way."""

    parked: dict[str, list[tuple[Parkable, asyncio.TimerHandle]]] = field(default_factory=dict)
    closing: set[asyncio.Task[None]] = field(default_factory=set)


_parks: dict[asyncio.AbstractEventLoop, _Park] = {}


async def park(url: str, connection: Parkable) -> None:
    """Keep ``connection``, a session on the env server at ``url`` with no episode open, for the next episode
    there, until it has been idle for ``IDLE_S`` or the loop ends."""
    loop = asyncio.get_running_loop()
    here = _parks.get(loop)
    if here is None:
        here = _parks[loop] = _Park()
        await at_loop_end(lambda: _close_all(loop))
    timer = loop.call_later(IDLE_S, _expire, here, url, connection)
    here.parked.setdefault(url, []).append((connection, timer))


def unpark(url: str) -> Parkable | None:
    """The session parked last on the server at ``url``, taken out of the park, or None when none is parked."""
    here = _parks.get(asyncio.get_running_loop())
    idle = here.parked.get(url) if here is not None else None
    if not idle:
        return None
    connection, timer = idle.pop()
    timer.cancel()
    return connection


def _expire(here: _Park, url: str, connection: Parkable) -> None:
    idle = here.parked.get(url, [])
    for position, (parked, _) in enumerate(idle):
        if parked is connection:
            del idle[position]
            closing = asyncio.get_running_loop().create_task(connection.close())
            here.closing.add(closing)
            closing.add_done_callback(here.closing.discard)
            return


async def _close_all(loop: asyncio.AbstractEventLoop) -> None:
    """Close the loop's parked sessions as the loop ends: each is sent its close frame and closed without waiting
    for the server's (the loop takes no new async generators at this point, which websockets' own close would
    start), then the closings under way are finished."""
    here = _parks.pop(loop)
    for idle in here.parked.values():
        for connection, timer in idle:
            timer.cancel()
            connection.close_now()
    await asyncio.gather(*here.closing, return_exceptions=True)
