"""What the client tests' raw servers run in: an event loop of its own per test, bounded in time, whose servers and
connections are all closed before it ends (``played``), and the check that a test left nothing for the garbage
collector to find unclosed (``nothing_left_unclosed``, a fixture of ``pytest_plugin``)."""

from __future__ import annotations

import asyncio
import gc
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
    ends, however ``work`` ended."""

    async def bounded() -> T:
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

    return asyncio.run(bounded())


@contextmanager
def nothing_left_unclosed() -> Iterator[None]:
    """Fail when a socket or transport made inside the block is found unclosed by the garbage collector."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always", ResourceWarning)
        yield
        gc.collect()
    assert [str(each.message) for each in warned if issubclass(each.category, ResourceWarning)] == []
