"""The tokenizer's own chat template, as every rendering of the helper uses it: with the launch's
``--apply-chat-template-kwargs``, with tool-call arguments in the form the template takes, and with what the template
itself raises told apart from anything else.

Templates differ in what they accept. DeepSeek's concatenate a call's arguments as text and raise on the object
slime's adapter records, Qwen3.5's raise on a system message after the first, and any template may call its
``raise_exception``. ``ChatTemplate`` finds the argument form once, by rendering a probe call both ways, and raises
``TemplateFailed`` with the template's own message for what the template raises; an error of any other origin (a bug
of ours, of slime's or of the tokenizer's) propagates as it is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import TemplateError

TEMPLATE_CODE = "<template>"
"""The file name jinja2 gives the code it compiles a template from a string into, as transformers compiles chat
templates."""
PROBE_QUESTION = {"role": "user", "content": "Where are the pears?"}
PROBE_CALLS = [{"type": "function", "function": {"name": "find_crate", "arguments": {"name": "pears"}}}]
CALL_CONTENTS = ("", None)
"""What a reply that only calls tools holds as its content: slime's adapter records ``""``; DeepSeek-V3's template
renders the calls only of a reply whose content is None."""


class TemplateFailed(Exception):
    """The chat template raised while rendering a chat; the message is the template's."""


def raised_by_template(error: BaseException) -> bool:
    """Whether ``error`` was raised by a chat template: jinja2's ``TemplateError`` (what a template's
    ``raise_exception`` raises) or an error raised while the template's own compiled code ran (a template adding a
    string to an object, say)."""
    if isinstance(error, TemplateError):
        return True
    frame = error.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code.co_filename == TEMPLATE_CODE:
            return True
        frame = frame.tb_next
    return False


class ChatTemplate:
    """``tokenizer``'s chat template rendered with ``template_kwargs``; ``string_arguments`` says whether it takes a
    tool call's arguments as JSON text rather than as an object."""

    def __init__(self, tokenizer: Any, template_kwargs: Mapping[str, Any]):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs)
        self.string_arguments = any(self._takes_only_text(content) for content in CALL_CONTENTS)

    def _takes_only_text(self, content: str | None) -> bool:
        """Whether the template renders a call of a reply holding ``content`` with its arguments as JSON text but
        not as an object."""
        chat = [PROBE_QUESTION, {"role": "assistant", "content": content, "tool_calls": PROBE_CALLS}]
        self.string_arguments = False
        try:
            self.text(chat, None, generation_prompt=False)
            return False
        except TemplateFailed:
            self.string_arguments = True
        try:
            self.text(chat, None, generation_prompt=False)
            return True
        except TemplateFailed:
            return False

    def text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        *,
        generation_prompt: bool,
    ) -> str:
        """``messages`` with ``tools`` as the template renders them, then the generation prompt when
        ``generation_prompt``. Raises TemplateFailed when the template raises."""
        try:
            return self.tokenizer.apply_chat_template(
                self.shaped(messages),
                tools=list(tools) if tools else None,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                **self.template_kwargs,
            )
        except Exception as error:
            if raised_by_template(error):
                raise TemplateFailed(f"{type(error).__name__}: {error}") from error
            raise

    def ids(self, text: str) -> list[int]:
        """The token ids of ``text``, special tokens as written and nothing added."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def shaped(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with each tool call's arguments in the form the template takes."""
        return [_shaped(message) if self.string_arguments else dict(message) for message in messages]


def _shaped(message: Mapping[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    return {**message, "tool_calls": [_with_text_arguments(call) for call in calls]}


def _with_text_arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, Mapping) or isinstance(function.get("arguments"), str):
        return dict(call)
    arguments = json.dumps(function.get("arguments") or {}, ensure_ascii=False)
    return {**call, "function": {**function, "arguments": arguments}}
