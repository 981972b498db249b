"""The check that ``--sglang-tool-call-parser`` reads the model's tool calls: a probe call written as the model's chat
template writes it, parsed as slime's adapter parses a reply (slime's ``parse_tool_uses``, SGLang's parser by that
name). A parser that doesn't read it would hand every tool call to the env as text, and every tool-calling episode
would score 0, so the launch is refused before anything plays, naming the SGLang parsers that do read it."""

from __future__ import annotations

import logging
from typing import Any

from slime_helper._slime import slime
from slime_helper.chat_template import CALL_CONTENTS, PROBE_CALLS, PROBE_QUESTION, ChatTemplate, TemplateFailed
from slime_helper.errors import UnreadableToolCalls

logger = logging.getLogger(__name__)

PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "find_crate",
            "description": "Find the shelf a crate is on.",
            "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
        },
    }
]
PROBE_CALL = {"name": "find_crate", "input": {"name": "pears"}}
"""The call the probe writes, as slime's parser reads it back."""


def check_tool_parser(template: ChatTemplate, parser: str) -> None:
    """Raise UnreadableToolCalls unless SGLang's tool-call parser ``parser`` reads a call as ``template`` writes
    it, naming the parsers that do (or saying that none does). A template that writes no tool call leaves nothing
    to check; a warning says so."""
    written = _written_call(template)
    if written is None:
        logger.warning(
            "[slime_helper] the model's chat template writes no tool call, so slime_helper can't check that "
            "--sglang-tool-call-parser %s reads the model's tool calls; if it doesn't, every tool-calling episode "
            "scores 0 (rollout/episode/tool_calls_mean stays 0)",
            parser,
        )
        return
    if _reads(written, parser):
        return
    # slime's parsing logs a traceback for each parser that fails on the probe; only its logger is quieted.
    parsing_log = logging.getLogger(slime().parse_tool_uses.__module__)
    was_disabled, parsing_log.disabled = parsing_log.disabled, True
    try:
        readers = [name for name in _sglang_parsers() if name != parser and _reads(written, name)]
    finally:
        parsing_log.disabled = was_disabled
    fix = (
        f"launch with --sglang-tool-call-parser {readers[0]} (the SGLang parsers that read it: {', '.join(readers)})"
        if readers
        else "SGLang has no tool-call parser that reads it, so slime can't train this model on tool calls"
    )
    raise UnreadableToolCalls(
        f"SGLang's tool-call parser {parser!r} (--sglang-tool-call-parser) doesn't read the model's tool calls: a "
        f"call of find_crate with {PROBE_CALL['input']}, written by the model's chat template as {written!r}, comes "
        f"back from it as no such call, so every tool call would reach the env as text and every tool-calling "
        f"episode would score 0. {fix[0].upper()}{fix[1:]}"
    )


def _written_call(template: ChatTemplate) -> str | None:
    """The probe call as ``template`` writes it after the question, its reply's content as the template takes a
    reply that only calls tools; None when the template writes no call (raises, or leaves it out)."""
    for content in CALL_CONTENTS:
        called = {"role": "assistant", "content": content, "tool_calls": PROBE_CALLS}
        try:
            head = template.text([PROBE_QUESTION], PROBE_TOOLS, generation_prompt=False)
            written = template.text([PROBE_QUESTION, called], PROBE_TOOLS, generation_prompt=False)
        except TemplateFailed:
            continue
        tail = written[len(head) :] if written.startswith(head) else written
        if "find_crate" in tail:
            return tail
    return None


def _reads(written: str, parser: str) -> bool:
    """Whether slime's adapter, parsing with ``parser``, reads the probe call back from ``written``."""
    _, uses, _ = slime().parse_tool_uses(written, PROBE_TOOLS, parser)
    return PROBE_CALL in uses


def _sglang_parsers() -> list[str]:
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    parsers: Any = FunctionCallParser.ToolCallParserEnum
    return list(parsers)
