"""The chat side of an episode: where the model answers (``ChatEndpoint``, over HTTP or by a handler in the same
process), a chat request sent as chat_core's retry policy says (``post``, which the episode loop and ``evaluate``'s
pre-flight share), a chat completion read as the reply the loop plays (``reply_of``), and a refusal of a prompt too
long for the model's context told from other errors (``context_refusal``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from chat_core._wire import FLAG_EXCERPT, excerpt, parse_json, wire_text
from chat_core.net.http_request import Answer, AnswerTooLong, ConnectionRefused, check_url, request
from chat_core.retry import chat_retry_wait

logger = logging.getLogger(__name__)

ChatHandler = Callable[[bytes, Mapping[str, str]], Awaitable[Answer]]
"""A chat endpoint served in the rollout's own process: given a request's JSON body and headers, the answer the
endpoint would send over HTTP."""


@dataclass(frozen=True)
class ChatEndpoint:
    """Where the model answers: ``url`` is a full ``.../v1/chat/completions`` URL, ``model`` the body's model name,
    and ``headers`` go with every request (e.g. ``Authorization: Bearer <session id>``). With ``in_process``, the
    endpoint at ``url`` lives in this process and its requests are handed to that handler rather than sent over
    loopback HTTP: what HTTP adds there is CPU spent on both ends of one process for nothing."""

    url: str
    model: str
    headers: Mapping[str, str] = field(default_factory=dict)
    in_process: ChatHandler | None = None

    def request_headers(self) -> dict[str, str]:
        """The headers of its chat requests: JSON bodies, and ``headers``. Raises ValueError when requests to
        ``url`` with them can't be sent (see ``chat_core.net.http_request.check_url``)."""
        headers = {"Content-Type": "application/json", "Accept": "application/json", **self.headers}
        check_url(self.url, headers)
        return headers


async def post(
    chat: ChatEndpoint,
    headers: Mapping[str, str],
    body: bytes,
    *,
    deadline: float,
    max_answer_bytes: int,
    retried: Callable[[], None] = lambda: None,
) -> Answer:
    """The chat endpoint's answer to ``body`` (sent with ``headers``), read up to ``max_answer_bytes``. A refused
    connection and a retryable status (``chat_core.retry``) are tried again after the backoff, or the
    ``Retry-After`` seconds when longer (``chat_core.retry.chat_retry_wait``), while the wait ends before the
    monotonic ``deadline``; ``retried`` is called before each retry. Then the last answer is returned, whatever its
    status; raises ``chat_core.net.http_request``'s HttpError (ConnectionRefused, AnswerTooLong) when the last attempt
    got no answer. The caller bounds the time."""
    attempt = 0
    while True:
        try:
            answer = await _answer(chat, headers, body, max_answer_bytes)
        except ConnectionRefused:
            if (wait := chat_retry_wait(attempt, None, None, deadline - time.monotonic())) is None:
                raise
            why = "refused the connection"
        else:
            retry_after = answer.headers.get("Retry-After")
            if (wait := chat_retry_wait(attempt, answer.status, retry_after, deadline - time.monotonic())) is None:
                return answer
            why = f"answered HTTP {answer.status}"
        logger.info("[chat_core] %s %s; sending the chat request again in %.1f s", chat.url, why, wait)
        retried()
        attempt += 1
        await asyncio.sleep(wait)


async def _answer(chat: ChatEndpoint, headers: Mapping[str, str], body: bytes, max_answer_bytes: int) -> Answer:
    """One answer of ``chat`` to ``body``, from its in-process handler or over HTTP, held to the same limit."""
    if chat.in_process is None:
        return await request(
            "POST", chat.url, headers, body, max_body_bytes=max_answer_bytes, limit_name="max_chat_answer_bytes"
        )
    answer = await chat.in_process(body, headers)
    if len(answer.body) > max_answer_bytes:
        raise AnswerTooLong(
            f"the answer's body passed max_chat_answer_bytes={max_answer_bytes} bytes ({len(answer.body)} bytes)"
        )
    return answer


@dataclass(frozen=True)
class Reply:
    """The model's answer, as the transcript keeps it, with its text and tool calls read out, whether it was cut
    at the model's token limit, and the tokens of the context once it was written (``context_tokens``: its usage's
    prompt and completion tokens; None when the answer reports no usage)."""

    message: dict[str, Any]
    text: str
    tool_calls: list[dict[str, Any]]
    truncated: bool
    context_tokens: int | None = None


