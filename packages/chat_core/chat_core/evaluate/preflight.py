"""``evaluate``'s pre-flight: one tiny chat completion, so a wrong URL, model name or key stops the run before any
episode."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from chat_core._wire import FLAG_EXCERPT, encoded, wire_text
from chat_core.episode.chat import ChatEndpoint, post
from chat_core.evaluate.errors import EvaluateError
from chat_core.limits import Limits
from chat_core.net.http_request import HttpError

_PREFLIGHT_S = 60.0


async def preflight(chat: ChatEndpoint, sampling: Mapping[str, Any]) -> None:
    """Send one tiny chat completion to ``chat``, so a wrong URL, model name or key stops the run before any
    episode: the run's own body with one short message, its token limit (``max_completion_tokens`` where the
    sampling names it, as newer hosted models take it, else ``max_tokens``) set to 1. Transient failures are retried
    as the episode loop retries them (``chat_core.episode.chat.post``) for up to a minute. Raises EvaluateError with the
    server's message, on one line, when the endpoint can't be reached or answers with an error."""
    limit = "max_completion_tokens" if "max_completion_tokens" in sampling else "max_tokens"
    body = {**sampling, "model": chat.model, "messages": [{"role": "user", "content": "Say OK."}], limit: 1}
    try:
        headers = chat.request_headers()
    except ValueError as e:
        raise EvaluateError(str(e)) from None
    try:
        async with asyncio.timeout(_PREFLIGHT_S):
            answer = await post(
                chat,
                headers,
                encoded(body),
                deadline=time.monotonic() + _PREFLIGHT_S,
                max_answer_bytes=Limits.max_chat_answer_bytes,
            )
    except TimeoutError:
        raise EvaluateError(
            f"the model endpoint {chat.url} didn't answer the pre-flight request within {_PREFLIGHT_S:g} s"
        ) from None
    except HttpError as e:
        raise EvaluateError(f"the model endpoint {chat.url} can't be reached: {e}") from None
    if answer.status >= 400:
        raise EvaluateError(
            f"the model endpoint {chat.url} answered the pre-flight request for model {chat.model!r} with "
            f"HTTP {answer.status}: {' '.join(wire_text(answer.body).split())[:FLAG_EXCERPT]}"
        )
