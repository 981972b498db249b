"""The append-only rendering proven at start: short probe episodes played through the adapter's own
``AppendOnlyTokenizer``, each a question, then replies as the model writes them, each followed by what a turn adds
(one of the renderer's ``PROBES``: tool answers, a user message, a later system prompt; or two rounds of tool calls,
or of user messages),
and each later prompt compared token for token with the template's own render of the whole chat
(``slime_helper.template_match``). A template whose prompts differ otherwise than the allowed differences is not
rendered append-only, and the start log says where they part."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slime_helper.chat_template import PROBE_QUESTION, ChatTemplate, TemplateFailed
from slime_helper.renderer import PROBES, AppendOnlyRenderer, Unappendable
from slime_helper.template_match import Difference, SampledReply, TemplateMismatch, differences
from slime_helper.tokenizers import AppendOnlyTokenizer, turn_session

PROBE_SYSTEM = {"role": "system", "content": "You keep a warehouse."}
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
_CALL = {"type": "function", "function": {"name": "find_crate", "arguments": {"name": "pears"}}}
EPISODES: tuple[tuple[Sequence[Mapping[str, Any]], ...], ...] = (
    *((added,) for added in PROBES),
    ([{"role": "tool", "content": "Shelf 9C."}], [{"role": "tool", "content": "Shelf 4B."}]),
    ([{"role": "user", "content": "And the apples?"}], [{"role": "user", "content": "And the plums?"}]),
)
"""The probe episodes: what each turn adds after the model's reply, which makes a tool call for each tool answer
that follows it."""


@dataclass(frozen=True)
class _SampledTurn:
    """A probe turn as slime's adapter records it: the prompt's and the reply's token ids."""

    prompt_ids: list[int]
    output_ids: list[int]


def proven_tokenizer(
    template: ChatTemplate, max_context_tokens: int = 0
) -> tuple[AppendOnlyTokenizer, frozenset[Difference]]:
    """The adapter's append-only tokenizer for ``template``, refusing a prompt of ``max_context_tokens`` or more (no
    limit when 0), once every probe episode's later prompt matched the template's own render of its chat, token for
    token; and the allowed differences they showed. Raises
    Unappendable, saying why, when the template can't render a turn's messages after a reply, or a prompt differs
    otherwise."""
    renderer = AppendOnlyRenderer.of(template)
    tokenizer = AppendOnlyTokenizer(renderer)
    found: set[Difference] = set()
    for at, turns in enumerate(EPISODES):
        try:
            found |= _played(tokenizer, renderer, turns, f"slime-helper-probe-{at}")
        except TemplateMismatch as mismatch:
            raise Unappendable(
                f"its prompt after {_described(turns)} differs from its own render of the whole chat: {mismatch}"
            ) from None
        except TemplateFailed as failed:
            raise Unappendable(f"it raises on a probe chat: {failed}") from None
    return AppendOnlyTokenizer(renderer, max_context_tokens), frozenset(found)


def _played(
    tokenizer: AppendOnlyTokenizer,
    renderer: AppendOnlyRenderer,
    turns: Sequence[Sequence[Mapping[str, Any]]],
    sid: str,
) -> frozenset[Difference]:
    """The allowed differences of a probe episode played in session ``sid``: the question, then for each of
    ``turns`` a reply (making a tool call for each tool answer the turn opens with) and what the turn adds."""
    template = renderer.template
    tokenizer.open(sid)
    bound = turn_session.set(sid)
    try:
        chat: list[Mapping[str, Any]] = [PROBE_SYSTEM, PROBE_QUESTION]
        prompt = tokenizer.apply_chat_template(chat, tools=PROBE_TOOLS)
        places: list[SampledReply] = []
        found: set[Difference] = set()
        for added in turns:
            calls = next((at for at, message in enumerate(added) if message.get("role") != "tool"), len(added))
            reply: dict[str, Any] = {"role": "assistant", "content": "The pears are on shelf 9C."}
            if calls:
                reply = {"role": "assistant", "content": "", "tool_calls": [_CALL] * calls}
            written = template.written_reply(chat, reply, PROBE_TOOLS)
            if written is None:
                raise Unappendable("its render of a finished chat doesn't continue its generation prompt")
            text, message = written
            output = _sampled(tokenizer, renderer, template.ids(text))
            tokenizer.record(sid, list(chat), PROBE_TOOLS, message, _SampledTurn(list(prompt), output))
            places.append(SampledReply(len(prompt), len(prompt) + len(output)))
            chat = [*chat, message, *added]
            prompt = tokenizer.apply_chat_template(chat, tools=PROBE_TOOLS)
            if not_appended := tokenizer.turns_not_appended(sid):
                raise Unappendable(not_appended[0].why)
            found |= differences(renderer, chat, PROBE_TOOLS, prompt, places)
        return frozenset(found)
    finally:
        turn_session.reset(bound)
        tokenizer.forget(sid)


def _sampled(tokenizer: AppendOnlyTokenizer, renderer: AppendOnlyRenderer, written: list[int]) -> list[int]:
    """``written``, a reply's turn as the template writes it, as a model samples it: up to the token it stops on,
    the one that opens the template's end of a reply (Qwen's ``<|im_end|>``), without the whitespace the template
    writes after it; where the template writes no such token after a reply (DeepSeek-V3's after a tool call), the
    model still stops on it."""
    special = set(tokenizer.get_added_vocab().values())
    if len(written) > 1 and written[-2] in special and not tokenizer.decode(written[-1:]).strip():
        written = written[:-1]
    end = renderer.template.ids(renderer.end_of_reply)
    stop = end[:1] if end and end[0] in special else []
    return written if written[-len(stop) :] == stop or not stop else [*written, *stop]


def _described(turns: Sequence[Sequence[Mapping[str, Any]]]) -> str:
    return ", then ".join(
        "a reply followed by " + ", ".join(f"a {message.get('role')} message" for message in added) for added in turns
    )
