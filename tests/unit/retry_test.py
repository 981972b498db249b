"""The retry policy the episode loop and evaluate's pre-flight share: which failures are waited out, for how long,
and when waiting isn't worth it any more."""

from __future__ import annotations

import pytest
from chat_core.retry import RetryPolicy

LOW, HIGH = RetryPolicy(random=lambda: 0.0), RetryPolicy(random=lambda: 0.999)


@pytest.mark.parametrize("status", [429, 502, 503, 504, None])
def test_transient_failures_back_off_exponentially_with_jitter(status: int | None) -> None:
    assert [LOW.delay(attempt, status, None, 100) for attempt in range(4)] == [0.25, 0.5, 1.0, 2.0]
    assert [round(HIGH.delay(attempt, status, None, 100), 2) for attempt in range(4)] == [0.5, 1.0, 2.0, 4.0]


def test_the_backoff_is_capped() -> None:
    assert HIGH.delay(20, 503, None, 1000) == pytest.approx(30, rel=0.01)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 500, 501])
def test_other_failures_are_not_retried(status: int) -> None:
    assert LOW.delay(0, status, None, 100) is None


def test_retry_after_in_seconds_is_waited_for_at_least() -> None:
    assert LOW.delay(0, 429, "7", 100) == 7.0
    assert LOW.delay(0, 503, "0.1", 100) == 0.25
    assert LOW.delay(0, 503, "Wed, 21 Oct 2015 07:28:00 GMT", 100) == 0.25


def test_a_wait_that_would_use_up_the_deadline_is_not_taken() -> None:
    assert LOW.delay(0, 429, "7", 7) is None
    assert LOW.delay(3, None, None, 1.5) is None
    assert LOW.delay(3, None, None, 2.5) == 2.0
