"""What a turn adds to a chat, as text, rendered by the tokenizer's own chat template: the pure half of the
append-only rendering (``slime_helper.tokenizers`` joins it to the tokens a session holds).

A turn adds tool answers, the next env turn's system and user messages, and the generation prompt after the model's
reply. ``AppendOnlyRenderer`` renders them after a fixed stand-in chat whose last turn is a stand-in reply, and keeps
only what follows the stand-in's own render, so whatever the template writes between turns, around a run of tool
answers, or as its generation prompt is the template's. Every render is checked: what comes before the added
messages must be rendered as it was without them, and every added message must be there, in order. A system message
the template can't place where it comes (Qwen3.5's raise, DeepSeek's move it to the top, MiniMax's drop it) is
rendered as the template renders a system message opening a chat, its whole turn: MiniMax-M2's ``]~b]system`` header
and ``[e~[`` end included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from slime_helper.chat_template import ChatTemplate, TemplateFailed

_SYSTEM = {"role": "system", "content": "⟦stand-in system⟧"}
_USER = {"role": "user", "content": "⟦stand-in user⟧"}
_REPLY = "⟦stand-in reply⟧"
_CALL = {"type": "function", "function": {"name": "stand_in", "arguments": {}}}
PROBES: tuple[tuple[dict[str, Any], ...], ...] = (
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
        opening = template.text([_SYSTEM, _USER], None, generation_prompt=False)
        self._stand_in_head = opening.partition(_USER["content"])[0] + _USER["content"]
        """The stand-in chat up to its user message's content, which what a turn adds must leave as it is."""
        self._generation_prompt = template.text([_SYSTEM, _USER], None, generation_prompt=True)[len(opening) :]
        """What the template writes to open the model's turn after a user message."""
        self._opening_system_bounds: tuple[str, str] | None = None
        self._special_tokens = tuple(template.tokenizer.get_added_vocab())

    @classmethod
    def of(cls, template: ChatTemplate) -> AppendOnlyRenderer:
        """The renderer, once it has rendered what every turn of an episode may add. Raises Unappendable, saying
        why, when the template can't render one of them after a reply."""
        try:
            renderer = cls(template)
        except TemplateFailed as failed:
            raise Unappendable(f"it can't render a stand-in chat ending in a reply: {failed}") from None
        for added in PROBES:
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
            return self.end_of_reply + self._with_opening_system_turns(added)
        except TemplateFailed as failed:
            raise Unappendable(str(failed)) from None

    def _with_opening_system_turns(self, added: Sequence[Mapping[str, Any]]) -> str:
        """``added`` but its system messages, with the generation prompt, as the template renders them after the
        stand-in reply; and each system message as the template renders one opening a chat, where the messages
        before it end (in whole tokens: DeepSeek's template closes a run of tool answers only before a reply)."""
        rest = [message for message in added if message.get("role") != "system"]
        text = self._after_reply(rest, generation_prompt=True)
        turns: list[tuple[int, str]] = []
        for at, message in enumerate(added):
            if message.get("role") == "system":
                before = [earlier for earlier in added[:at] if earlier.get("role") != "system"]
                turns.append((self._end_of(before, text), self.opening_system_turn(message)))
        for at, turn in reversed(turns):
            text = text[:at] + turn + text[at:]
        return text

    def _end_of(self, before: Sequence[Mapping[str, Any]], text: str) -> int:
        """Where the messages ``before`` end in ``text``, the render of messages they open after the stand-in reply:
        past what ``text`` shares with their render alone, short of a special token that sharing cuts into
        (DeepSeek's template closes a run of tool answers only before a reply)."""
        if not before:
            return 0
        alone = self._after_reply(before, generation_prompt=False)
        end = _common_prefix(alone, text)
        for special in self._special_tokens:
            start = text.find(special, max(0, end - len(special) + 1), end + len(special) - 1)
            if 0 <= start < end < start + len(special):
                end = start
        return end

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

    def opening_system_turn(self, message: Mapping[str, Any]) -> str:
        """System ``message`` as the template writes a system message that opens a chat: its whole turn, from where
        the turn opens (past the template's beginning-of-sequence tokens, at the token that opens every turn where
        the template has one: Qwen's ``<|im_start|>``, MiniMax's ``]~b]``) up to the user message after it. Raises
        Unappendable when the template writes that user message otherwise than after a reply, or writes ``message``
        otherwise than the stand-in system message."""
        before, user_turn = self._around_opening_system_turn()
        rendered = self.template.text([message, _USER], None, generation_prompt=False)
        if not rendered.startswith(before) or not rendered.endswith(user_turn):
            raise Unappendable("it renders a system message opening a chat otherwise than its stand-in")
        text = rendered[len(before) : len(rendered) - len(user_turn)]
        if not _holds_in_order(text, [message]):
            raise Unappendable("it leaves out a system message opening a chat")
        return text

    def _around_opening_system_turn(self) -> tuple[str, str]:
        """What the template writes before a system message's turn that opens a chat, and the user turn after it, as
        it writes them around the stand-in system message."""
        if self._opening_system_bounds is None:
            user_turn = self._after_reply([_USER], generation_prompt=False)
            rendered = self.template.text([_SYSTEM, _USER], None, generation_prompt=False)
            if not rendered.endswith(user_turn):
                raise Unappendable(
                    "it writes a user message after an opening system message otherwise than after a reply"
                )
            head = rendered[: len(rendered) - len(user_turn)]
            self._opening_system_bounds = (head[: self._turn_start(head, user_turn)], user_turn)
        return self._opening_system_bounds

    def _turn_start(self, head: str, user_turn: str) -> int:
        """Where the first message's turn starts in ``head``, a chat's render up to its second message, a user
        message rendered as ``user_turn``: past the whole tokens it shares with the render of a chat opening with a
        user message, then back to the last token that opens a turn in what they share, where the template writes one
        (what opens both a user turn and the model's). A template writing a system prompt of its own into a chat
        without one (MiniMax's) shares that turn's opening up to its content, so only the token opening it says
        where it starts."""
        ids, decode = self.template.ids, self.template.tokenizer.decode
        head_ids = ids(head)
        bare_ids = ids(self.template.text([_USER], None, generation_prompt=False))
        shared = decode(head_ids[: _common_prefix(head_ids, bare_ids)])
        if not head.startswith(shared):
            raise Unappendable("its tokens don't decode to the text they were encoded from")
        user_ids, model_ids = ids(user_turn), ids(self._generation_prompt)
        opener = decode(user_ids[: _common_prefix(user_ids, model_ids)])
        return head.rfind(opener, 0, len(shared)) if opener and opener in shared else len(shared)


def _stand_in(calls: int) -> list[dict[str, Any]]:
    """The stand-in chat: a system prompt, a user message and a reply making ``calls`` tool calls."""
    reply: dict[str, Any] = {"role": "assistant", "content": _REPLY}
    if calls:
        reply["tool_calls"] = [_CALL] * calls
    return [_SYSTEM, _USER, reply]


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


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    size = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        size += 1
    return size
