"""A prompt of the append-only rendering against the chat template's own render of the whole chat, token for token.

The two may differ only in the ways ``ALLOWED_DIFFERENCES`` names, each with its reason; anything else is an error of
the rendering, raised as ``TemplateMismatch`` with the first place they part. The template renders with its own
switch to keep earlier replies' reasoning where it has one (GLM's ``clear_thinking: false``), so that only templates
without one differ there. The helper checks the probe episodes it plays at start with it
(``slime_helper.probe_episodes``), and the slime tier every prompt of every episode it plays.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any

from slime_helper.chat_template import ChatTemplate, TemplateFailed
from slime_helper.renderer import AppendOnlyRenderer, Unappendable


@dataclass(frozen=True)
class Difference:
    """A way a prompt of the append-only rendering may differ from the template's own render of its chat: its
    ``name`` and the ``reason`` it is allowed."""

    name: str
    reason: str


EARLIER_REPLY_AS_SAMPLED = Difference(
    "earlier_reply_as_sampled",
    "the prompt holds each earlier reply as the model sampled it, after the end of the prompt it was sampled from as "
    "the model read it, which is what the model read at its next turn and what slime trains on; the template renders "
    "them again from the messages slime recorded, and most write them otherwise once the reply follows: without the "
    "reply's reasoning, or without the empty reasoning of the generation prompt (Qwen3, Qwen3.5, Qwen3.6, DeepSeek, "
    "MiniMax-M2, QwQ, which have no switch to keep it), or with its tool calls wrapped otherwise and the tool answers "
    "before them left open (DeepSeek-V3, DeepSeek-R1). Each prompt's own end is checked token for token where it is "
    "the last",
)
LATER_SYSTEM_MESSAGE_MOVED = Difference(
    "later_system_message_moved",
    "the template moves a system message after the first to the top of the chat (DeepSeek); the env sent it for "
    "the model to read at that point of the episode, so it is rendered where it comes, as the template renders a "
    "system message that opens a chat",
)
LATER_SYSTEM_MESSAGE_DROPPED = Difference(
    "later_system_message_dropped",
    "the template leaves out a system message after the first (MiniMax-M2, MiniMax-M3); the env sent it for the model "
    "to read, so it is rendered where it comes, as the template renders a system message that opens a chat, its "
    "header included",
)
LATER_SYSTEM_MESSAGE_REFUSED = Difference(
    "later_system_message_refused",
    "the template raises on a system message after the first (Qwen3.5, Qwen3.6); the env sent it for the model to "
    "read, so it is rendered where it comes, as the template renders a system message that opens a chat, and the "
    "rest of the prompt is compared with the template's render of the chat without it",
)
LATER_TOOL_ROUND_OPENED = Difference(
    "later_tool_round_opened",
    "the template opens the blocks of tool calls and of tool answers only in a chat's first round of tool calls "
    "(DeepSeek-V3 and DeepSeek-R1 set a flag once per chat) and writes a later round into the first round's blocks, "
    "after they ended; the model writes a later round's calls as it writes a first round's, and the prompt opens that "
    "round's answers as the template opens a first round's",
)
ALLOWED_DIFFERENCES = (
    EARLIER_REPLY_AS_SAMPLED,
    LATER_TOOL_ROUND_OPENED,
    LATER_SYSTEM_MESSAGE_MOVED,
    LATER_SYSTEM_MESSAGE_DROPPED,
    LATER_SYSTEM_MESSAGE_REFUSED,
)
"""Every way a prompt may differ from the template's render of its whole chat, each with its reason."""
REASONING_KEPT = {"clear_thinking": False}
"""The template kwargs that keep earlier replies' reasoning, by the name a template reads them under."""
_STAND_IN_SYSTEM = {"role": "system", "content": "⟦stand-in system⟧"}
_STAND_IN_USER = {"role": "user", "content": "⟦stand-in user⟧"}
_STAND_IN_CALL = {"type": "function", "function": {"name": "stand_in", "arguments": {}}}


