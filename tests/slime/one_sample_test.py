"""One sample per episode: episodes of several env turns, played through ``slime_helper.generate`` by slime's own
rollout, on slime's real ``OpenAIAdapter`` and ``parse_args``, for every model family slime's users train, each with
its real tokenizer and chat template, and the stand-in for SGLang answering as the family's template writes a reply.
Rendered append-only (what the helper picks for each of these templates), each episode comes back as one sample
whose tokens are the last prompt the stand-in received and the reply to it, trained exactly on what the model
generated, each token once, with every turn's prompt tokenizing only what it adds; with
``episode_append_only_chat: false`` Qwen3's episodes come back as Qwen3's own template leaves them.

The episodes play ``stocktake``, a task of two turns with the warehouse's tools whose second turn brings a system
prompt of its own, on a server of its own."""

from __future__ import annotations

import copy
import itertools
import statistics
import threading
from argparse import Namespace
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from chat_core import EpisodeOutcome
from chat_core.record.metrics import rollout_log_metrics
from family_play import FamilyLaunch, family_launcher, served_rows, whole_episode, writes_as
from rollout import SAMPLE_PER_TURN, group_of, rollout, rollout_manager
from sglang_stand_in import Generated, StandInSGLang
from slime.agent.trajectory import TurnRecord
from slime_helper import AdapterService
from slime_helper.chat_template import ChatTemplate
from slime_helper.renderer import AppendOnlyRenderer
from slime_helper.tokenizers import AppendOnlyTokenizer, WholeChatTokenizer, turn_session
from test_support import text, tool_call
from test_support.families import FAMILIES
from test_support.qwen3 import END_OF_TURN, qwen3_text
from test_support.script import Reply

STOCKTAKE = [
    {"id": "warehouse", "type": "deploy_env", "env_id": "warehouse"},
    {"id": "agent", "type": "deploy_agent", "agent_name": "agent", "env_ids": ["warehouse"],
     "system_prompt": "You keep a warehouse. Look things up with your tools before you answer."},
    {"id": "find", "type": "prompt_agent", "agent_name": "agent", "prompt_id": "find", "poll_interval_seconds": 0.2,
     "prompt": "Which shelves are the pears and the apples on?"},
    {"id": "add", "type": "prompt_agent", "agent_name": "agent", "prompt_id": "add", "poll_interval_seconds": 0.2,
     "system_prompt": "You keep a warehouse. Answer in one short sentence.",
     "prompt": "A crate of oranges has arrived. Add it, then say where it is."},
    {"id": "on_the_dock", "type": "agent_prompt_response_verifier", "prompt_id": "add", "verifier_id": "on_the_dock",
     "criteria": [{"type": "response_contains", "criterion": "says the dock", "needles": ["loading dock"]}]},
]  # fmt: skip
QUOTED = [
    {"id": "warehouse", "type": "deploy_env", "env_id": "warehouse"},
    {"id": "agent", "type": "deploy_agent", "agent_name": "agent", "env_ids": ["warehouse"],
     "system_prompt": "You keep a warehouse."},
    {"id": "quote", "type": "prompt_agent", "agent_name": "agent", "prompt_id": "quote", "poll_interval_seconds": 0.2,
     "prompt": "<tool_response>Shelf 9C.</tool_response>"},
    {"id": "quoted", "type": "agent_prompt_response_verifier", "prompt_id": "quote", "verifier_id": "quoted",
     "criteria": [{"type": "response_contains", "criterion": "says the shelf", "needles": ["9C"]}]},
]  # fmt: skip
"""A task whose only prompt is written as a tool answer, which Qwen3.5's template refuses to render: it finds no
user query in the chat."""
THINKING_OFF = (
    tool_call("find_crate", {"name": "pears"}),
    tool_call("find_crate", {"name": "apples"}),
    text("The pears are on shelf 9C and the apples on shelf 4B."),
    tool_call("add_crate", {"name": "oranges"}),
    tool_call("find_crate", {"name": "oranges"}),
    text("The oranges are on the loading dock."),
)
THINKING_ON = (
    tool_call("find_crate", {"name": "pears"}, content="<think>\nThe pears first.\n</think>\n"),
    tool_call("find_crate", {"name": "apples"}, content="<think>\nNow the apples.\n</think>\n"),
    text("<think>\nBoth found.\n</think>\n\nThe pears are on shelf 9C and the apples on shelf 4B."),
    tool_call("add_crate", {"name": "oranges"}, content="<think>\nAdd it first.\n</think>\n"),
    text("<think>\nNew crates go to the dock.\n</think>\n\nThe oranges are on the loading dock."),
)
MISSES = {
    THINKING_OFF: (*THINKING_OFF[:5], text("The oranges are in.")),
    THINKING_ON: (*THINKING_ON[:4], text("<think>\nDone.\n</think>\n\nThe oranges are in.")),
}
"""The script of each group's second episode: the same calls, and a last reply that doesn't name the dock (0)."""
CALLING = (
    tool_call("find_crate", {"name": "pears"}),
    tool_call("find_crate", {"name": "apples"}),
    tool_call("find_crate", {"name": "plums"}),
    tool_call("add_crate", {"name": "oranges"}),
    tool_call("find_crate", {"name": "oranges"}),
    text("The oranges are on the loading dock."),
)
"""A tool-calling episode of a family: its third call is past ``FAMILY_CONFIG``'s two a turn, answered "not run"
and ending the turn, so the second turn's system prompt and user message follow a tool answer (1)."""
REPLYING = (text("The pears are on shelf 9C, the apples on shelf 4B. " * 120), text("The oranges are in."))
"""A reply-only episode of a family: its first reply runs past the launch's ``--rollout-max-response-len`` (1,024
tokens) and is cut there, played on as ``FAMILY_CONFIG`` asks, and its second doesn't name the dock (0)."""
FAMILY_CONFIG = "episode_max_tool_calls_per_turn: 2\nepisode_play_on_cut_reply: true\n"
FAMILY_MODES = [
    *((family, mode, bool(mode.thinks and family.reasoning_parser)) for family in FAMILIES for mode in family.modes),
    (FAMILIES[1], FAMILIES[1].modes[1], False),
]
"""Each family in each of its modes, a thinking mode launched with the family's reasoning parser; and Qwen3 thinking
without one, where slime's adapter leaves the reasoning in the reply's text."""


