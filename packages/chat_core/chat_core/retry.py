"""How long chat_core waits before trying again, in one place: a chat request that failed for a moment, a session
refused by a full env server, and a pool's server that failed. Each is a ``Backoff``: waits that double from a first
one up to a cap, each drawn at random between half and all of its value so that clients that failed together don't
come back together.

Which chat failures are worth sending again, and after how long, is ``chat_retry_wait``: model servers under load
answer 429 (rate limited), 502, 503 or 504 (a gateway or an overloaded server: slime's adapter and Miles' session
server answer 503), or refuse the connection for a moment. Those are waited out for at least what a ``Retry-After``
of seconds asks, and never past what is left of the model deadline, so a server that doesn't recover ends the
episode with the flags it would have without retries."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})


@dataclass(frozen=True)
class Backoff:
    """Attempt ``n`` (0 for the first wait) waits a random time between half and all of ``first_s * 2**n``, capped
    at ``max_s``. ``random`` draws the jitter in [0, 1)."""

    first_s: float
    max_s: float
    random: Callable[[], float] = field(default=random.random, compare=False)

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s:
            raise ValueError(f"{self} can't bound a wait: give 0 < first_s <= max_s")

    def wait(self, attempt: int) -> float:
        """The seconds to wait before attempt ``attempt + 1``."""
        return min(self.max_s, self.first_s * 2**attempt) * (0.5 + self.random() / 2)


CHAT_BACKOFF = Backoff(first_s=0.5, max_s=30.0)
"""Chat requests sent again after a transient failure."""


def chat_retry_wait(
    attempt: int, status: int | None, retry_after: str | None, left_s: float, backoff: Backoff = CHAT_BACKOFF
) -> float | None:
    """The seconds to wait before sending again, for attempt ``attempt`` (0 for the first retry), a chat request
    that got HTTP ``status`` (None: the connection was refused before the request was sent) with the ``Retry-After``
    header ``retry_after``, when ``left_s`` seconds of the model deadline are left: the backoff, or the header's
    seconds when longer. None when it isn't worth sending again: the status isn't a transient one, or the wait would
    use up what is left."""
    if status is not None and status not in RETRYABLE_STATUSES:
        return None
    wait = max(backoff.wait(attempt), _seconds(retry_after))
    return wait if wait < left_s else None


def _seconds(retry_after: str | None) -> float:
    """A ``Retry-After`` of seconds as a number; 0 for no header, or for the HTTP-date form, which is rare from
    model servers and not worth a clock comparison."""
    try:
        return float(retry_after or 0)
    except ValueError:
        return 0.0
