"""The episode's chat with the model: the transcript as the model sees it (tool messages included) and each model
turn, asked with the whole transcript and the turn's tools and read as the reply the loop plays, or found not to fit
the model's context (``ContextFull``).

Each chat request's body is the whole transcript so far, so it is built from each message's JSON, encoded once when
the message joins the transcript, and each turn's tools, encoded once when the turn opens: encoding the transcript
anew for every request cost time quadratic in the episode's length."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

from chat_core._wire import FLAG_EXCERPT, described, encoded, excerpt, wire_text
from chat_core.env.protocol import Tool
from chat_core.episode.chat import AbortedReply, ChatEndpoint, Reply, UnreadableReply, context_refusal, post, reply_of
from chat_core.episode.tracing import EpisodeTrace
from chat_core.limits import Limits
from chat_core.net.http_request import HttpError
from chat_core.record.results import EpisodeResult, FlagKind

RESERVED_BODY_KEYS = frozenset({"model", "messages", "tools"})
"""The chat body's keys ``play`` sends itself, which the sampling settings may not set."""


def check_sampling(sampling: Mapping[str, Any]) -> None:
    """Raise ValueError when ``sampling`` sets a key of the chat body that every request sends itself."""
    if clash := sorted(RESERVED_BODY_KEYS & set(sampling)):
        raise ValueError(f"the sampling sets {', '.join(clash)}, which every chat request sends itself; leave them out")


class ContextFull(Exception):
    """The episode's next prompt doesn't fit the model's context; the message says how that was found."""


class Conversation:
    """The chat of the episode ``result`` records, with the model at ``chat``: ``sampling`` goes into every request's
    body as it is. Raises ValueError when the chat endpoint's URL or headers can't be sent."""

    def __init__(
        self,
        chat: ChatEndpoint,
        sampling: Mapping[str, Any],
        limits: Limits,
        result: EpisodeResult,
        trace: EpisodeTrace,
    ):
        self._chat = chat
        self._headers = chat.request_headers()
        self._body_head = encoded({**sampling, "model": chat.model})[:-1] + b',"messages":['
        self._said: list[bytes] = []
        self._context_tokens = 0
        self._limits = limits
        self._result = result
        self._trace = trace

    def say(self, message: dict[str, Any]) -> None:
        """Add ``message`` to the transcript."""
        self._result.transcript.append(message)
        self._said.append(encoded(message))

    def answer(self, call: Mapping[str, Any], content: str) -> None:
        """Answer the model's tool ``call`` with ``content``."""
        self.say({"role": "tool", "tool_call_id": call["id"], "content": content})

    def skip(self, calls: Sequence[Mapping[str, Any]], why: str) -> None:
        """Answer each of ``calls`` as not run, because of ``why``."""
        for call in calls:
            self.answer(call, f"error: not run: {why}")

    @staticmethod
    def tools_of(tools: Sequence[Tool]) -> bytes:
        """A turn's ``tools``, encoded as the end of a chat body."""
        return b'],"tools":' + encoded([tool.as_openai() for tool in tools]) + b"}"

    async def ask(self, tools: bytes) -> Reply | None:
        """The model's reply to the transcript with the turn's ``tools`` (``tools_of``), or None when the chat
        failed or the model deadline passed (flagged). The time it took counts as the model's. Raises ContextFull,
        without asking, when the context already holds ``Limits.max_context_tokens``; and when the chat endpoint
        refuses the prompt as too long for the model's context, or its reply takes the context past
        ``max_context_tokens`` (the reply is then left out of the transcript: what the trainer keeps of it is cut)."""
        turn = len(self._result.turns)
        limit = self._limits.max_context_tokens
        if limit is not None and self._context_tokens >= limit:
            raise ContextFull(f"the context holds {self._context_tokens} tokens, max_context_tokens={limit}")
        left = self._limits.model_deadline_s - self._result.timings.model_s
        body = b"".join((self._body_head, b",".join(self._said), tools))
        began = time.monotonic()
        try:
            with self._trace.span("model_call", {"turn": turn}):
                async with asyncio.timeout(left):
                    answer = await post(
                        self._chat,
                        self._headers,
                        body,
                        deadline=began + left,
                        max_answer_bytes=self._limits.max_chat_answer_bytes,
                        retried=self._retried,
                    )
        except TimeoutError:
            self._result.flag(
                FlagKind.MODEL_DEADLINE,
                f"the model took more than model_deadline_s={self._limits.model_deadline_s} s in all; the episode "
                f"was abandoned in turn {turn}",
            )
            return None
        except HttpError as e:
            self._failed(f"the chat request to {self._chat.url} failed: {described(e)}{self._retries()}")
            return None
        finally:
            self._result.timings.model_s += time.monotonic() - began
        if (refusal := context_refusal(answer.status, answer.body)) is not None:
            raise ContextFull(
                f"the chat endpoint {self._chat.url} refused the prompt: {excerpt(refusal, FLAG_EXCERPT)}"
            )
        if answer.status >= 400:
            self._failed(
                f"the chat endpoint {self._chat.url} answered HTTP {answer.status}: "
                f"{excerpt(wire_text(answer.body), FLAG_EXCERPT)}{self._retries()}"
            )
            return None
        try:
            reply = reply_of(answer.body, len(self._result.transcript))
        except AbortedReply as e:
            self._result.flag(
                FlagKind.REPLY_ABORTED, f"the chat endpoint {self._chat.url} {e}; the episode ended there"
            )
            return None
        except UnreadableReply as e:
            self._failed(f"the chat endpoint {self._chat.url} {e}")
            return None
        if limit is None:
            return reply
        if reply.context_tokens is None:
            self._failed(
                f"the chat endpoint {self._chat.url} answered without usage, whose prompt and completion tokens "
                f"max_context_tokens={limit} is counted in"
            )
            return None
        if reply.context_tokens > limit:
            raise ContextFull(
                f"the reply took the context to {reply.context_tokens} tokens, past max_context_tokens={limit}, so "
                "it was left unplayed"
            )
        self._context_tokens = reply.context_tokens
        return reply

    def _failed(self, message: str) -> None:
        self._result.flag(FlagKind.SESSION_FAILED, message)

    def _retried(self) -> None:
        self._result.model_retries += 1

    def _retries(self) -> str:
        retries = self._result.model_retries
        return f" ({retries} chat request(s) of the episode sent again before giving up)" if retries else ""
