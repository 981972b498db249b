"""The tokenizer slime's adapter renders an episode's chat with when the chat template is Qwen3's: each turn's prompt
is the tokens the session's last turn held (its prompt, then the reply as the model sampled it) followed by what the
turn adds (``qwen3_chat``). slime's ``TrajectoryManager`` then finds every prompt extending the tokens it holds and
joins the episode's turns into one sample, and only what a turn adds is tokenized.

slime's adapter asks for a turn's prompt with the chat alone. The session it belongs to comes from
``turn_session``, which ``slime_helper.adapter``'s adapter sets for each request before rendering it, and the turn
it records comes back through ``record``; sessions the adapter didn't open (a client naming none lands in slime's
``"default"`` session, which many chats share) are rendered whole every turn.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from slime_helper.qwen3_chat import Qwen3Chat

logger = logging.getLogger(__name__)

turn_session: ContextVar[str | None] = ContextVar("slime_helper_turn_session", default=None)
"""The adapter session whose request is being served, in that request's task."""


@dataclass(frozen=True)
class _Held:
    """A session's last recorded turn: its chat (the prompt's messages and the reply as slime recorded it), its
    tools, and its tokens (the prompt's and the reply's)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tokens: list[int]


class AppendOnlyTokenizer:
    """``tokenizer``, whose ``apply_chat_template`` renders each turn of an open session append-only with ``chat``.
    Everything else is the wrapped tokenizer's."""

    def __init__(self, tokenizer: Any, chat: Qwen3Chat):
        self._tokenizer = tokenizer
        self._chat = chat
        self._held: dict[str, _Held | None] = {}

    def open(self, sid: str) -> None:
        """Render session ``sid`` append-only from its next turn on."""
        self._held[sid] = None

    def forget(self, sid: str) -> None:
        """Drop what session ``sid`` holds; its later turns, if any, are rendered whole."""
        self._held.pop(sid, None)

    def record(
        self,
        sid: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        reply: dict[str, Any],
        turn: Any,
    ) -> None:
        """Hold the turn slime's adapter recorded for open session ``sid``: the chat ``messages`` rendered with
        ``tools`` as the prompt, the ``reply`` message, and ``turn``, slime's ``TurnRecord`` with the prompt's and
        the reply's token ids. The adapter passes these to its ``debug_callback`` as it records each turn."""
        if sid in self._held:
            self._held[sid] = _Held([*messages, reply], tools, [*turn.prompt_ids, *turn.output_ids])

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tokenize: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The token ids of the prompt that asks for the reply to ``conversation`` with ``tools``, as slime's adapter
        asks for them. When the current turn's open session holds a turn whose chat ``conversation`` extends with
        the same tools and no assistant turn of its own, the held tokens, the end of the held reply's turn and the
        added messages; otherwise the whole chat (``whole``). Raises ValueError for anything but token ids with a
        generation prompt."""
        if not tokenize or not add_generation_prompt:
            raise ValueError("AppendOnlyTokenizer renders a turn's prompt as token ids, with its generation prompt")
        sid = turn_session.get()
        held = self._held.get(sid) if sid is not None else None
        if held is None:
            return self.whole(conversation, tools)
        if (added := _added(conversation, tools, held)) is None:
            logger.warning(
                "[slime_helper] session %s: this turn's chat doesn't extend the last turn's with the same tools, so it "
                "is rendered whole and slime starts a new sample of the episode here",
                sid,
            )
            return self.whole(conversation, tools)
        tokens = held.tokens if held.tokens[-1:] == [self._chat.end_of_turn] else [*held.tokens, self._chat.end_of_turn]
        return [*tokens, *self._tokenizer.encode(self._chat.continuation(added), add_special_tokens=False)]

    def whole(self, conversation: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The token ids of ``conversation`` with ``tools`` rendered whole, append-only, then the generation
        prompt."""
        return self._tokenizer.encode(self._chat.prompt(conversation, tools), add_special_tokens=False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def _added(
    conversation: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None, held: _Held
) -> Sequence[Mapping[str, Any]] | None:
    """The messages ``conversation`` adds to ``held``'s chat, or None when it doesn't extend it with the same tools
    and messages other than an assistant turn."""
    size = len(held.messages)
    if tools != held.tools or len(conversation) <= size or list(conversation[:size]) != held.messages:
        return None
    added = conversation[size:]
    return None if any(message.get("role") == "assistant" for message in added) else added
