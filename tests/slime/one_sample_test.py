"""One sample per episode: episodes of several env turns with several tool calls a turn, played through
``slime_helper.generate`` by slime's own rollout, on slime's real ``OpenAIAdapter``, ``parse_args`` and Qwen3's
tokenizer, with the stand-in for SGLang. Rendered append-only (the default for Qwen3's template), each episode comes
back as one sample whose tokens are the last prompt the stand-in received and the reply to it, trained exactly on
what the model generated, each token once, with every turn's prompt equal to the whole chat rendered at once; with
``episode_append_only_chat: false`` the same episode comes back as Qwen3's own template leaves it.

The episodes play ``stocktake``, a task of two turns with the warehouse's tools, on a server of its own."""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
import statistics
import threading
from argparse import Namespace
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from chat_core import EpisodeOutcome
from chat_core.prepare.write import write_rows
from chat_core.record.metrics import rollout_log_metrics
from rollout import SAMPLE_PER_TURN, group_of, rollout, rollout_manager
from sglang_stand_in import Generated, StandInSGLang
from slime.agent.trajectory import TurnRecord
from slime_helper import AdapterService
from slime_helper.append_only import AppendOnlyTokenizer, turn_session
from slime_helper.qwen3_chat import Qwen3Chat
from test_support import SAMPLE_BUNDLE, serve_bundle, text, tool_call, tool_calls
from test_support.qwen3 import END_OF_TURN, qwen3_text
from test_support.script import Reply

STOCKTAKE = [
    {"id": "warehouse", "type": "deploy_env", "env_id": "warehouse"},
    {"id": "agent", "type": "deploy_agent", "agent_name": "agent", "env_ids": ["warehouse"],
     "system_prompt": "You keep a warehouse. Look things up with your tools before you answer."},
    {"id": "find", "type": "prompt_agent", "agent_name": "agent", "prompt_id": "find", "poll_interval_seconds": 0.2,
     "prompt": "Which shelves are the pears and the apples on?"},
    {"id": "add", "type": "prompt_agent", "agent_name": "agent", "prompt_id": "add", "poll_interval_seconds": 0.2,
     "prompt": "A crate of oranges has arrived. Add it, then say where it is."},
    {"id": "on_the_dock", "type": "agent_prompt_response_verifier", "prompt_id": "add", "verifier_id": "on_the_dock",
     "criteria": [{"type": "response_contains", "criterion": "says the dock", "needles": ["loading dock"]}]},
]  # fmt: skip
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
REASONING_PARSER = ("--sglang-reasoning-parser", "qwen3")
VARIANTS = {
    "thinking-off": (False, THINKING_OFF, ()),
    "thinking-on": (True, THINKING_ON, ()),
    "thinking-on-reasoning-parser": (True, THINKING_ON, REASONING_PARSER),
}


@pytest.fixture(scope="module")
def stocktake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The rows of a server serving ``stocktake`` with the sample bundle's warehouse."""
    bundle = tmp_path_factory.mktemp("bundles") / "stocktake-env"
    (bundle / "tasks").mkdir(parents=True)
    shutil.copytree(SAMPLE_BUNDLE / "envs", bundle / "envs")
    (bundle / "tasks" / "stocktake.json").write_text(json.dumps(STOCKTAKE))
    with serve_bundle(bundle) as served:
        rows = tmp_path_factory.mktemp("stocktake") / "rows"
        asyncio.run(write_rows(served.url, rows, progress=False))
        yield rows / "all.jsonl"


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


def whole_episode(replies: list[Generated]) -> tuple[list[int], list[int], list[float]]:
    """The tokens of an episode whose model calls were ``replies``, rendered append-only, its last prompt and reply;
    and the loss mask and logprobs of everything past its first prompt: 1 and the model's logprob on every token it
    generated, 0 elsewhere."""
    tokens = [*replies[-1].prompt, *replies[-1].output]
    mask, logprobs = [0] * len(tokens), [0.0] * len(tokens)
    for reply in replies:
        start = len(reply.prompt)
        assert tokens[: start + len(reply.output)] == [*reply.prompt, *reply.output], "a prompt forked"
        mask[start : start + len(reply.output)] = [1] * len(reply.output)
        logprobs[start : start + len(reply.output)] = reply.logprobs
    first = len(replies[0].prompt)
    return tokens, mask[first:], logprobs[first:]


def as_written(conversation: list[dict[str, Any]], replies: list[str]) -> list[dict[str, Any]]:
    """``conversation`` with its assistant turns, in order, as the text of ``replies``, exactly as the model wrote
    them."""
    written = iter(replies)
    return [
        {"role": "assistant", "content": next(written)} if message["role"] == "assistant" else message
        for message in conversation
    ]


