"""slime launched with this project's hooks: its own ``parse_args`` takes them, its loaders find them, and the
helper checks the slime it runs on and carries its chat template kwargs into the adapter."""

from __future__ import annotations

import inspect

import pins
import pytest
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

    monkeypatch.setattr(BaseAdapter, "finish_session", finish_session)
    with pytest.raises(UnsupportedSlime) as refused:
        slime()
    assert "OpenAIAdapter.finish_session(base_sample=…)" in str(refused.value)
    assert "OpenAIAdapter.finish_session(extra_metadata=…)" in str(refused.value)
    assert SUPPORTED_SLIME in str(refused.value)


def test_this_adapter_gets_the_chat_template_kwargs_through_the_tokenizer(launch, fresh_slime_check):
    service = AdapterService.of(launch(thinking=False))

    assert isinstance(service.adapter.tokenizer, TemplateKwargsTokenizer)
    rendered = service.adapter.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
