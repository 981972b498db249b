"""The tokenizer's own chat template, as every rendering of the helper uses it: with the launch's
``--apply-chat-template-kwargs``, with a tool-calling reply in the form the template takes, and with what the template
itself raises told apart from anything else.

Templates differ in what they accept. DeepSeek's concatenate a call's arguments as text and raise on the object
slime's adapter records; DeepSeek-V3's writes the calls only of a reply whose content is None, where slime's adapter
records ``""``; Qwen3.5's raise on a system message after the first, and any template may call its
``raise_exception``. ``ChatTemplate`` finds the form once, by rendering a probe call each way, and raises
``TemplateFailed`` with the template's own message for what the template raises; an error of any other origin (a bug
of ours, of slime's or of the tokenizer's) propagates as it is.

transformers from 5.25 on leaves a message's None-valued keys out of what the template sees, so under it no form
with content None writes a call; a template that writes calls in no other form is refused then
(``UnsupportedTransformers``) rather than taken for one that writes none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import TemplateError

from slime_helper.errors import UnsupportedTransformers

TEMPLATE_CODE = "<template>"
"""The file name jinja2 gives the code it compiles a template from a string into, as transformers compiles chat
templates."""
PROBE_QUESTION = {"role": "user", "content": "Where are the pears?"}
PROBE_CALLS = [{"type": "function", "function": {"name": "find_crate", "arguments": {"name": "pears"}}}]
CALL_CONTENTS = ("", None)
"""What a reply that only calls tools may hold as its content: slime's adapter records ``""``; DeepSeek-V3's template
renders the calls only of a reply whose content is None."""
PROBE_REASONING = "⟦reasoning⟧"
"""The reasoning of a probe reply, where the template writes a latest reply's reasoning."""
_OPENING_TAG = re.compile(r"\s*<([^<>/\s]+)>\s*")
_NONE_KEPT = "{{ 'kept' if 'content' in messages[0] else 'dropped' }}"


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
    """``tokenizer``'s chat template rendered with ``template_kwargs``. ``string_arguments`` says whether it takes a
    tool call's arguments as JSON text rather than as an object, ``call_content`` what a reply that only calls
    tools must hold as its content for the template to write its calls, and ``writes_calls`` whether it writes a
    tool call at all. Raises UnsupportedTransformers when the template writes no call in any form the installed
    transformers can pass it."""

    def __init__(self, tokenizer: Any, template_kwargs: Mapping[str, Any]):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs)
        self.string_arguments = False
        self.call_content: str | None = ""
        form = self._call_form()
        self.writes_calls = form is not None
        if form is None and not _keeps_none_values(tokenizer):
            import transformers

            raise UnsupportedTransformers(
                f"transformers {transformers.__version__} leaves a message's None-valued keys out of what the chat "
                'template sees, and the model\'s chat template writes no tool call of a reply whose content is "": '
                "it may write them only for content None (DeepSeek-V3's does), which this transformers can't pass "
                "it, so slime_helper can't tell how the template writes the model's tool calls. Run slime with a "
                "transformers that keeps them, as slime's image does (5.12.1)"
            )
        self.call_content, self.string_arguments = form or ("", False)

    def with_kwargs(self, extra: Mapping[str, Any]) -> ChatTemplate:
        """This template rendered with ``extra`` added to its kwargs, in the same call form."""
        other = object.__new__(ChatTemplate)
        other.__dict__.update(self.__dict__)
        other.template_kwargs = {**self.template_kwargs, **extra}
        return other

    def _call_form(self) -> tuple[str | None, bool] | None:
        """The content and argument form (``string_arguments``) under which the template writes the probe call of a
        reply that only calls tools, objects and ``""`` first; None when it writes the call in none."""
        try:
            question = self.text([PROBE_QUESTION], None, generation_prompt=False)
        except TemplateFailed:
            return None
        for content in CALL_CONTENTS:
            for string_arguments in (False, True):
                self.call_content, self.string_arguments = content, string_arguments
                called = {"role": "assistant", "content": "", "tool_calls": PROBE_CALLS}
                try:
                    rendered = self.text([PROBE_QUESTION, called], None, generation_prompt=False)
                except TemplateFailed:
                    continue
                tail = rendered[len(question) :] if rendered.startswith(question) else rendered
                if "find_crate" in tail and "pears" in tail:
                    return content, string_arguments
        return None

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
        """``messages`` with each tool-calling reply in the form the template takes: its arguments as JSON text where
        ``string_arguments``, and its content ``call_content`` where it holds no text."""
        return [self._shaped(message) for message in messages]

    def _shaped(self, message: Mapping[str, Any]) -> dict[str, Any]:
        calls = message.get("tool_calls")
        if not calls:
            return dict(message)
        shaped = dict(message)
        if self.string_arguments:
            shaped["tool_calls"] = [_with_text_arguments(call) for call in calls]
        if not message.get("content"):
            shaped["content"] = self.call_content
        return shaped

    def written_reply(
        self,
        chat: Sequence[Mapping[str, Any]],
        reply: Mapping[str, Any],
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> tuple[str, dict[str, Any]] | None:
        """``reply`` as a model writes it after ``chat``'s generation prompt, to the end of what the template writes
        for its turn, with its reasoning (``PROBE_REASONING``) where the template writes a latest reply's reasoning;
        and the reply's message as it was rendered. Where the generation prompt opens a block that the template's
        render of the finished chat doesn't hold (DeepSeek-R1's and QwQ's ``<think>``), the model closes it after its
        reasoning. None where the template's render of the finished chat continues its generation prompt in neither
        way. Raises TemplateFailed when the template raises."""
        prompt = self.text(chat, tools, generation_prompt=True)
        finished = ""
        for message in ({**reply, "reasoning_content": PROBE_REASONING}, dict(reply)):
            finished = self.text([*chat, message], tools, generation_prompt=False)
            if finished.startswith(prompt):
                return finished[len(prompt) :], message
        tag = prompt.rfind("<")
        opened = _OPENING_TAG.fullmatch(prompt[tag:]) if tag >= 0 and finished.startswith(prompt[:tag]) else None
        if opened is None:
            return None
        close, rest = f"</{opened.group(1)}>", finished[tag:]
        written = PROBE_REASONING + rest if rest.startswith(close) else f"{PROBE_REASONING}\n{close}\n\n{rest}"
        return written, dict(reply)


def _keeps_none_values(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s ``apply_chat_template`` hands a template a message's None-valued keys."""
    try:
        kept = tokenizer.apply_chat_template(
            [{"role": "user", "content": None}], chat_template=_NONE_KEPT, tokenize=False
        )
    except Exception:
        return False
    return kept == "kept"


def _with_text_arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, Mapping) or isinstance(function.get("arguments"), str):
        return dict(call)
    arguments = json.dumps(function.get("arguments") or {}, ensure_ascii=False)
    return {**call, "function": {**function, "arguments": arguments}}