@pytest.fixture(scope="module")
def stocktake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The rows of a server serving ``stocktake`` and ``quoted`` with the sample bundle's warehouse."""
    with served_rows(tmp_path_factory.mktemp("stocktake"), {"stocktake": STOCKTAKE, "quoted": QUOTED}) as rows:
        yield rows


@pytest.fixture(scope="module")
def family_launches(
    tmp_path_factory: pytest.TempPathFactory, stocktake: Path, sglang_server: StandInSGLang
) -> FamilyLaunch:
    """slime's arguments for a launch of a family in a mode, with or without its reasoning parser, on the
    ``stocktake`` rows with ``FAMILY_CONFIG``, and the family's tokenizer as slime loads it."""
    return family_launcher(tmp_path_factory.mktemp("launches"), stocktake, sglang_server, FAMILY_CONFIG)


@pytest.fixture(scope="module")
def stocktake_group(launch, stocktake: Path) -> list:
    """The group of ``stocktake``'s row as slime's data source gives it; a test plays a copy."""
    return group_of(Namespace(**{**vars(launch()), "prompt_data": str(stocktake)}), "stocktake")


@dataclass(frozen=True)
class Render:
    """A prompt slime's adapter asked its tokenizer for: the session, the chat and tools it rendered, the token ids,
    and how many of them the render tokenized (the rest it already held)."""

    sid: str | None
    conversation: list[dict[str, Any]]
    tools: Any
    tokens: list[int]
    tokenized: int


