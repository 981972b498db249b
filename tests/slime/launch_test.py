"""slime launched with this project's hooks: its own ``parse_args`` takes them, its loaders find them, and the
helper checks the slime it runs on and the tool-call parser against the model's chat template, renders a chat
append-only where the template allows it unless told not to, says loudly where it doesn't, and carries the chat
template kwargs into the adapter either way. The template checks themselves, family by family, are
``template_test``'s."""

from __future__ import annotations

import copy
import inspect
import json
import logging
import shutil
import urllib.request

import pins
import pytest
from rollout import SAMPLE_PER_TURN
from slime.agent.adapters import OpenAIAdapter
from slime.agent.adapters.common import BaseAdapter
from slime.utils.misc import load_function
from slime.utils.processing_utils import load_tokenizer
from slime_helper import (
    AdapterService,
    UnappendableChat,
    UnreadableToolCalls,
    UnsupportedSlime,
    generate,
    keep_scored_groups,
    normalize_per_episode,
)
from slime_helper._slime import SUPPORTED_SLIME, slime
from slime_helper.chat_template import ChatTemplate, TemplateFailed
from test_support.checkpoint import family_checkpoint
from test_support.families import MINIMAX_M3, family_named

THINKING_OFF_OPENING = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
EARLIER_REPLIES_HIDDEN = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.role == 'assistant' and not loop.last %}(an earlier reply){% else %}{{ message.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A chat template of Qwen's tokens that writes no tool call and renders a reply otherwise once anything follows it,
so that no turn can be rendered append-only."""
GLM_4_7 = family_named("GLM-4.7-Flash")


@pytest.fixture
def fresh_slime_check():
    """The helper's check of slime runs again in the test, and again after it."""
    slime.cache_clear()
    yield
    slime.cache_clear()


def test_slime_parses_a_realistic_launch_naming_the_helper(launch):
    args = launch(thinking=False)

    assert load_function(args.custom_generate_function_path) is generate
    assert load_function(args.dynamic_sampling_filter_path) is keep_scored_groups
    assert (args.input_key, args.metadata_key) == ("messages", "metadata")
    assert args.sglang_tool_call_parser == "qwen25"
    assert args.apply_chat_template_kwargs == {"enable_thinking": False}
    assert "evaluation" in inspect.signature(generate).parameters
    assert load_function(args.custom_reward_post_process_path) is normalize_per_episode


def test_the_helper_names_the_pinned_slime_as_the_one_it_works_with():
    assert pins.PINS["slime"]["commit"] == SUPPORTED_SLIME


def test_a_slime_lacking_what_the_helper_uses_is_refused_naming_it_and_the_pinned_commit(
    monkeypatch, fresh_slime_check
):
    async def finish_session(self, sid):
        return []

    def build_reply(self, parsed):
        return None

    monkeypatch.setattr(BaseAdapter, "finish_session", finish_session)
    monkeypatch.setattr(OpenAIAdapter, "_build_reply", build_reply)
    with pytest.raises(UnsupportedSlime) as refused:
        slime()
    assert "OpenAIAdapter.finish_session(base_sample=…)" in str(refused.value)
    assert "OpenAIAdapter.finish_session(extra_metadata=…)" in str(refused.value)
    assert "OpenAIAdapter._build_reply(tools_schema=…)" in str(refused.value)
    assert SUPPORTED_SLIME in str(refused.value)


def test_a_qwen3_template_is_rendered_append_only_its_first_prompt_as_the_template_renders_it(
    launch, tokenizer, fresh_slime_check
):
    service = AdapterService.of(launch(thinking=False))
    chat = [{"role": "system", "content": "You keep a warehouse."}, {"role": "user", "content": "Hello"}]
    tools = [{"type": "function", "function": {"name": "find_crate", "description": "Find it.", "parameters": {}}}]

    assert service.append_only
    stock = tokenizer.apply_chat_template(chat, tools=tools, add_generation_prompt=True, enable_thinking=False)
    assert service.adapter.tokenizer.apply_chat_template(chat, tools=tools) == list(stock.get("input_ids", stock))
    assert tokenizer.decode(stock.get("input_ids", stock)).endswith(THINKING_OFF_OPENING)


def test_with_the_setting_off_the_adapter_gets_the_chat_template_kwargs_through_the_tokenizer(
    launch, fresh_slime_check
):
    service = AdapterService.of(launch(thinking=False, config=SAMPLE_PER_TURN))

    assert not service.append_only
    rendered = service.adapter.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith(THINKING_OFF_OPENING)


def with_template(checkpoint, folder, template: str):
    """A copy of ``checkpoint`` in ``folder`` whose tokenizer has the chat template ``template``."""
    other = shutil.copytree(checkpoint, folder)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    return other


def test_a_template_that_cant_be_rendered_append_only_is_said_loudly_and_rendered_whole(
    launch, checkpoint, tmp_path, caplog, fresh_slime_check
):
    args = copy.copy(launch(thinking=False))
    args.hf_checkpoint = str(with_template(checkpoint, tmp_path / "Hidden-0.6B", EARLIER_REPLIES_HIDDEN))

    service = AdapterService.of(args)

    assert not service.append_only
    assert "THE CHAT TEMPLATE OF Hidden-0.6B CAN'T BE RENDERED APPEND-ONLY" in caplog.text
    assert "writes no tool call, so slime_helper can't check that --sglang-tool-call-parser qwen25" in caplog.text


def test_the_append_only_setting_true_refuses_a_template_that_cant_be_rendered_append_only(
    launch, checkpoint, tmp_path, fresh_slime_check
):
    args = copy.copy(launch(thinking=False))
    args.hf_checkpoint = str(with_template(checkpoint, tmp_path / "Hidden-0.6B", EARLIER_REPLIES_HIDDEN))
    args.episode_append_only_chat = True

    with pytest.raises(UnappendableChat, match="episode_append_only_chat is true, but the chat template of Hidden"):
        AdapterService.of(args)


def test_the_adapters_served_endpoint_writes_no_access_log_line_per_request(launch, caplog):
    service = AdapterService.of(launch())
    caplog.set_level(logging.INFO, logger="aiohttp.access")

    for _ in range(2):
        with urllib.request.urlopen(service.chat_url.removesuffix("/v1/chat/completions") + "/healthz") as answer:
            assert answer.status == 200

    assert [record for record in caplog.records if record.name == "aiohttp.access"] == []


def test_the_start_log_says_which_rendering_the_launch_uses(launch, caplog, fresh_slime_check):
    AdapterService.of(launch(thinking=False))

    assert "chat rendering: append-only, from the chat template of Qwen3-0.6B" in caplog.text


def test_a_tool_parser_that_cant_read_the_models_tool_calls_is_refused_naming_one_that_can(
    launch, tmp_path, fresh_slime_check
):
    args = copy.copy(launch())
    args.hf_checkpoint = str(family_checkpoint(tmp_path / "GLM-4.7-Flash", GLM_4_7))

    with pytest.raises(UnreadableToolCalls) as refused:
        AdapterService.of(args)
    assert "SGLang's tool-call parser 'qwen25' (--sglang-tool-call-parser) doesn't read the model's tool calls" in (
        str(refused.value)
    )
    assert "Launch with --sglang-tool-call-parser glm47" in str(refused.value)


def test_a_model_whose_tool_calls_no_sglang_parser_reads_is_refused_saying_so(launch, tmp_path, fresh_slime_check):
    args = copy.copy(launch())
    args.hf_checkpoint = str(family_checkpoint(tmp_path / "MiniMax-M3", MINIMAX_M3))
    args.sglang_tool_call_parser = "minimax-m2"

    with pytest.raises(UnreadableToolCalls, match="SGLang has no tool-call parser that reads it"):
        AdapterService.of(args)


def test_only_what_a_template_raises_is_taken_for_the_templates_refusal(tokenizer, tmp_path):
    raising = "{{ raise_exception('No user query found in messages.') }}"
    deepseek_v3_1 = family_checkpoint(tmp_path / "DeepSeek-V3.1", family_named("DeepSeek-V3.1"))

    with pytest.raises(TemplateFailed, match="No user query found in messages"):
        ChatTemplate(tokenizer, {"chat_template": raising}).text(
            [{"role": "user", "content": "Hi"}], None, generation_prompt=True
        )
    assert ChatTemplate(load_tokenizer(str(deepseek_v3_1)), {}).string_arguments

    class Broken:
        def apply_chat_template(self, *args, **kwargs):
            raise KeyError("a bug outside any template")

    with pytest.raises(KeyError, match="a bug outside any template"):
        ChatTemplate(Broken(), {})


def test_an_append_only_setting_that_isnt_true_or_false_is_refused(launch, fresh_slime_check):
    args = copy.copy(launch())
    args.episode_append_only_chat = "no"

    with pytest.raises(ValueError, match="episode_append_only_chat is true or false, not 'no'"):
        AdapterService.of(args)
