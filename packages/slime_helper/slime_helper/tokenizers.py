"""The tokenizers slime's adapter renders an episode's chat with: each turn's whole chat (``WholeChatTokenizer``), or
append-only (``AppendOnlyTokenizer``): each turn's prompt is the tokens the session's last turn held (its prompt,
then the reply exactly as the model sampled it, reasoning included) followed by only what the turn adds (tool
answers, the next env turn's system and user messages, the generation prompt), as ``slime_helper.renderer`` renders
it with the template. slime's ``TrajectoryManager`` then finds every prompt extending the tokens it holds and joins
the episode's turns into one sample, and only what a turn adds is tokenized.

Where a reply stops is taken from the tokens themselves: a reply that stopped on a special token the template
writes next (Qwen's ``<|im_end|>``, GLM's ``<|observation|>``) doesn't get it written twice, and a reply cut at the
token limit gets the template's whole end of turn.

Either refuses a prompt that fills the launch's context (``ContextFull``), as slime's adapter would otherwise answer
it with an empty reply cut at ``length`` and record that turn, its prompt tokens ending the sample.

slime's adapter asks for a turn's prompt with the chat alone. The session it belongs to comes from
``turn_session``, which ``slime_helper.adapter``'s adapter sets for each request before rendering it, and the turn
it records comes back through ``record``; sessions the adapter didn't open (a client naming none lands in slime's
``"default"`` session, which many chats share) are rendered whole every turn. A later turn of an open session that
can't be appended is rendered whole and kept, with why, in ``turns_not_appended``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from slime_helper.chat_template import ChatTemplate, TemplateFailed
from slime_helper.renderer import AppendOnlyRenderer, Unappendable

logger = logging.getLogger(__name__)

turn_session: ContextVar[str | None] = ContextVar("slime_helper_turn_session", default=None)
"""The adapter session whose request is being served, in that request's task."""


@dataclass(frozen=True)
class HeldTurn:
    """A session's last recorded turn: its chat (the prompt's messages and the reply as slime recorded it), its
    tools, and its tokens (the prompt's and the reply's)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tokens: list[int]


@dataclass(frozen=True)
class TurnNotAppended:
    """The prompt of a session's ``call``-th model call (counted from 1, as the replies its chat holds), which
    couldn't be appended to the tokens the session's last recorded turn held (``why``), so it was rendered whole."""

    call: int
    why: str

    @property
    def message(self) -> str:
        return (
            f"model call {self.call}'s prompt couldn't be appended to the tokens of the turn before ({self.why}), so "
            "it was rendered whole with the chat template; where that doesn't extend the tokens the episode held, "
            "slime starts a new sample of the episode there"
        )


class WholeChatTokenizer:
    """The adapter's tokenizer when each turn's whole chat is rendered with the template: ``template``'s
    ``apply_chat_template``. A template's error raises ``ChatTemplateFailed`` for the session being served, and a
    prompt of ``max_context_tokens`` or more (slime's ``--rollout-max-context-len``; 0: no bound) ``ContextFull``.
    Everything else is the wrapped tokenizer's."""

    def __init__(self, template: ChatTemplate, max_context_tokens: int = 0):
        self._template = template
        self._max_context_tokens = max_context_tokens

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tokenize: bool = True,
        add_generation_prompt: bool = True,
    ) -> Any:
        """``conversation`` with ``tools`` rendered whole, as text or token ids."""
        try:
            text = self._template.text(conversation, tools, generation_prompt=add_generation_prompt)
        except TemplateFailed as failed:
            raise ChatTemplateFailed(turn_session.get(), str(failed)) from failed
        return self._fitting(self._template.ids(text)) if tokenize else text

    def _fitting(self, prompt: list[int]) -> list[int]:
        """``prompt``, unless it fills the context: raises ContextFull then."""
        if self._max_context_tokens and len(prompt) >= self._max_context_tokens:
            raise ContextFull(turn_session.get(), len(prompt), self._max_context_tokens)
        return prompt

    def __getattr__(self, name: str) -> Any:
        return getattr(self._template.tokenizer, name)


class ChatTemplateFailed(Exception):
    """The chat template raised on the chat of ``session``'s turn, so the turn can't be sent to the model.
    ``message`` is the template's."""

    def __init__(self, session: str | None, message: str):
        super().__init__(f"the model's chat template can't render this chat: {message}")
        self.session = session
        self.message = message


class ContextFull(Exception):
    """The prompt of ``session``'s turn is ``tokens`` tokens, which fills the context of ``limit`` tokens the launch
    allows, so the turn can't be sent to the model."""

    def __init__(self, session: str | None, tokens: int, limit: int):
        super().__init__(
            f"this turn's prompt is {tokens} tokens, and the model's maximum context length is {limit} tokens "
            "(slime's --rollout-max-context-len), which leaves no room for a reply"
        )
        self.session = session


