"""The model's chat template as the helper reads it at start, on each family's real tokenizer and template: the
tool-call parser check, which round-trips a call with typed, nested and non-ASCII arguments through slime's own
parsing (each family's own parsers pass it in ``one_sample_test``'s launches); the same answers under a transformers
that leaves None-valued message keys out (as transformers 5.25 does), or a refusal naming it; a later system message
the template can't place rendered where it comes, its whole turn; and the comparison of a prompt with the
template's own render of the whole chat, which names what it allows and refuses anything else, at start too."""

from __future__ import annotations

import copy
import json
import shutil
from types import SimpleNamespace
from typing import Any

import pytest
from slime.utils.processing_utils import load_tokenizer
from slime_helper import AdapterService, UnreadableToolCalls, UnsupportedTransformers
from slime_helper._slime import slime
from slime_helper.chat_template import PROBE_CALLS, PROBE_QUESTION, ChatTemplate
from slime_helper.probe_episodes import PROBE_SYSTEM, PROBE_TOOLS, proven_tokenizer
from slime_helper.renderer import AppendOnlyRenderer, Unappendable
from slime_helper.template_match import ALLOWED_DIFFERENCES, SampledReply, TemplateMismatch, differences
from slime_helper.tokenizers import AppendOnlyTokenizer, turn_session
from slime_helper.tool_parser import check_tool_parser
from test_support import tool_call
from test_support.families import FAMILIES, MINIMAX_M3, Family, family_named, written

NUMBERED_TURNS = (
    "{% for message in messages %}<|im_start|>{{ message.role }} {{ loop.index }}\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n{{ call.function | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {{ messages | length + 1 }}\n"
    "{% endif %}"
)
"""A chat template of Qwen's tokens that numbers each message: what a turn adds renders as after the stand-in reply,
but a later turn's numbers differ from the stand-in's."""


@pytest.fixture
def family_tokenizer(family_checkpoints):
    """Each family's tokenizer, as slime loads it."""
    return lambda family: family_checkpoints(family)[1]


@pytest.fixture
def fresh_slime_check():
    slime.cache_clear()
    yield
    slime.cache_clear()


