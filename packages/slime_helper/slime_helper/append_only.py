"""The tokenizer slime's adapter renders an episode's chat with, append-only: each turn's prompt is the tokens the
session's last turn held (its prompt, then the reply exactly as the model sampled it, reasoning included) followed
by only what the turn adds (tool answers, the next env turn's system and user messages, the generation prompt).
slime's ``TrajectoryManager`` then finds every prompt extending the tokens it holds and joins the episode's turns
into one sample, and only what a turn adds is tokenized.

What a turn adds is rendered by the tokenizer's own chat template (``AppendOnlyChat``): the added messages after a
fixed stand-in chat whose last turn is a stand-in reply, minus the stand-in's own render, so whatever the template
writes between turns, around a run of tool answers, or as its generation prompt is the template's. Two things a
template can't say are taken from the tokens themselves: where a reply stops (a reply that stopped on a special
token the template writes next, as Qwen's ``<|im_end|>`` or GLM's ``<|observation|>``, isn't written twice; a reply
cut at the token limit gets the template's whole end of turn), and the form of a tool call's arguments
(``chat_template.ChatTemplate``). A system message the template can't place where it comes (Qwen3.5's raise,
DeepSeek's move it to the top, MiniMax-M3's drop it) is rendered as the template renders a system message opening a
chat.

slime's adapter asks for a turn's prompt with the chat alone. The session it belongs to comes from
``turn_session``, which ``slime_helper.adapter``'s adapter sets for each request before rendering it, and the turn
it records comes back through ``record``; sessions the adapter didn't open (a client naming none lands in slime's
``"default"`` session, which many chats share) are rendered whole every turn.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from slime_helper.chat_template import ChatTemplate, TemplateFailed

logger = logging.getLogger(__name__)

turn_session: ContextVar[str | None] = ContextVar("slime_helper_turn_session", default=None)
"""The adapter session whose request is being served, in that request's task."""

_SYSTEM = {"role": "system", "content": "⟦stand-in system⟧"}
_USER = {"role": "user", "content": "⟦stand-in user⟧"}
_REPLY = "⟦stand-in reply⟧"
_CALL = {"type": "function", "function": {"name": "stand_in", "arguments": {}}}
_PROBES: tuple[tuple[dict[str, Any], ...], ...] = (
    ({"role": "tool", "content": "Shelf 9C."}, {"role": "tool", "content": "Shelf 2A."}),
    ({"role": "user", "content": "And the apples?"},),
    ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "And the apples?"}),
    (
        {"role": "tool", "content": "Not run."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Go."},
    ),
)
"""What turns add to a chat: tool answers, a user message, and a later env turn's system prompt and user message,
after a reply or after the answer to its last tool call."""


class Unappendable(Exception):
    """The chat template can't render these messages after a reply without changing what comes before them; the
    message says how."""


