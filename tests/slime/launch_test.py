"""slime launched with this project's hooks: its own ``parse_args`` takes them, its loaders find them, and the
helper checks the slime it runs on, renders a Qwen3 chat append-only unless told not to, and otherwise carries the
chat template kwargs into the adapter."""

from __future__ import annotations

import copy
import inspect
import json
import shutil

import pins
import pytest
from rollout import SAMPLE_PER_TURN
from slime.agent.adapters import OpenAIAdapter
from slime.agent.adapters.common import BaseAdapter
from slime.utils.misc import load_function
from slime_helper import (
    AdapterService,
    TemplateKwargsTokenizer,
    UnsupportedSlime,
    generate,
    keep_scored_groups,
    normalize_per_episode,
)
from slime_helper._slime import SUPPORTED_SLIME, slime
from slime_helper.append_only import AppendOnlyTokenizer

THINKING_OFF_OPENING = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A chat template of the same tokens that renders no tools and no think block: not Qwen3's."""


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

    assert isinstance(service.adapter.tokenizer, AppendOnlyTokenizer)
    stock = tokenizer.apply_chat_template(chat, tools=tools, add_generation_prompt=True, enable_thinking=False)
    assert service.adapter.tokenizer.apply_chat_template(chat, tools=tools) == list(stock.get("input_ids", stock))
    assert tokenizer.decode(stock.get("input_ids", stock)).endswith(THINKING_OFF_OPENING)


def test_with_the_setting_off_the_adapter_gets_the_chat_template_kwargs_through_the_tokenizer(
    launch, fresh_slime_check
):
    service = AdapterService.of(launch(thinking=False, config=SAMPLE_PER_TURN))

    assert isinstance(service.adapter.tokenizer, TemplateKwargsTokenizer)
    rendered = service.adapter.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith(THINKING_OFF_OPENING)


def test_a_template_not_recognised_as_qwen3s_keeps_the_tokenizers_own_rendering(
    launch, checkpoint, tmp_path, caplog, fresh_slime_check
):
    other = shutil.copytree(checkpoint, tmp_path / "ChatML-0.6B")
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = CHATML
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    args = copy.copy(launch(thinking=False))
    args.hf_checkpoint = str(other)

    service = AdapterService.of(args)

    assert isinstance(service.adapter.tokenizer, TemplateKwargsTokenizer)
    assert "isn't recognised as Qwen3's" in caplog.text


def test_an_append_only_setting_that_isnt_true_or_false_is_refused(launch, fresh_slime_check):
    args = copy.copy(launch())
    args.episode_append_only_chat = "no"

    with pytest.raises(ValueError, match="episode_append_only_chat is true or false, not 'no'"):
        AdapterService.of(args)