class TemplateMismatch(Exception):
    """A prompt differs from the template's own render of its whole chat otherwise than ``ALLOWED_DIFFERENCES``
    allow; the message says where and how."""


@dataclass(frozen=True)
class SampledReply:
    """Where an earlier reply lies in a prompt: ``start``, its first sampled token, and ``end``, past its last."""

    start: int
    end: int


def differences(
    renderer: AppendOnlyRenderer,
    chat: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    prompt: Sequence[int],
    replies: Sequence[SampledReply],
) -> frozenset[Difference]:
    """The allowed differences between ``prompt``, the append-only rendering's prompt for the reply to ``chat`` with
    ``tools``, and the tokens of the template's own render of that chat with its generation prompt; ``replies`` says
    where each of the chat's assistant messages lies in ``prompt``, in order. Raises TemplateMismatch when they
    differ otherwise.

    Where the chat holds system messages after the first that the template doesn't render where they come, the
    prompt is compared with the template's render of the chat without them, and must hold each where it comes, as
    the template renders a system message opening a chat; and the template's render of the whole chat must differ
    from that render only in the way named: it raises (refused), it is the same (dropped), or it holds only their
    contents more, at the top (moved)."""
    template = _keeping_reasoning(renderer.template)
    ours = list(prompt)
    later_system = [at for at, message in enumerate(chat) if at > 0 and message.get("role") == "system"]
    without = [message for at, message in enumerate(chat) if at not in later_system]
    try:
        whole: str | None = template.text(chat, tools, generation_prompt=True)
    except TemplateFailed as failed:
        if not later_system:
            raise TemplateMismatch(f"the template raises on the whole chat: {failed}") from None
        whole = None
    spans = _reply_spans(template, without, tools, replies)
    regions: list[_Region] = [_Region(start, end, EARLIER_REPLY_AS_SAMPLED) for start, end in spans]
    regions += _later_tool_rounds(template, without, spans, len(ours))
    parting = ""
    if whole is not None:
        theirs = template.ids(whole)
        if ours == theirs:
            return frozenset()
        unnamed, _, found = _compared(renderer, chat, (), regions, spans, ours, theirs)
        if unnamed is None:
            return frozenset(found)
        parting = _parting(template, ours, theirs, *unnamed)
        if not later_system:
            raise TemplateMismatch(parting)
    try:
        reference = template.text(without, tools, generation_prompt=True)
    except TemplateFailed as failed:
        raise TemplateMismatch(f"the template raises on the chat without its later system messages: {failed}") from None
    theirs = template.ids(reference)
    unnamed, placed, found = _compared(renderer, chat, later_system, regions, spans, ours, theirs)
    if unnamed is not None:
        raise TemplateMismatch(parting or _parting(template, ours, theirs, *unnamed))
    if missing := [at for at in later_system if at not in placed]:
        raise TemplateMismatch(
            f"the prompt doesn't hold the chat's message {missing[0]}, a system message, where it comes, as the "
            "template renders one opening a chat"
        )
    handling = LATER_SYSTEM_MESSAGE_REFUSED if whole is None else _system_handling(whole, reference, chat, later_system)
    if handling is None:
        raise TemplateMismatch(parting)
    return frozenset({handling, *found})


@dataclass(frozen=True)
class _Region:
    """Tokens ``start:end`` of a prompt, where it may differ from the template's render as ``difference`` names:
    in any way, or, with ``markup``, only by text that each of its strings may hold (the template's own writing,
    no message's content)."""

    start: int
    end: int
    difference: Difference
    markup: tuple[str, ...] = ()

    def allows(
        self, template: ChatTemplate, ours: Sequence[int], theirs: Sequence[int], i1: int, i2: int, j1: int, j2: int
    ) -> bool:
        if not (self.start <= i1 and i2 <= self.end):
            return False
        decode = template.tokenizer.decode
        texts = (decode(list(ours[i1:i2])), decode(list(theirs[j1:j2])))
        return not self.markup or all(any(text in markup for markup in self.markup) for text in texts)