class AppendOnlyChat:
    """The append-only rendering of ``template``'s chats. Built by ``of``."""

    def __init__(self, template: ChatTemplate):
        self.template = template
        self._after_stand_in: dict[int, str] = {}
        self._added_tokens = {ids: text for text, ids in template.tokenizer.get_added_vocab().items()}
        self.closing = self._rendered_after_stand_in(0)
        """What the template writes after a reply's last word: ``<|im_end|>\\n`` for Qwen, nothing for GLM."""
        marked = template.text([_SYSTEM, _USER], None, generation_prompt=False)
        self._opening = marked.partition(_USER["content"])[0] + _USER["content"]
        """The stand-in chat up to its user message's content, which what a turn adds must leave as it is."""
        bare = template.text([_USER], None, generation_prompt=False)
        suffix = _common_suffix(bare, marked)
        prefix = _common_prefix(bare[: len(bare) - suffix], marked[: len(marked) - suffix])
        self._leading_bounds = (marked[:prefix], marked[len(marked) - suffix :])

    @classmethod
    def of(cls, template: ChatTemplate) -> AppendOnlyChat:
        """The rendering, once it has rendered what every turn of an episode may add. Raises Unappendable, saying
        why, when the template can't render one of them after a reply."""
        try:
            chat = cls(template)
        except TemplateFailed as failed:
            raise Unappendable(f"it can't render a stand-in chat ending in a reply: {failed}") from None
        for added in _PROBES:
            chat.continuation(added)
        return chat

    def continuation(self, added: Sequence[Mapping[str, Any]]) -> str:
        """What follows a reply's last word when ``added`` (tool answers, system and user messages, none an
        assistant turn) comes after it: the template's end of the reply's turn, ``added``, then the generation
        prompt. Raises Unappendable when the template can't render ``added`` after a reply."""
        try:
            return self.closing + self._in_place(added, generation_prompt=True)
        except (Unappendable, TemplateFailed) as failed:
            if not any(message.get("role") == "system" for message in added):
                raise Unappendable(str(failed)) from None
        try:
            return self.closing + "".join(self._pieces(_split_at_system_messages(added)))
        except TemplateFailed as failed:
            raise Unappendable(str(failed)) from None

    def _pieces(self, pieces: Sequence[Sequence[Mapping[str, Any]]]) -> Iterator[str]:
        """Each of ``pieces`` (runs without a system message, and system messages alone) rendered after the
        stand-in reply, the last with the generation prompt; a system message the template can't render there as
        the template renders one opening a chat."""
        for at, piece in enumerate(pieces):
            last = at == len(pieces) - 1
            if piece[0].get("role") != "system":
                yield self._in_place(piece, generation_prompt=last)
                continue
            try:
                yield self._in_place(piece, generation_prompt=last)
            except (Unappendable, TemplateFailed):
                yield self._leading(piece[0]) + (self._in_place((), generation_prompt=True) if last else "")

    def joined(self, held: Sequence[int], continuation: str) -> list[int]:
        """``held`` (a turn's prompt and reply tokens) followed by the tokens of ``continuation``, less the special
        token the reply stopped on where the continuation writes it first."""
        stop = self._added_tokens.get(held[-1]) if held else None
        if stop and continuation.startswith(stop):
            continuation = continuation[len(stop) :]
        return [*held, *self.template.ids(continuation)]

    def _in_place(self, added: Sequence[Mapping[str, Any]], *, generation_prompt: bool) -> str:
        """``added`` and, when ``generation_prompt``, the generation prompt, as the template renders them after
        the stand-in reply's turn. Raises Unappendable when rendering them changes what comes before them, or
        leaves one out, and TemplateFailed when the template raises."""
        calls = next((at for at, message in enumerate(added) if message.get("role") != "tool"), len(added))
        before = self._rendered_after_stand_in(calls)
        rendered = self.template.text([*_stand_in(calls), *added], None, generation_prompt=generation_prompt)
        if not rendered.startswith(self._opening):
            raise Unappendable("it moves a later message ahead of the turns before it")
        if rendered.count(_REPLY) != 1 or not (tail := rendered.partition(_REPLY)[2]).startswith(before):
            raise Unappendable("it renders the turn before the added messages otherwise once they follow it")
        delta = tail[len(before) :]
        if not _holds_in_order(delta, added):
            raise Unappendable("it leaves an added message out, or out of order")
        return delta

    def _rendered_after_stand_in(self, calls: int) -> str:
        """What the template writes after the stand-in reply's content when that reply makes ``calls`` tool calls
        and ends the chat."""
        if calls not in self._after_stand_in:
            rendered = self.template.text(_stand_in(calls), None, generation_prompt=False)
            if rendered.count(_REPLY) != 1:
                raise Unappendable("it doesn't render a reply's content as it is")
            self._after_stand_in[calls] = rendered.partition(_REPLY)[2]
        return self._after_stand_in[calls]

    def _leading(self, message: Mapping[str, Any]) -> str:
        """System ``message`` as the template renders a system message that opens a chat. Raises Unappendable when
        the template renders it otherwise than the stand-in system message."""
        before, after = self._leading_bounds
        rendered = self.template.text([message, _USER], None, generation_prompt=False)
        if not rendered.startswith(before) or not rendered.endswith(after) or len(rendered) < len(before + after):
            raise Unappendable("it renders a system message opening a chat otherwise than its stand-in")
        text = rendered[len(before) : len(rendered) - len(after)]
        if not _holds_in_order(text, [message]):
            raise Unappendable("it leaves out a system message opening a chat")
        return text


