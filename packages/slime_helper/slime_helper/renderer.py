"""What a turn adds to a chat, as text, rendered by the tokenizer's own chat template: the pure half of the
append-only rendering (``slime_helper.tokenizers`` joins it to the tokens a session holds).

A turn adds tool answers, the next env turn's system and user messages, and the generation prompt after the model's
reply. ``AppendOnlyRenderer`` renders them after a fixed stand-in chat whose last turn is a stand-in reply, and keeps
only what follows the stand-in's own render, so whatever the template writes between turns, around a run of tool
answers, or as its generation prompt is the template's. Every render is checked: what comes before the added
messages must be rendered as it was without them, and every added message must be there, in order. A system message
the template can't place where it comes (Qwen3.5's raise, DeepSeek's move it to the top, MiniMax-M3's drop it) is
rendered as the template renders a system message opening a chat.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from slime_helper.chat_template import ChatTemplate, TemplateFailed

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


class AppendOnlyRenderer:
    """The text ``template`` adds after a reply for the messages a turn adds. Built by ``of``."""

    def __init__(self, template: ChatTemplate):
        self.template = template
        self._after_stand_in_reply: dict[int, str] = {}
        self.end_of_reply = self._rendered_after_stand_in_reply(0)
        """What the template writes after a reply's last word: ``<|im_end|>\\n`` for Qwen, nothing for GLM."""
        marked = template.text([_SYSTEM, _USER], None, generation_prompt=False)
        self._stand_in_head = marked.partition(_USER["content"])[0] + _USER["content"]
        """The stand-in chat up to its user message's content, which what a turn adds must leave as it is."""
        bare = template.text([_USER], None, generation_prompt=False)
        suffix = _common_suffix(bare, marked)
        prefix = _common_prefix(bare[: len(bare) - suffix], marked[: len(marked) - suffix])
        self._around_opening_system = (marked[:prefix], marked[len(marked) - suffix :])
        """What the template writes before and after a system message that opens a chat, found by rendering the
        stand-in chat with and without its system message."""

    @classmethod
    def of(cls, template: ChatTemplate) -> AppendOnlyRenderer:
        """The renderer, once it has rendered what every turn of an episode may add. Raises Unappendable, saying
        why, when the template can't render one of them after a reply."""
        try:
            renderer = cls(template)
        except TemplateFailed as failed:
            raise Unappendable(f"it can't render a stand-in chat ending in a reply: {failed}") from None
        for added in _PROBES:
            renderer.added_text(added)
        return renderer

    def added_text(self, added: Sequence[Mapping[str, Any]]) -> str:
        """What follows a reply's last word when ``added`` (tool answers, system and user messages, none an
        assistant turn) comes after it: the template's end of the reply's turn, ``added``, then the generation
        prompt. Raises Unappendable when the template can't render ``added`` after a reply."""
        try:
            return self.end_of_reply + self._after_reply(added, generation_prompt=True)
        except (Unappendable, TemplateFailed) as failed:
            if not any(message.get("role") == "system" for message in added):
                raise Unappendable(str(failed)) from None
        try:
            return self.end_of_reply + "".join(self._piece_by_piece(_split_at_system_messages(added)))
        except TemplateFailed as failed:
            raise Unappendable(str(failed)) from None

    def _piece_by_piece(self, pieces: Sequence[Sequence[Mapping[str, Any]]]) -> Iterator[str]:
        """Each of ``pieces`` (runs without a system message, and system messages alone) rendered after the
        stand-in reply, the last with the generation prompt; a system message the template can't render there as
        the template renders one opening a chat."""
        for at, piece in enumerate(pieces):
            last = at == len(pieces) - 1
            if piece[0].get("role") != "system":
                yield self._after_reply(piece, generation_prompt=last)
                continue
            try:
                yield self._after_reply(piece, generation_prompt=last)
            except (Unappendable, TemplateFailed):
                yield self._as_opening_system_message(piece[0]) + (
                    self._after_reply((), generation_prompt=True) if last else ""
                )

    def _after_reply(self, added: Sequence[Mapping[str, Any]], *, generation_prompt: bool) -> str:
        """``added`` and, when ``generation_prompt``, the generation prompt, as the template renders them after
        the stand-in reply's turn. Raises Unappendable when rendering them changes what comes before them, or
        leaves one out, and TemplateFailed when the template raises."""
        calls = next((at for at, message in enumerate(added) if message.get("role") != "tool"), len(added))
        before = self._rendered_after_stand_in_reply(calls)
        rendered = self.template.text([*_stand_in(calls), *added], None, generation_prompt=generation_prompt)
        if not rendered.startswith(self._stand_in_head):
            raise Unappendable("it moves a later message ahead of the turns before it")
        if rendered.count(_REPLY) != 1 or not (tail := rendered.partition(_REPLY)[2]).startswith(before):
            raise Unappendable("it renders the turn before the added messages otherwise once they follow it")
        delta = tail[len(before) :]
        if not _holds_in_order(delta, added):
            raise Unappendable("it leaves an added message out, or out of order")
        return delta

    def _rendered_after_stand_in_reply(self, calls: int) -> str:
        """What the template writes after the stand-in reply's content when that reply makes ``calls`` tool calls
        and ends the chat."""
        if calls not in self._after_stand_in_reply:
            rendered = self.template.text(_stand_in(calls), None, generation_prompt=False)
            if rendered.count(_REPLY) != 1:
                raise Unappendable("it doesn't render a reply's content as it is")
            self._after_stand_in_reply[calls] = rendered.partition(_REPLY)[2]
        return self._after_stand_in_reply[calls]

    def _as_opening_system_message(self, message: Mapping[str, Any]) -> str:
        """System ``message`` as the template renders a system message that opens a chat. Raises Unappendable when
        the template renders it otherwise than the stand-in system message."""
        before, after = self._around_opening_system
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
