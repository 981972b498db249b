"""chat_core's one retry policy: the backoff every wait shares (chat retries, a full env server, a pool's failing
server), and which chat failures are waited out, for how long, and when waiting isn't worth it any more."""

from __future__ import annotations

import pytest
from chat_core.retry import Backoff, chat_retry_wait

LOW, HIGH = Backoff(0.5, 30.0, random=lambda: 0.0), Backoff(0.5, 30.0, random=lambda: 0.999)


def test_waits_double_with_jitter_between_half_and_all_of_the_backoff() -> None:
    assert [LOW.wait(attempt) for attempt in range(4)] == [0.25, 0.5, 1.0, 2.0]
    assert [round(HIGH.wait(attempt), 2) for attempt in range(4)] == [0.5, 1.0, 2.0, 4.0]


def test_the_backoff_is_capped() -> None:
    assert HIGH.wait(20) == pytest.approx(30, rel=0.01)


def test_a_backoff_that_cant_bound_a_wait_is_refused() -> None:
    with pytest.raises(ValueError, match="first_s <= max_s"):
        Backoff(2.0, 1.0)


@pytest.mark.parametrize("status", [429, 502, 503, 504, None])
def test_transient_chat_failures_are_waited_out_as_the_backoff_says(status: int | None) -> None:
    assert [chat_retry_wait(attempt, status, None, 100, LOW) for attempt in range(3)] == [0.25, 0.5, 1.0]


@pytest.mark.parametrize("status", [400, 401, 403, 404, 500, 501])
def test_other_chat_failures_are_not_retried(status: int) -> None:
    assert chat_retry_wait(0, status, None, 100, LOW) is None


def test_retry_after_in_seconds_is_waited_for_at_least() -> None:
    assert chat_retry_wait(0, 429, "7", 100, LOW) == 7.0
    assert chat_retry_wait(0, 503, "0.1", 100, LOW) == 0.25
    assert chat_retry_wait(0, 503, "Wed, 21 Oct 2015 07:28:00 GMT", 100, LOW) == 0.25


def test_a_wait_that_would_use_up_the_deadline_is_not_taken() -> None:
    assert chat_retry_wait(0, 429, "7", 7, LOW) is None
    assert chat_retry_wait(3, None, None, 1.5, LOW) is None
    assert chat_retry_wait(3, None, None, 2.5, LOW) == 2.0
