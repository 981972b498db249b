"""What the client tests' raw servers run in: an event loop of its own per test, bounded in time, whose servers and
connections are all closed before it ends, and which fails the test when the client raised in one of the loop's
callbacks, where the loop would only log it (``played``); and the check that a test left nothing for the garbage
collector to find unclosed (``nothing_left_unclosed``, a fixture of ``pytest_plugin``)."""

from __future__ import annotations

import asyncio
import gc
import traceback
import warnings
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar

T = TypeVar("T")
BOUND_S = 10.0
"""How long a test's loop may run: a client that waits forever fails the test instead of hanging it."""


class Closable(Protocol):
    async def close(self) -> None: ...


Opened = asyncio.Server | asyncio.StreamWriter | Closable


def played(work: Awaitable[T], opened: list[Opened]) -> T:
    """What ``work`` gives, run in an event loop of its own within ``BOUND_S``; everything in ``opened`` (servers,
    their connections' writers, and anything with an async ``close``, such as a proxy) is closed before the loop
    ends, however ``work`` ended. Raises AssertionError when chat_core raised in a callback of the loop (the test
    servers' own errors, such as a connection the client reset, are theirs to show)."""
    raised: list[str] = []

    def noted(loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
        error = context.get("exception")
        if isinstance(error, BaseException):
            frames = traceback.extract_tb(error.__traceback__)
            if any("/chat_core/" in frame.filename for frame in frames):
                raised.append("".join(traceback.format_exception(error)))
        loop.default_exception_handler(context)

    async def bounded() -> T:
        asyncio.get_running_loop().set_exception_handler(noted)
        try:
            async with asyncio.timeout(BOUND_S):
                return await work
        finally:
            while opened:
                each = opened.pop()
                if isinstance(each, asyncio.Server | asyncio.StreamWriter):
                    each.close()
                    if isinstance(each, asyncio.Server):
                        await each.wait_closed()
                else:
                    await each.close()

    value = asyncio.run(bounded())
    assert raised == [], f"chat_core raised in the event loop's callbacks:\n{raised[0]}"
    return value


@contextmanager
def nothing_left_unclosed() -> Iterator[None]:
    """Fail when a socket or transport made inside the block is found unclosed by the garbage collector."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always", ResourceWarning)
        yield
        gc.collect()
    assert [str(each.message) for each in warned if issubclass(each.category, ResourceWarning)] == []