@pytest.mark.parametrize("variant", VARIANTS)
def test_an_episode_rendered_append_only_is_one_sample_of_its_last_prompt_and_reply_trained_on_what_was_generated(
    launch, sglang, tokenizer, monkeypatch, stocktake, variant
):
    thinking, script, extra = VARIANTS[variant]
    args, episodes, sessions, prompts = played(
        launch, sglang, tokenizer, monkeypatch, stocktake, script, thinking=thinking, extra=extra
    )

    appended = AdapterService.of(args).adapter.tokenizer
    assert isinstance(appended, AppendOnlyTokenizer)
    assert [len(replies) for replies in sessions] == [len(script), len(MISSES[script])]
    expected = {tuple(whole_episode(replies)[0]): replies for replies in sessions}
    for samples in episodes:
        [sample] = samples
        replies = expected.pop(tuple(sample.tokens))
        _, mask, logprobs = whole_episode(replies)
        assert sample.response_length == len(sample.loss_mask) == len(sample.tokens) - len(replies[0].prompt)
        assert sample.loss_mask == mask
        assert sample.rollout_log_probs == logprobs
        outcome = EpisodeOutcome.from_metadata(sample.metadata)
        assert outcome.scored and outcome.model_calls == len(replies) and outcome.turns == 2
        assert outcome.tool_calls == sum(bool(step.tool_calls) for step in script)
    assert sorted(sample.reward for samples in episodes for sample in samples) == [0.0, 1.0]

    first = prompts.rendered[0]
    stock = tokenizer.apply_chat_template(
        first.conversation, tools=first.tools, tokenize=True, add_generation_prompt=True,
        **args.apply_chat_template_kwargs,
    )  # fmt: skip
    assert first.tokens == list(stock.get("input_ids", stock))
    for replies in sessions:
        renders = [render for render in prompts.rendered if render.sid == replies[0].routing_key]
        assert [render.tokens for render in renders] == [reply.prompt for reply in replies]
        held = [0] + [len(reply.prompt) + len(reply.output) for reply in replies[:-1]]
        assert [render.tokenized for render in renders] == [
            len(r.tokens) - h for r, h in zip(renders, held, strict=True)
        ]
        written = [tokenizer.decode(reply.output) for reply in replies]
        for render in renders:
            assert render.tokens == appended.whole(as_written(render.conversation, written), render.tools)


def test_with_the_setting_off_qwen3s_own_template_makes_each_model_call_a_sample(
    launch, sglang, tokenizer, monkeypatch, stocktake
):
    args, episodes, sessions, _ = played(
        launch, sglang, tokenizer, monkeypatch, stocktake, THINKING_OFF, thinking=False, config=SAMPLE_PER_TURN
    )

    assert not isinstance(AdapterService.of(args).adapter.tokenizer, AppendOnlyTokenizer)
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


def test_a_reply_of_parallel_tool_calls_is_flagged_counted_and_still_one_sample(launch, sglang, tokenizer):
    args = launch(thinking=False)
    both = tool_calls(tool_call("find_crate", {"name": "pears"}), tool_call("find_crate", {"name": "apples"}))
    sglang.script_of = lambda prompt: [both, text("The pears are on shelf 9C.")]

    episodes = rollout(args, group_of(args, "played"))

    for samples in episodes:
        [sample] = samples
        outcome = EpisodeOutcome.from_metadata(sample.metadata)
        assert outcome.scored and outcome.tool_calls == 1 and outcome.dropped_tool_calls == 1
        [flag] = outcome.flags
        assert str(flag.kind) == "tool_calls_dropped" and not flag.fatal
        assert flag.message.startswith("reply 1 made 2 tool calls (find_crate, find_crate)")
        trained = [
            token
            for token, mask in zip(sample.tokens[-sample.response_length :], sample.loss_mask, strict=True)
            if mask
        ]
        assert tokenizer.decode(trained) == qwen3_text(both) + END_OF_TURN + "The pears are on shelf 9C." + END_OF_TURN
    metrics = rollout_log_metrics([sample for samples in episodes for sample in samples])
    assert metrics["rollout/episode/dropped_tool_calls_mean"] == 1.0


@pytest.fixture
def serving_episode() -> Iterator[str]:
    """The session ``episode``, bound as the adapter binds the session of the request it serves."""
    bound = turn_session.set("episode")
    yield "episode"
    turn_session.reset(bound)


def test_a_turn_whose_tools_or_earlier_messages_changed_is_rendered_whole(tokenizer, caplog, serving_episode):
    appended = AppendOnlyTokenizer(tokenizer, Qwen3Chat.of(tokenizer, {"enable_thinking": False}))
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
    assert extended == appended.whole(answered, tools)
    assert appended.apply_chat_template(answered, tools=other_tools) == appended.whole(answered, other_tools)
    assert appended.apply_chat_template(rewritten, tools=tools) == appended.whole(rewritten, tools)
    assert caplog.text.count("is rendered whole and slime starts a new sample") == 2
    appended.forget(serving_episode)
    assert appended.apply_chat_template(answered, tools=tools) == extended
    assert caplog.text.count("is rendered whole") == 2
