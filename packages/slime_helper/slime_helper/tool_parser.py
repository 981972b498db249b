"""The check that ``--sglang-tool-call-parser`` reads the model's tool calls back as the model meant them: a probe
call with typed, nested and non-ASCII arguments, written as the model's chat template writes it after its generation
prompt, parsed as slime's adapter parses a reply (slime's ``parse_model_output`` with the launch's
``--sglang-reasoning-parser`` and SGLang's tool-call parser by that name), must come back with the same name and
equal arguments. A parser that doesn't read it would hand the env every tool call as text, or with its numbers and
booleans turned into strings (slime's fallback reads any ``<function=…>`` call, every argument a string, whatever
the parser), so the launch is refused before anything plays, naming the SGLang parsers that do read it."""

from __future__ import annotations

import logging
from typing import Any

from slime_helper._slime import slime
from slime_helper.chat_template import PROBE_QUESTION, ChatTemplate, TemplateFailed
from slime_helper.errors import UnreadableToolCalls

logger = logging.getLogger(__name__)

PROBE_ARGUMENTS = {"name": "crème brûlée", "count": 3, "fresh": True, "sizes": ["S", "M"], "where": {"aisle": 9}}
"""The probe call's arguments: a string with non-ASCII letters, an integer, a boolean, a list and an object."""
PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add_crate",
            "description": "Add a crate to the warehouse.",
            "parameters": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "count": {"type": "integer"},
                    "fresh": {"type": "boolean"},
                    "sizes": {"type": "array", "items": {"type": "string"}},
                    "where": {"type": "object", "properties": {"aisle": {"type": "integer"}}},
                },
                "required": ["name", "count"],
            },
        },
    }
]
PROBE_CALL = {"name": "add_crate", "input": PROBE_ARGUMENTS}
"""The call the probe writes, as slime's parser reads it back."""


def check_tool_parser(template: ChatTemplate, parser: str, reasoning_parser: str | None) -> None:
    """Raise UnreadableToolCalls unless SGLang's tool-call parser ``parser``, after the reasoning parser
    ``reasoning_parser`` (None: none), reads the probe call back from what ``template`` writes for it, naming the
    parsers that do (or saying that none does), or the reasoning parser where the call comes back without it. A
    template that writes no tool call leaves nothing to check; a warning says so."""
    written = _written_call(template)
    if written is None:
        logger.warning(
            "[slime_helper] the model's chat template writes no tool call, so slime_helper can't check that "
            "--sglang-tool-call-parser %s reads the model's tool calls; if it doesn't, every tool-calling episode "
            "scores 0 (rollout/episode/tool_calls_mean stays 0)",
            parser,
        )
        return
    read = _read(written, parser, reasoning_parser)
    if read == [PROBE_CALL]:
        return
    after = f" after --sglang-reasoning-parser {reasoning_parser}" if reasoning_parser else ""
    came_back = f"as {_calls(read)}" if read else "as no call at all"
    if reasoning_parser and _reads_back(written, parser, None):
        raise UnreadableToolCalls(
            f"SGLang's reasoning parser {reasoning_parser!r} (--sglang-reasoning-parser) takes the model's tool calls "
            f"for its reasoning: a call of add_crate with {PROBE_ARGUMENTS}, written by the model's chat template as "
            f"{written!r}, comes back from --sglang-tool-call-parser {parser}{after} {came_back}, and whole without "
            "it. Launch with the reasoning parser of the model (README's models table), or none"
        )
    # slime's parsing logs a traceback for each parser that fails on the probe; only its logger is quieted.
    parsing_log = logging.getLogger(slime().parse_model_output.__module__)
    was_disabled, parsing_log.disabled = parsing_log.disabled, True
    try:
        readers = [
            name for name in _sglang_parsers() if name != parser and _reads_back(written, name, reasoning_parser)
        ]
    finally:
        parsing_log.disabled = was_disabled
    fix = (
        f"launch with --sglang-tool-call-parser {readers[0]} (the SGLang parsers that read it back: "
        f"{', '.join(readers)})"
        if readers
        else "SGLang has no tool-call parser that reads it, so slime can't train this model on tool calls"
    )
    raise UnreadableToolCalls(
        f"SGLang's tool-call parser {parser!r} (--sglang-tool-call-parser) doesn't read the model's tool calls: a "
        f"call of add_crate with {PROBE_ARGUMENTS}, written by the model's chat template as {written!r}, comes back "
        f"from it{after} {came_back}, so the env would get the model's tool calls as text or with other arguments. "
        f"{fix[0].upper()}{fix[1:]}"
    )


def _written_call(template: ChatTemplate) -> str | None:
    """The probe call as a model writes it after the question's generation prompt, as ``template`` writes it; None
    when the template writes no call (or raises on it)."""
    if not template.writes_calls:
        return None
    function = {"name": "add_crate", "arguments": PROBE_ARGUMENTS}
    called = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": function}]}
    try:
        written = template.written_reply([PROBE_QUESTION], called, PROBE_TOOLS)
    except TemplateFailed:
        return None
    return written[0] if written is not None and "add_crate" in written[0] else None


def _reads_back(written: str, parser: str, reasoning_parser: str | None) -> bool:
    return _read(written, parser, reasoning_parser) == [PROBE_CALL]


def _read(written: str, parser: str, reasoning_parser: str | None) -> list[dict[str, Any]]:
    """The tool calls slime's adapter, parsing with ``parser`` after ``reasoning_parser``, reads from ``written``."""
    parsed = slime().parse_model_output(
        written, tools_schema=PROBE_TOOLS, tool_parser_name=parser, reasoning_parser_name=reasoning_parser
    )
    return list(parsed.tool_uses)


def _calls(read: list[dict[str, Any]]) -> str:
    return "; ".join(f"{call.get('name')} with {call.get('input')}" for call in read)


def _sglang_parsers() -> list[str]:
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    parsers: Any = FunctionCallParser.ToolCallParserEnum
    return list(parsers)