def _compared(
    renderer: AppendOnlyRenderer,
    chat: Sequence[Mapping[str, Any]],
    later_system: Sequence[int],
    regions: Sequence[_Region],
    spans: Sequence[tuple[int, int]],
    ours: Sequence[int],
    theirs: Sequence[int],
) -> tuple[tuple[int, int, int, int] | None, set[int], set[Difference]]:
    """Where ``ours`` first differs from ``theirs`` otherwise than by holding one of the ``later_system`` messages'
    opening-chat turn where it comes, or inside one of ``regions`` as it allows (None when nowhere); which of those
    messages it holds so; and the differences of the regions it differs in."""
    placed: set[int] = set()
    found: set[Difference] = set()
    template = renderer.template
    for tag, i1, i2, j1, j2 in SequenceMatcher(None, ours, theirs, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        deleted = _system_turn_deleted(renderer, chat, later_system, spans, ours, i1, i2) if tag == "delete" else None
        if deleted is not None and deleted not in placed:
            placed.add(deleted)
            continue
        inside = next((region for region in regions if region.allows(template, ours, theirs, i1, i2, j1, j2)), None)
        if inside is None:
            return (i1, i2, j1, j2), placed, found
        found.add(inside.difference)
    return None, placed, found


def _later_tool_rounds(
    template: ChatTemplate, chat: Sequence[Mapping[str, Any]], spans: Sequence[tuple[int, int]], size: int
) -> list[_Region]:
    """Where a template that writes a chat's later round of tool calls otherwise than its first may differ, by its
    own writing around tool calls and answers only: from each later tool-calling reply's span to the next reply's
    (or the prompt's end, ``size``)."""
    calling = [bool(message.get("tool_calls")) for message in chat if message.get("role") == "assistant"]
    markup = _later_round_markup(template) if sum(calling) > 1 else None
    if markup is None:
        return []
    later = [at for at, calls in enumerate(calling) if calls][1:]
    return [
        _Region(spans[at][0], spans[at + 1][0] if at + 1 < len(spans) else size, LATER_TOOL_ROUND_OPENED, markup)
        for at in later
    ]


def _later_round_markup(template: ChatTemplate) -> tuple[str, str] | None:
    """What ``template`` writes from a tool call's name on, through its answer, when it is a chat's first round of
    tool calls and when an earlier round came before it; None when it writes both alike."""
    call = {"role": "assistant", "content": "", "tool_calls": [_STAND_IN_CALL]}
    head = [_STAND_IN_SYSTEM, _STAND_IN_USER]
    one = template.text([*head, call, _answer("⟦last⟧")], None, generation_prompt=True)
    two = template.text([*head, call, _answer("⟦first⟧"), call, _answer("⟦last⟧")], None, generation_prompt=True)
    first, later = one[one.rindex("stand_in") :], two[two.rindex("stand_in") :]
    return None if first == later else (first, later)


def _answer(content: str) -> dict[str, Any]:
    return {"role": "tool", "content": content}


def _system_handling(
    whole: str, reference: str, chat: Sequence[Mapping[str, Any]], later_system: Sequence[int]
) -> Difference | None:
    """How the template's render of the whole chat, ``whole``, differs from ``reference``, its render without the
    ``later_system`` messages: not at all (dropped), or by their contents alone, and whitespace, inserted ahead of
    the first user message (moved); None otherwise."""
    if whole == reference:
        return LATER_SYSTEM_MESSAGE_DROPPED
    shared = _common_prefix(whole, reference)
    if not whole.endswith(reference[shared:]):
        return None
    inserted = whole[shared : len(whole) - len(reference) + shared]
    for at in later_system:
        inserted = inserted.replace(str(chat[at].get("content") or "").strip(), "", 1)
    first_user = next((str(m.get("content") or "") for m in chat if m.get("role") == "user"), "")
    ahead = not first_user or shared <= reference.find(first_user)
    return LATER_SYSTEM_MESSAGE_MOVED if ahead and not inserted.strip() else None


def _keeping_reasoning(template: ChatTemplate) -> ChatTemplate:
    """``template`` with its own switch to keep earlier replies' reasoning turned on, where it has one."""
    source = template.tokenizer.chat_template
    text = " ".join(source.values()) if isinstance(source, Mapping) else str(source or "")
    switches = {name: value for name, value in REASONING_KEPT.items() if name in text}
    return template.with_kwargs(switches) if switches else template


def _reply_spans(
    template: ChatTemplate,
    chat: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    replies: Sequence[SampledReply],
) -> list[tuple[int, int]]:
    """For each earlier reply, the tokens from the first of its prompt the template renders otherwise once the reply
    follows (its generation prompt's first at the latest) to past its last sampled one."""
    assistant = [at for at, message in enumerate(chat) if message.get("role") == "assistant"]
    if len(assistant) != len(replies):
        raise ValueError(f"the chat holds {len(assistant)} replies, and {len(replies)} were placed in the prompt")
    spans = []
    for at, reply in zip(assistant, replies, strict=True):
        before = template.text(chat[:at], tools, generation_prompt=False)
        opened = template.text(chat[:at], tools, generation_prompt=True)
        answered = template.ids(template.text(chat[: at + 1], tools, generation_prompt=False))
        opened_ids = template.ids(opened)
        generation_prompt = len(template.ids(opened[len(before) :])) if opened.startswith(before) else 0
        rendered_otherwise = len(opened_ids) - _common_prefix(opened_ids, answered)
        spans.append((reply.start - max(generation_prompt, rendered_otherwise), reply.end))
    return spans


def _system_turn_deleted(
    renderer: AppendOnlyRenderer,
    chat: Sequence[Mapping[str, Any]],
    later_system: Sequence[int],
    spans: Sequence[tuple[int, int]],
    ours: Sequence[int],
    i1: int,
    i2: int,
) -> int | None:
    """The later system message whose opening-chat turn ``ours[i1:i2]`` is, or that run slid along tokens that
    repeat around it, where it comes in the prompt: after the reply before it and before the one after it."""
    for at in later_system:
        earlier = sum(1 for message in chat[:at] if message.get("role") == "assistant")
        low = spans[earlier - 1][1] if earlier else 0
        high = spans[earlier][0] if earlier < len(spans) else len(ours)
        try:
            turn = renderer.template.ids(renderer.opening_system_turn(chat[at]))
        except (Unappendable, TemplateFailed):
            continue
        if any(low <= a and b <= high and list(ours[a:b]) == turn for a, b in _slid(ours, i1, i2)):
            return at
    return None


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    size = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        size += 1
    return size


def _slid(tokens: Sequence[int], i1: int, i2: int) -> Iterator[tuple[int, int]]:
    """The runs of ``tokens`` of ``i1:i2``'s length whose removal leaves the same tokens as removing ``i1:i2``."""
    while i1 > 0 and tokens[i1 - 1] == tokens[i2 - 1]:
        i1, i2 = i1 - 1, i2 - 1
    yield i1, i2
    while i2 < len(tokens) and tokens[i1] == tokens[i2]:
        i1, i2 = i1 + 1, i2 + 1
        yield i1, i2


def _parting(
    template: ChatTemplate, ours: Sequence[int], theirs: Sequence[int], i1: int, i2: int, j1: int, j2: int
) -> str:
    """Where and how the prompt and the template's render part."""
    decode = template.tokenizer.decode
    return (
        f"at token {i1} the prompt holds {decode(list(ours[i1:i2]))!r} where the template's own render of the whole "
        f"chat holds {decode(list(theirs[j1:j2]))!r} (after {decode(list(ours[max(0, i1 - 12) : i1]))!r})"
    )
