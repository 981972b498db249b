"""When a chat request that failed is worth sending again, and after how long: the policy the episode loop and
``evaluate``'s pre-flight share, apart from any HTTP client.

Model servers under load answer 429 (rate limited), 502, 503 or 504 (a gateway or an overloaded server: slime's
adapter and Miles' session server answer 503) or refuse the connection for a moment; those are retried with
jittered exponential backoff, waiting at least what a ``Retry-After`` of seconds asks, and never past what is left
of the model deadline, so a server that doesn't recover ends the episode with the flags it would have without
retries."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """Attempt ``n`` (0 for the first retry) waits a random time between half and all of ``base_s * 2**n``, capped
    at ``max_s``, or the ``Retry-After`` seconds when they are longer. ``random`` draws the jitter in [0, 1)."""

    base_s: float = 0.5
    max_s: float = 30.0
    random: Callable[[], float] = field(default=random.random, compare=False)

    def delay(self, attempt: int, status: int | None, retry_after: str | None, left_s: float) -> float | None:
        """The seconds to wait before sending again a request that got HTTP ``status`` (None: the connection was
        refused) with the ``Retry-After`` header ``retry_after``, when ``left_s`` seconds of the deadline are left;
        None when it isn't worth sending again: the status isn't a transient one, or the wait would use up what is
        left."""
        if status is not None and status not in RETRYABLE_STATUSES:
            return None
        backoff = min(self.max_s, self.base_s * 2**attempt) * (0.5 + self.random() / 2)
        wait = max(backoff, _seconds(retry_after))
        return wait if wait < left_s else None


def _seconds(retry_after: str | None) -> float:
    """A ``Retry-After`` of seconds as a number; 0 for no header, or for the HTTP-date form, which is rare from
    model servers and not worth a clock comparison."""
    try:
        seconds = float(retry_after or 0)
    except ValueError:
        return 0.0
    return seconds if seconds >= 0 else 0.0