def _stand_in(calls: int) -> list[dict[str, Any]]:
    """The stand-in chat: a system prompt, a user message and a reply making ``calls`` tool calls."""
    reply: dict[str, Any] = {"role": "assistant", "content": _REPLY}
    if calls:
        reply["tool_calls"] = [_CALL] * calls
    return [_SYSTEM, _USER, reply]


def _split_at_system_messages(added: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    pieces: list[list[Mapping[str, Any]]] = []
    for message in added:
        if message.get("role") == "system" or not pieces or pieces[-1][0].get("role") == "system":
            pieces.append([message])
        else:
            pieces[-1].append(message)
    return pieces


def _holds_in_order(text: str, messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether ``text`` holds each message's content, stripped, in order."""
    at = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and content.strip():
            found = text.find(content.strip(), at)
            if found < 0:
                return False
            at = found + len(content.strip())
    return True


def _common_prefix(a: str, b: str) -> int:
    size = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        size += 1
    return size


def _common_suffix(a: str, b: str) -> int:
    return _common_prefix(a[::-1], b[::-1])


@dataclass(frozen=True)
class _Held:
    """A session's last recorded turn: its chat (the prompt's messages and the reply as slime recorded it), its
    tools, and its tokens (the prompt's and the reply's)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tokens: list[int]


class WholeChatTokenizer:
    """The adapter's tokenizer when each turn's whole chat is rendered with the template: ``template``'s
    ``apply_chat_template``. A template's error raises ``ChatTemplateFailed`` for the session being served.
    Everything else is the wrapped tokenizer's."""

    def __init__(self, template: ChatTemplate):
        self._template = template

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
        return self._template.ids(text) if tokenize else text

    def __getattr__(self, name: str) -> Any:
        return getattr(self._template.tokenizer, name)


class ChatTemplateFailed(Exception):
    """The chat template raised on the chat of ``session``'s turn, so the turn can't be sent to the model.
    ``message`` is the template's."""

    def __init__(self, session: str | None, message: str):
        super().__init__(f"the model's chat template can't render this chat: {message}")
        self.session = session
        self.message = message


class AppendOnlyTokenizer(WholeChatTokenizer):
    """The adapter's tokenizer rendering each turn of an open session append-only with ``chat``; a turn of any
    other session, and the first of each, is rendered whole."""

    def __init__(self, chat: AppendOnlyChat):
        super().__init__(chat.template)
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
    ) -> Any:
        """The token ids of the prompt that asks for the reply to ``conversation`` with ``tools``, as slime's adapter
        asks for them. When the current turn's open session holds a turn whose chat ``conversation`` extends with
        the same tools and no assistant turn of its own, the held tokens and what follows them; otherwise the whole
        chat, rendered by the template."""
        sid = turn_session.get()
        held = self._held.get(sid) if sid is not None and tokenize and add_generation_prompt else None
        if held is None:
            return super().apply_chat_template(conversation, tools, tokenize, add_generation_prompt)
        if (added := _added(conversation, tools, held)) is None:
            logger.warning(
                "[slime_helper] session %s: this turn's chat doesn't extend the last turn's with the same tools, so it "
                "is rendered whole and slime starts a new sample of the episode here",
                sid,
            )
            return super().apply_chat_template(conversation, tools, tokenize, add_generation_prompt)
        try:
            continuation = self._chat.continuation(added)
        except (Unappendable, TemplateFailed) as failed:
            logger.warning(
                "[slime_helper] session %s: the chat template can't render this turn's messages after the last "
                "reply (%s), so the turn is rendered whole and slime starts a new sample of the episode here",
                sid,
                failed,
            )
            return super().apply_chat_template(conversation, tools, tokenize, add_generation_prompt)
        return self._chat.joined(held.tokens, continuation)


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
