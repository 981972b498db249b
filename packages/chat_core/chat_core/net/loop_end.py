"""Closing what chat_core keeps open for an event loop when the loop ends.

asyncio gives one hook for work at a loop's end: ``shutdown_asyncgens`` (which ``asyncio.run`` calls once the main
coroutine and its tasks are done) closes every async generator the loop has started, running its ``finally``. So
each closing is an async generator suspended at its ``yield`` until then."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable

_waiting: set[AsyncGenerator[None, None]] = set()
"""The generators not closed yet: the loop holds them only weakly."""


async def at_loop_end(close: Callable[[], Awaitable[None]]) -> None:
    """Await ``close()`` when the running event loop shuts down its async generators."""

    async def waiting() -> AsyncGenerator[None, None]:
        try:
            yield
        finally:
            _waiting.discard(generator)
            await close()

    generator = waiting()
    _waiting.add(generator)
    await anext(generator)