class DroppingNoneValues:
    """``tokenizer``, whose chat-template call leaves out each message's None-valued keys, as transformers 5.25's
    ``apply_chat_template`` does."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer

    def apply_chat_template(self, conversation: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
        kept = [{key: value for key, value in message.items() if value is not None} for message in conversation]
        return self._tokenizer.apply_chat_template(kept, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


@pytest.mark.parametrize("parser", ["qwen25", "glm47", "deepseekv3", "mistral", "llama3"])
def test_qwen3_5_launched_with_a_parser_that_reads_its_calls_as_strings_is_refused_naming_qwen3_coder(
    parser, launch, family_checkpoints, fresh_slime_check
):
    args = copy.copy(launch())
    args.hf_checkpoint = str(family_checkpoints(family_named("Qwen3.5"))[0])
    args.sglang_tool_call_parser = parser

    with pytest.raises(UnreadableToolCalls) as refused:
        AdapterService.of(args)
    assert f"SGLang's tool-call parser {parser!r} (--sglang-tool-call-parser) doesn't read" in str(refused.value)
    assert "'count': '3', 'fresh': 'True'" in str(refused.value)
    assert "Launch with --sglang-tool-call-parser qwen3_coder" in str(refused.value)


@pytest.mark.parametrize("family", [*FAMILIES, MINIMAX_M3], ids=lambda family: family.name)
def test_under_a_transformers_that_drops_none_values_detection_answers_the_same_or_refuses_naming_it(
    family, family_tokenizer
):
    for mode in family.modes:
        kept = ChatTemplate(family_tokenizer(family), mode.template_kwargs)
        if kept.call_content is None:
            with pytest.raises(UnsupportedTransformers, match=r"transformers \S+ leaves a message's None-valued keys"):
                ChatTemplate(DroppingNoneValues(family_tokenizer(family)), mode.template_kwargs)
            continue
        dropped = ChatTemplate(DroppingNoneValues(family_tokenizer(family)), mode.template_kwargs)

        assert (dropped.call_content, dropped.string_arguments) == (kept.call_content, kept.string_arguments)
        assert proven_tokenizer(dropped)[1] == proven_tokenizer(kept)[1]
        reasoning = family.reasoning_parser if mode.thinks else None
        if family.tool_parser is not None:
            check_tool_parser(dropped, family.tool_parser, reasoning)
    needs_none = any(
        ChatTemplate(family_tokenizer(family), mode.template_kwargs).call_content is None for mode in family.modes
    )
    assert needs_none == (family.name == "DeepSeek-V3")


@pytest.mark.parametrize(
    ("family", "turn"),
    [
        ("Qwen3.5", "<|im_start|>system\nBe brief.<|im_end|>\n"),
        ("Qwen3.6", "<|im_start|>system\nBe brief.<|im_end|>\n"),
        ("DeepSeek-V3", "Be brief."),
        ("DeepSeek-R1", "Be brief."),
        ("MiniMax-M2", "]~b]system\nBe brief.[e~[\n"),
        ("MiniMax-M3", "]~b]developer\nBe brief.[e~[\n"),
    ],
)
def test_a_later_system_message_the_template_refuses_moves_or_drops_is_rendered_where_it_comes_its_whole_turn(
    family, turn, family_tokenizer
):
    renderer = AppendOnlyRenderer.of(ChatTemplate(family_tokenizer(family_named(family)), {}))

    added = renderer.added_text([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go."}])

    assert added.startswith(renderer.end_of_reply + turn)
    assert added.index("Go.") > len(renderer.end_of_reply + turn)


def test_minimax_m2s_later_system_message_without_its_header_differs_from_the_template_unnamed(family_tokenizer):
    template = ChatTemplate(family_tokenizer(family_named("MiniMax-M2")), {})
    renderer = AppendOnlyRenderer(template)
    chat = [
        {"role": "system", "content": "You keep a warehouse."},
        {"role": "user", "content": "Where are the pears?"},
        {"role": "assistant", "content": "On 9C.", "reasoning_content": "Shelf 9C."},
        {"role": "system", "content": "Now answer in French."},
        {"role": "user", "content": "Et les pommes?"},
    ]
    first = template.ids(template.text(chat[:2], None, generation_prompt=True))
    reply = template.ids("Shelf 9C.\n</think>\n\nOn 9C.[e~[")
    held = [*first, *reply]
    with_header = template.ids(
        "\n]~b]system\nNow answer in French.[e~[\n]~b]user\nEt les pommes?[e~[\n]~b]ai\n<think>\n"
    )
    bare = template.ids("\nNow answer in French.]~b]user\nEt les pommes?[e~[\n]~b]ai\n<think>\n")
    place = [SampledReply(len(first), len(held))]

    found = differences(renderer, chat, None, [*held, *with_header], place)
    assert {difference.name for difference in found} == {"earlier_reply_as_sampled", "later_system_message_dropped"}
    assert found <= set(ALLOWED_DIFFERENCES)
    with pytest.raises(TemplateMismatch, match=r"at token \d+ the prompt holds 'Now answer in French\.'"):
        differences(renderer, chat, None, [*held, *bare], place)


def test_a_template_whose_later_turns_differ_from_what_a_turn_adds_is_not_rendered_append_only_saying_where(
    launch, checkpoint, tmp_path, caplog, fresh_slime_check
):
    numbered = shutil.copytree(checkpoint, tmp_path / "Numbered-0.6B")
    config = json.loads((numbered / "tokenizer_config.json").read_text())
    (numbered / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": NUMBERED_TURNS}))
    args = copy.copy(launch(thinking=False))
    args.hf_checkpoint = str(numbered)

    service = AdapterService.of(args)

    assert not service.append_only
    assert "THE CHAT TEMPLATE OF Numbered-0.6B CAN'T BE RENDERED APPEND-ONLY" in caplog.text
    assert "differs from its own render of the whole chat: at token" in caplog.text
    with pytest.raises(
        Unappendable, match=r"then a reply followed by a user message differs .* at token \d+ the prompt"
    ):
        proven_tokenizer(ChatTemplate(load_tokenizer(str(numbered)), {}))


def test_the_start_log_names_the_differences_the_probe_episodes_showed(launch, caplog, fresh_slime_check):
    AdapterService.of(launch(thinking=False))

    assert (
        "Probe episodes match the template's own render of their whole chats token for token, but for these "
        "differences: earlier_reply_as_sampled (the prompt holds each earlier reply as the model sampled it"
    ) in caplog.text


def two_rounds(
    family: Family, tokenizer: Any, answers: tuple[str, str]
) -> tuple[list[dict[str, Any]], list[int], list]:
    """A probe episode of two rounds of tool calls rendered append-only for ``family``, its replies as the family
    writes them and its calls answered ``answers``: its chat, the prompt after the second answer, and where its
    replies lie in that prompt."""
    template = ChatTemplate(tokenizer, {})
    appended = AppendOnlyTokenizer(AppendOnlyRenderer.of(template))
    call = tool_call("find_crate", {"name": "pears"})
    output = template.ids(written(tokenizer, family, family.modes[0], call))
    message = {"role": "assistant", "content": "", "tool_calls": PROBE_CALLS}
    chat: list[dict[str, Any]] = [PROBE_SYSTEM, PROBE_QUESTION]
    bound = turn_session.set("rounds")
    appended.open("rounds")
    try:
        prompt = appended.apply_chat_template(chat, tools=PROBE_TOOLS)
        places = []
        for answer in answers:
            appended.record("rounds", chat, PROBE_TOOLS, message, SimpleNamespace(prompt_ids=prompt, output_ids=output))
            places.append(SampledReply(len(prompt), len(prompt) + len(output)))
            chat = [*chat, message, {"role": "tool", "content": answer}]
            prompt = appended.apply_chat_template(chat, tools=PROBE_TOOLS)
        return chat, prompt, places
    finally:
        turn_session.reset(bound)


def test_a_later_tool_round_may_differ_only_by_the_templates_own_writing_never_by_an_answer(family_tokenizer):
    deepseek_v3 = family_named("DeepSeek-V3")
    tokenizer = family_tokenizer(deepseek_v3)
    renderer = AppendOnlyRenderer(ChatTemplate(tokenizer, {}))
    chat, prompt, places = two_rounds(deepseek_v3, tokenizer, ("Shelf 9C.", "Shelf 4B."))
    _, misread, _ = two_rounds(deepseek_v3, tokenizer, ("Shelf 9C.", "Shelf 4C."))

    found = differences(renderer, chat, PROBE_TOOLS, prompt, places)

    assert {difference.name for difference in found} == {"earlier_reply_as_sampled", "later_tool_round_opened"}
    with pytest.raises(TemplateMismatch, match="at token"):
        differences(renderer, chat, PROBE_TOOLS, misread, places)


def test_a_reasoning_parser_that_takes_the_models_tool_calls_for_reasoning_is_refused_naming_it(family_tokenizer):
    glm_thinking_off = ChatTemplate(family_tokenizer(family_named("GLM-4.7-Flash")), {"enable_thinking": False})

    with pytest.raises(UnreadableToolCalls) as refused:
        check_tool_parser(glm_thinking_off, "glm47", "deepseek-r1")
    assert str(refused.value).startswith(
        "SGLang's reasoning parser 'deepseek-r1' (--sglang-reasoning-parser) takes the model's tool calls for its "
        "reasoning"
    )
    check_tool_parser(glm_thinking_off, "glm47", "glm45")
