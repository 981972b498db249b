"""Qwen3's chat layout, written so that a chat only ever grows at its end: an assistant turn in history is the
generation prompt its reply was sampled after, the reply as the model wrote it (its think block included) and the
end of the turn. Qwen3's own template instead drops the think block from every assistant turn before the latest user
message, and, with thinking off, the empty one its generation prompt opens every reply with, so that each prompt
re-renders the turns before it differently from how the model saw them.

The part of a chat before its first assistant turn (the system prompt with the tools, the first user message) is
rendered by the tokenizer's own template, and so is the generation prompt; what follows is written here in Qwen3's
layout. ``Qwen3Chat.of`` takes a tokenizer only when its own template renders a probe chat exactly as this module
does wherever that template keeps what the model wrote (turns after the latest user message, each with its
reasoning), so a template that is not Qwen3's, or a Qwen3 variant laid out otherwise, is never rendered here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

END_OF_TURN = "<|im_end|>"
"""The token that ends every turn of Qwen3's chat, and the one the model stops on."""
_ASSISTANT = "<|im_start|>assistant\n"
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "find_crate",
            "description": "Find the shelf a crate is on.",
            "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
        },
    }
]
_PROBE_CALLS = [
    {"type": "function", "function": {"name": "find_crate", "arguments": {"name": "poires é"}}},
    {"type": "function", "function": {"name": "find_crate", "arguments": '{"name": "kiwis"}'}},
]
_PROBE_CHATS: tuple[list[dict[str, Any]], ...] = (
    [
        {"role": "system", "content": "You run a warehouse."},
        {"role": "user", "content": "Where are the pears and the kiwis?"},
        {"role": "assistant", "content": "", "reasoning_content": "\nTwo crates.\n", "tool_calls": _PROBE_CALLS},
        {"role": "tool", "content": "Shelf 9C."},
        {"role": "tool", "content": "Shelf 2A."},
        {"role": "assistant", "content": "\nOn 9C and 2A.", "reasoning_content": "Both found."},
    ],
    [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Welcome!"},
        {"role": "user", "content": "Where are the pears?"},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Please."},
        {"role": "assistant", "content": "Let me look.", "tool_calls": _PROBE_CALLS[:1]},
        {"role": "tool", "content": "Shelf 9C."},
    ],
)


class Qwen3Chat:
    """The append-only rendering of chats for ``tokenizer``, whose template is Qwen3's, with ``template_kwargs``
    (``--apply-chat-template-kwargs``) passed to it. Built by ``of``."""

    def __init__(self, tokenizer: Any, template_kwargs: Mapping[str, Any], generation_prompt: str):
        self._tokenizer = tokenizer
        self._template_kwargs = dict(template_kwargs)
        self.generation_prompt = generation_prompt
        """What opens every reply: ``<|im_start|>assistant\\n``, and with thinking off the empty think block."""
        self.end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
        """The id of ``END_OF_TURN``."""

    @classmethod
    def of(cls, tokenizer: Any, template_kwargs: Mapping[str, Any]) -> Qwen3Chat | None:
        """The rendering for ``tokenizer``, or None when its chat template isn't recognised as Qwen3's: its
        generation prompt doesn't open an assistant turn in Qwen3's way, ``END_OF_TURN`` isn't one token, or it
        renders a probe chat otherwise than this module does."""
        probe = [{"role": "user", "content": "Hello."}]
        try:
            opened = _rendered(tokenizer, probe, None, True, template_kwargs)
            closed = _rendered(tokenizer, probe, None, False, template_kwargs)
            if not opened.startswith(closed) or not opened[len(closed) :].startswith(_ASSISTANT):
                return None
            if len(tokenizer.encode(END_OF_TURN, add_special_tokens=False)) != 1:
                return None
            chat = cls(tokenizer, template_kwargs, opened[len(closed) :])
            for messages in _PROBE_CHATS:
                if chat._text(messages, _PROBE_TOOLS, _ASSISTANT) != _rendered(
                    tokenizer, messages, _PROBE_TOOLS, False, template_kwargs
                ):
                    return None
        except Exception:  # a template that can't render Qwen3's probe chats isn't Qwen3's
            return None
        return chat

    def prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> str:
        """The whole chat ``messages`` with ``tools``, then the generation prompt: the prompt of the next reply.
        Raises ValueError when an assistant turn comes before any system or user message."""
        return self._text(messages, tools, self.generation_prompt) + self.generation_prompt

    def continuation(self, added: Sequence[Mapping[str, Any]]) -> str:
        """What follows a reply once its turn's ``END_OF_TURN`` is written: the rest of the turn's end, the
        ``added`` messages (tool answers, user and system messages, none an assistant turn), then the generation
        prompt."""
        return "\n" + _messages(added, "assistant", self.generation_prompt) + self.generation_prompt

    def _text(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, opened_by: str
    ) -> str:
        """``messages`` with ``tools``, each assistant turn opened by ``opened_by``; up to the first assistant turn,
        as the tokenizer's own template renders it."""
        first = next((at for at, message in enumerate(messages) if message.get("role") == "assistant"), len(messages))
        if first == len(messages):
            return _rendered(self._tokenizer, messages, tools, False, self._template_kwargs)
        if first == 0:
            raise ValueError("a chat must open with a system or user message before the first assistant turn")
        head = _rendered(self._tokenizer, messages[:first], tools, False, self._template_kwargs)
        return head + _messages(messages[first:], messages[first - 1].get("role"), opened_by)


def _rendered(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    generation_prompt: bool,
    template_kwargs: Mapping[str, Any],
) -> str:
    """``messages`` as the tokenizer's own chat template renders them."""
    return tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=generation_prompt, **template_kwargs
    )


def _messages(messages: Sequence[Mapping[str, Any]], before: str | None, opened_by: str) -> str:
    """``messages`` in Qwen3's layout, after a message of role ``before``, each assistant turn opened by
    ``opened_by``. A run of tool answers is one user turn, closed where the run ends."""
    parts: list[str] = []
    roles = [before, *(message.get("role") for message in messages), None]
    for at, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            parts.append(_assistant_turn(message, opened_by))
        elif role == "tool":
            if roles[at] != "tool":
                parts.append("<|im_start|>user")
            parts.append("\n<tool_response>\n" + message.get("content", "") + "\n</tool_response>")
            if roles[at + 2] != "tool":
                parts.append(END_OF_TURN + "\n")
        else:
            parts.append(f"<|im_start|>{role}\n{message.get('content', '')}{END_OF_TURN}\n")
    return "".join(parts)


def _assistant_turn(message: Mapping[str, Any], opened_by: str) -> str:
    """An assistant turn as the model wrote it after ``opened_by``: its reasoning in a think block when the message
    carries it apart (``reasoning_content``; otherwise a think block is in the content as the model wrote it), its
    content, its tool calls, and the end of the turn, which a reply that stopped on ``END_OF_TURN`` already holds
    (slime's adapter leaves the stop token in a text reply's content)."""
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content")
    if reasoning:
        written = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
    else:
        written = content
        if "</think>" in content:
            content = content.rpartition("</think>")[2].lstrip("\n")
    for position, call in enumerate(message.get("tool_calls") or ()):
        written += ("\n" if position or content else "") + _tool_call(call.get("function") or call)
    written = opened_by + written
    return written + ("\n" if written.endswith(END_OF_TURN) else END_OF_TURN + "\n")


def _tool_call(function: Mapping[str, Any]) -> str:
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": "{function.get("name")}", "arguments": {arguments}}}\n</tool_call>'