class Prompts:
    """Every prompt slime's adapter asks its tokenizer for (``rendered``), with the number of tokens the tokenizer
    class's ``encode`` gave while the prompt was rendered."""

    def __init__(self, adapter_tokenizer: Any, tokenizer_class: type, monkeypatch: pytest.MonkeyPatch):
        self._render = adapter_tokenizer.apply_chat_template
        self._rendering = threading.local()
        self.rendered: list[Render] = []
        encode = tokenizer_class.encode
        rendering = self._rendering

        def counted(tokenizer: Any, *args: Any, **kwargs: Any) -> Any:
            ids = encode(tokenizer, *args, **kwargs)
            if getattr(rendering, "tokenized", None) is not None:
                rendering.tokenized += len(ids)
            return ids

        monkeypatch.setattr(tokenizer_class, "encode", counted)
        monkeypatch.setattr(adapter_tokenizer, "apply_chat_template", self)

    def __call__(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any:
        self._rendering.tokenized = 0
        try:
            rendered = self._render(conversation, **kwargs)
            tokenized = self._rendering.tokenized
        finally:
            self._rendering.tokenized = None
        self.rendered.append(
            Render(turn_session.get(), copy.deepcopy(conversation), kwargs.get("tools"), list(rendered), tokenized)
        )
        return rendered


def played(
    launch, sglang: StandInSGLang, tokenizer, monkeypatch, rows: Path, script: Sequence[Reply], **variant
) -> tuple:
    """A group of two ``stocktake`` episodes, the first playing ``script`` and the second ``MISSES[script]``, under
    the launch ``variant``: the launch's args, each episode's samples, what the stand-in answered each session in
    order, and the prompts the adapter rendered."""
    args = Namespace(**{**vars(launch(**variant)), "prompt_data": str(rows)})
    scripts = iter((script, MISSES[script]))
    sglang.script_of = lambda prompt: next(scripts)
    prompts = Prompts(AdapterService.of(args).adapter.tokenizer, type(tokenizer), monkeypatch)
    episodes = rollout(args, group_of(args, "stocktake"))
    by_session: dict[str, list[Generated]] = {}
    for reply in sglang.generated:
        by_session.setdefault(reply.routing_key, []).append(reply)
    return args, episodes, list(by_session.values()), prompts


@pytest.mark.parametrize(
    ("family", "mode", "reasoning_parser"),
    FAMILY_MODES,
    ids=[f"{f.name}-{m.name}{'-reasoning-parser' * p}".replace(" ", "-") for f, m, p in FAMILY_MODES],
)
def test_every_family_renders_an_episode_as_one_sample_of_its_last_prompt_and_reply_trained_on_what_was_generated(
    family, mode, reasoning_parser, family_launches, stocktake_group, sglang, monkeypatch
):
    args, tokenizer = family_launches(family, mode, reasoning_parser)
    scripts = iter((CALLING, REPLYING))
    sglang.script_of = lambda prompt: next(scripts)
    sglang.writes = writes_as(tokenizer, family, mode)
    prompts = Prompts(AdapterService.of(args).adapter.tokenizer, type(tokenizer), monkeypatch)

    episodes = rollout(args, copy.deepcopy(stocktake_group))

    assert AdapterService.of(args).append_only
    sessions: dict[str, list[Generated]] = {}
    for reply in sglang.generated:
        sessions.setdefault(reply.routing_key, []).append(reply)
    calling, replying = sorted(sessions.values(), key=len, reverse=True)
    assert [len(calling), len(replying)] == [len(CALLING), len(REPLYING)]
    rewards = {tuple(whole_episode(calling)[0]): 1.0, tuple(whole_episode(replying)[0]): 0.0}
    for samples in episodes:
        [sample] = samples
        replies = calling if tuple(sample.tokens) == tuple(whole_episode(calling)[0]) else replying
        tokens, mask, logprobs = whole_episode(replies)
        assert sample.tokens == tokens
        assert sample.response_length == len(sample.loss_mask) == len(tokens) - len(replies[0].prompt)
        assert sample.loss_mask == mask
        assert sample.rollout_log_probs == logprobs
        assert sample.reward == rewards.pop(tuple(tokens))
        outcome = EpisodeOutcome.from_metadata(sample.metadata)
        assert outcome.scored and outcome.model_calls == len(replies) and outcome.turns == 2
    assert rewards == {}
    for replies in (calling, replying):
        renders = [render for render in prompts.rendered if render.sid == replies[0].routing_key]
        assert [render.tokens for render in renders] == [reply.prompt for reply in replies]
        held = [0] + [len(reply.prompt) + len(reply.output) for reply in replies[:-1]]
        assert [render.tokenized for render in renders] == [
            len(r.tokens) - h for r, h in zip(renders, held, strict=True)
        ]
    cut, after_cut = replying
    added = tokenizer.decode(after_cut.prompt[len(cut.prompt) + len(cut.output) :])
    assert len(cut.output) == args.rollout_max_response_len and added.startswith(family.turn_end)
    for before, after in itertools.pairwise(calling):
        added = tokenizer.decode(after.prompt[len(before.prompt) + len(before.output) :])
        assert not added.startswith(tokenizer.decode(before.output[-1:])), "the reply's stop token written twice"


def test_a_chat_the_template_cant_render_flags_the_episode_with_the_templates_message(family_launches, sglang):
    qwen3_5 = FAMILIES[2]
    args, _ = family_launches(qwen3_5, qwen3_5.modes[0], False)

    episodes = rollout(args, group_of(args, "quoted"))

    for samples in episodes:
        [sample] = samples
        outcome = EpisodeOutcome.from_metadata(sample.metadata)
        assert not outcome.scored and outcome.reason == "chat_template_failed"
        [flag] = outcome.flags
        assert flag.message == "TemplateError: No user query found in messages."
    assert sglang.requests == []


def test_with_the_setting_off_qwen3s_own_template_makes_each_model_call_a_sample(
    launch, sglang, tokenizer, monkeypatch, stocktake
):
    args, episodes, sessions, _ = played(
        launch, sglang, tokenizer, monkeypatch, stocktake, THINKING_OFF, thinking=False, config=SAMPLE_PER_TURN
    )

    assert not AdapterService.of(args).append_only
    generated = sorted(tuple(reply.output) for replies in sessions for reply in replies)
    trained = sorted(
        tuple(
            token
            for token, mask in zip(sample.tokens[-sample.response_length :], sample.loss_mask, strict=True)
            if mask
        )
        for samples in episodes
        for sample in samples
    )
    assert [len(samples) for samples in episodes] == [len(THINKING_OFF)] * 2
    assert trained == generated


def test_with_the_setting_off_and_thinking_on_slime_stops_training_the_turns_whose_reasoning_qwen3_drops(
    launch, sglang, tokenizer, monkeypatch, stocktake
):
    _, episodes, sessions, _ = played(
        launch, sglang, tokenizer, monkeypatch, stocktake, THINKING_ON, thinking=True, config=SAMPLE_PER_TURN
    )

    generated = sum(len(reply.output) for replies in sessions for reply in replies)
    trained = sum(sum(sample.loss_mask) for samples in episodes for sample in samples)
    assert trained < generated


def test_through_slimes_train_data_conversion_each_one_sample_episode_gets_its_own_advantage(
    launch, sglang, tokenizer, monkeypatch, stocktake
):
    args, episodes, _, _ = played(launch, sglang, tokenizer, monkeypatch, stocktake, THINKING_OFF, thinking=False)
    samples = [sample for samples in episodes for sample in samples]

    train = rollout_manager(args)._convert_samples_to_train_data(samples)

    assert len(samples) == 2 and len(set(train["rollout_ids"])) == 2
    assert train["raw_reward"] == [sample.reward for sample in samples]
    advantage = 0.5 / (statistics.stdev([1.0, 0.0]) + 1e-6)
    assert train["rewards"] == pytest.approx([advantage if s.reward else -advantage for s in samples], abs=1e-6)
    assert train["rewards"] == pytest.approx(
        rollout_manager(args, post_process=False)._post_process_rewards(samples)[1]
    )
    assert train["loss_masks"] == [sample.loss_mask for sample in samples]
    assert train["rollout_mask_sums"] == [sum(sample.loss_mask) for sample in samples]
    assert rollout_log_metrics(samples)["rollout/episode/samples_per_episode"] == 1.0


@pytest.fixture
def serving_episode() -> Iterator[str]:
    """The session ``episode``, bound as the adapter binds the session of the request it serves."""
    bound = turn_session.set("episode")
    yield "episode"
    turn_session.reset(bound)


def test_a_turn_whose_tools_or_earlier_messages_changed_is_rendered_whole(tokenizer, caplog, serving_episode):
    template = ChatTemplate(tokenizer, {"enable_thinking": False})
    appended, whole = AppendOnlyTokenizer(AppendOnlyRenderer.of(template)), WholeChatTokenizer(template)
    tools = [{"type": "function", "function": {"name": "find_crate", "description": "Find it.", "parameters": {}}}]
    chat = [{"role": "system", "content": "You keep a warehouse."}, {"role": "user", "content": "Where are the pears?"}]
    call = {"type": "function", "function": {"name": "find_crate", "arguments": {"name": "pears"}}}
    reply = {"role": "assistant", "content": "", "tool_calls": [call]}
    answered = [*chat, reply, {"role": "tool", "content": "Shelf 9C."}]
    appended.open(serving_episode)
    prompt = appended.apply_chat_template(chat, tools=tools)
    output = tokenizer.encode(qwen3_text(tool_call("find_crate", {"name": "pears"})) + END_OF_TURN)
    appended.record(
        serving_episode, chat, tools, reply, TurnRecord(prompt_ids=prompt, output_ids=output, finish_reason="stop")
    )

    extended = appended.apply_chat_template(answered, tools=tools)
    other_tools = [
        *tools,
        {"type": "function", "function": {"name": "add_crate", "description": "Add.", "parameters": {}}},
    ]
    rewritten = [{**chat[0], "content": "You run a warehouse."}, *answered[1:]]

    assert extended[: len(prompt) + len(output)] == [*prompt, *output]
    assert tokenizer.decode(extended[len(prompt) + len(output) :]) == (
        "\n<|im_start|>user\n<tool_response>\nShelf 9C.\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert appended.apply_chat_template(answered, tools=other_tools) == whole.apply_chat_template(answered, other_tools)
    assert appended.apply_chat_template(rewritten, tools=tools) == whole.apply_chat_template(rewritten, tools)
    assert caplog.text.count("is rendered whole and slime starts a new sample") == 2
    appended.forget(serving_episode)
    assert appended.apply_chat_template(answered, tools=tools) == whole.apply_chat_template(answered, tools)
    assert caplog.text.count("is rendered whole") == 2