CONTEXT_REFUSALS = ("maximum context length", "longer than the model's context length")
"""What the error message of a chat endpoint refusing a prompt too long for the model's context says: OpenAI's and
vLLM's "This model's maximum context length is …", SGLang's "The input (… tokens) is longer than the model's context
length (… tokens)." and "Requested token count exceeds the model's maximum context length …". OpenAI's error also
has the code ``context_length_exceeded``, which slime_helper's adapter answers with too."""


class UnreadableReply(Exception):
    """The chat endpoint's answer can't be read as a chat completion; the message says what is wrong with it."""


class AbortedReply(Exception):
    """The chat endpoint's server aborted the reply while generating it (finish reason ``abort``), so what came back
    is cut wherever the abort found it."""


def reply_of(raw: bytes, seen: int) -> Reply:
    """The reply in a chat completion; raises UnreadableReply saying what is wrong with it, and AbortedReply when the
    server aborted it. Tool calls without an id get one, unique in the episode, so each can be answered."""
    try:
        completion = parse_json(raw)
    except ValueError as e:
        raise UnreadableReply(
            f"answered with something that isn't JSON ({e}): {excerpt(wire_text(raw), FLAG_EXCERPT)}"
        ) from None
    choices = completion.get("choices") if isinstance(completion, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise UnreadableReply(f"answered without a choice holding a message: {excerpt(wire_text(raw), FLAG_EXCERPT)}")
    if choice.get("finish_reason") == "abort":
        raise AbortedReply(
            f"aborted the reply (finish_reason 'abort'), cut at {excerpt(message.get('content') or '', FLAG_EXCERPT)}"
        )
    text = _text_of(message.get("content"))
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list) or not all(
        isinstance(call, dict)
        and isinstance(call.get("function"), dict)
        and isinstance(call["function"].get("name"), str)
        for call in calls
    ):
        raise UnreadableReply(f"answered with tool calls that aren't OpenAI tool calls: {excerpt(calls, FLAG_EXCERPT)}")
    calls = [
        call if isinstance(call.get("id"), str) and call["id"] else {**call, "id": f"call_{seen}_{position}"}
        for position, call in enumerate(calls)
    ]
    kept = {key: value for key, value in message.items() if value is not None}
    kept["role"] = "assistant"
    if calls:
        kept["tool_calls"] = calls
    else:
        kept.pop("tool_calls", None)
    return Reply(
        message=kept,
        text=text,
        tool_calls=calls,
        truncated=choice.get("finish_reason") == "length",
        context_tokens=_context_tokens(completion.get("usage")),
    )


def context_refusal(status: int, raw: bytes) -> str | None:
    """The error message of a chat endpoint's answer refusing the prompt as too long for the model's context (HTTP
    400, with OpenAI's code ``context_length_exceeded`` or a message of ``CONTEXT_REFUSALS``), None for any other
    answer."""
    if status != 400:
        return None
    try:
        answer = parse_json(raw)
    except ValueError:
        return None
    error = answer.get("error", answer) if isinstance(answer, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str):
        return None
    if error.get("code") == "context_length_exceeded" or any(said in message.lower() for said in CONTEXT_REFUSALS):
        return message
    return None


def _context_tokens(usage: Any) -> int | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return prompt + completion


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        return "".join(str(part.get("text") or "") for part in content if part.get("type") == "text")
    raise UnreadableReply(
        f"answered with content that is neither text nor text parts: {excerpt(content, FLAG_EXCERPT)}"
    )


def arguments_of(raw: Any) -> dict[str, Any] | str:
    """A tool call's arguments as an object, or why they aren't one. No arguments at all read as ``{}``."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        return f"the arguments must be a JSON object, not {type(raw).__name__}"
    try:
        parsed = parse_json(raw)
    except ValueError as e:
        return f"the arguments aren't valid JSON ({e}): {excerpt(raw, FLAG_EXCERPT)}"
    if not isinstance(parsed, dict):
        return f"the arguments must be a JSON object, not {excerpt(raw, FLAG_EXCERPT)}"
    return parsed
