"""Small helpers the tests share for loopback ports and for waiting on something that happens in another process."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable


def free_port() -> int:
    """A loopback port nothing listens on at the moment of asking."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Wait for ``condition``; a guard against a hang, not a check of how long it took. Raises AssertionError naming
    ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never saw {what}")
        await asyncio.sleep(0.05)