class AppendOnlyTokenizer(WholeChatTokenizer):
    """The adapter's tokenizer rendering each turn of an open session append-only with ``renderer``; a turn of
    any other session, and the first of each, is rendered whole. ``max_context_tokens`` bounds the prompt as
    ``WholeChatTokenizer``'s does."""

    def __init__(self, renderer: AppendOnlyRenderer, max_context_tokens: int = 0):
        super().__init__(renderer.template, max_context_tokens)
        self._renderer = renderer
        self._special_tokens = {ids: text for text, ids in renderer.template.tokenizer.get_added_vocab().items()}
        self._held: dict[str, HeldTurn | None] = {}
        self._not_appended: dict[str, list[TurnNotAppended]] = {}

    def open(self, sid: str) -> None:
        """Render session ``sid`` append-only from its next turn on."""
        self._held[sid] = None
        self._not_appended[sid] = []

    def forget(self, sid: str) -> None:
        """Drop what session ``sid`` holds; its later turns, if any, are rendered whole."""
        self._held.pop(sid, None)
        self._not_appended.pop(sid, None)

    def turns_not_appended(self, sid: str) -> list[TurnNotAppended]:
        """The turns of open session ``sid`` after its first that were rendered whole, and why."""
        return list(self._not_appended.get(sid, ()))

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
            self._held[sid] = HeldTurn([*messages, reply], tools, [*turn.prompt_ids, *turn.output_ids])

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tokenize: bool = True,
        add_generation_prompt: bool = True,
    ) -> Any:
        """The token ids of the prompt that asks for the reply to ``conversation`` with ``tools``, as slime's adapter
        asks for them. When the current turn's open session holds a turn whose chat ``conversation`` extends with
        the same tools and no assistant turn of its own, the held tokens and what follows them; otherwise the whole
        chat, rendered by the template."""
        sid = turn_session.get()
        if sid not in self._held or not tokenize or not add_generation_prompt:
            return super().apply_chat_template(conversation, tools, tokenize, add_generation_prompt)
        if (held := self._held[sid]) is None:
            if any(message.get("role") == "assistant" for message in conversation):
                why = "the turn before it wasn't held"
                return self._rendered_whole(sid, why, conversation, tools, tokenize, add_generation_prompt)
            return super().apply_chat_template(conversation, tools, tokenize, add_generation_prompt)
        if (added := _messages_added(conversation, tools, held)) is None:
            why = "its chat doesn't extend the last turn's with the same tools"
            return self._rendered_whole(sid, why, conversation, tools, tokenize, add_generation_prompt)
        try:
            added_text = self._renderer.added_text(added)
        except (Unappendable, TemplateFailed) as failed:
            why = f"the chat template can't render its messages after the last reply: {failed}"
            return self._rendered_whole(sid, why, conversation, tools, tokenize, add_generation_prompt)
        return self._fitting(self._joined(held.tokens, added_text))

    def _rendered_whole(
        self,
        sid: str,
        why: str,
        conversation: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        tokenize: bool,
        add_generation_prompt: bool,
    ) -> Any:
        """``conversation`` rendered whole for a later turn of open session ``sid``, kept with ``why`` it wasn't
        appended."""
        call = 1 + sum(message.get("role") == "assistant" for message in conversation)
        not_appended = TurnNotAppended(call, why)
        self._not_appended[sid].append(not_appended)
        logger.warning("[slime_helper] session %s: %s", sid, not_appended.message)
        return super().apply_chat_template(conversation, tools, tokenize, add_generation_prompt)

    def _joined(self, held: Sequence[int], added_text: str) -> list[int]:
        """``held`` (a turn's prompt and reply tokens) followed by the tokens of ``added_text``, less the special
        token the reply stopped on where ``added_text`` writes it first."""
        stop = self._special_tokens.get(held[-1]) if held else None
        if stop and added_text.startswith(stop):
            added_text = added_text[len(stop) :]
        return [*held, *self._template.ids(added_text)]


def _messages_added(
    conversation: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None, held: HeldTurn
) -> Sequence[Mapping[str, Any]] | None:
    """The messages ``conversation`` adds to ``held``'s chat, or None when it doesn't extend it with the same tools
    and messages other than an assistant turn."""
    size = len(held.messages)
    if tools != held.tools or len(conversation) <= size or list(conversation[:size]) != held.messages:
        return None
    added = conversation[size:]
    return None if any(message.get("role") == "assistant" for message in added) else added
