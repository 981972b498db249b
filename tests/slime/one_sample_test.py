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
from argparse import Namespace
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from chat_core import EpisodeOutcome
from chat_core.record.metrics import rollout_log_metrics
from exact_samples import Prompts, assert_trained_once, exact_episode
from family_play import FamilyLaunch, family_launcher, served_rows, writes_as
from rollout import SAMPLE_PER_TURN, group_of, rollout, rollout_manager
from sglang_stand_in import Generated, StandInSGLang
from slime.agent.trajectory import TurnRecord
from slime_helper import AdapterService
from slime_helper.chat_template import ChatTemplate
from slime_helper.renderer import AppendOnlyRenderer
from slime_helper.tokenizers import AppendOnlyTokenizer, WholeChatTokenizer, turn_session
from test_support import text, tool_call
from test_support.families import FAMILIES, family_named
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
    (family_named("Qwen3"), family_named("Qwen3").modes[1], False),
]
"""Each family in each of its modes, a thinking mode launched with the family's reasoning parser; and Qwen3 thinking
without one, where slime's adapter leaves the reasoning in the reply's text."""
EARLIER, LATER_ROUND, REFUSED, MOVED, DROPPED = (
    "earlier_reply_as_sampled",
    "later_tool_round_opened",
    "later_system_message_refused",
    "later_system_message_moved",
    "later_system_message_dropped",
)
TEMPLATE_DIFFERENCES = {
    ("Qwen2.5", False): (),
    ("Qwen3", False): (EARLIER,),
    ("Qwen3", True): (EARLIER,),
    ("Qwen3.5", False): (EARLIER, REFUSED),
    ("Qwen3.5", True): (EARLIER, REFUSED),
    ("Qwen3.6", False): (EARLIER, REFUSED),
    ("Qwen3.6", True): (EARLIER, REFUSED),
    **{(glm, thinks): () for glm in ("GLM-4.7-Flash", "GLM-5", "GLM-5.1", "GLM-5.2") for thinks in (False, True)},
    ("DeepSeek-V3", False): (EARLIER, LATER_ROUND, MOVED),
    ("DeepSeek-V3.1", False): (MOVED,),
    ("DeepSeek-V3.1", True): (EARLIER, MOVED),
    ("DeepSeek-R1", True): (EARLIER, LATER_ROUND, MOVED),
    ("MiniMax-M2", True): (EARLIER, DROPPED),
    ("QwQ-32B", True): (EARLIER,),
}
"""For each family and whether its mode thinks, the allowed differences its episodes' prompts show against its
template's render of their whole chats: GLM's keep earlier reasoning with ``clear_thinking: false`` and place a
later system message where it comes, so they show none."""


@pytest.fixture(scope="module")
def stocktake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The rows of a server serving ``stocktake`` and ``quoted`` with the sample bundle's warehouse."""
    with served_rows(tmp_path_factory.mktemp("stocktake"), {"stocktake": STOCKTAKE, "quoted": QUOTED}) as rows:
        yield rows


@pytest.fixture(scope="module")
def family_launches(
    tmp_path_factory: pytest.TempPathFactory, stocktake: Path, sglang_server: StandInSGLang, family_checkpoints
) -> FamilyLaunch:
    """slime's arguments for a launch of a family in a mode, with or without its reasoning parser, on the
    ``stocktake`` rows with ``FAMILY_CONFIG``, and the family's tokenizer as slime loads it."""
    return family_launcher(
        tmp_path_factory.mktemp("launches"), stocktake, sglang_server, family_checkpoints, FAMILY_CONFIG
    )


@pytest.fixture(scope="module")
def stocktake_group(launch, stocktake: Path) -> list:
    """The group of ``stocktake``'s row as slime's data source gives it; a test plays a copy."""
    return group_of(Namespace(**{**vars(launch()), "prompt_data": str(stocktake)}), "stocktake")


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
def test_every_family_renders_an_episode_as_one_sample_exact_against_its_template_each_generated_token_trained_once(
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
    template = ChatTemplate(tokenizer, mode.template_kwargs)
    found: set[str] = set()
    for samples in episodes:
        [sample] = samples
        replies = calling if sample.tokens == [*calling[-1].prompt, *calling[-1].output] else replying
        assert sample.tokens == [*replies[-1].prompt, *replies[-1].output]
        assert sample.response_length == len(sample.loss_mask) == len(sample.tokens) - len(replies[0].prompt)
        assert sample.reward == (1.0 if replies is calling else 0.0)
        outcome = EpisodeOutcome.from_metadata(sample.metadata)
        assert outcome.scored and outcome.model_calls == len(replies) and outcome.turns == 2
        assert outcome.turns_not_appended == 0
        assert not {str(flag.kind) for flag in outcome.flags} & {"turn_not_appended", "turn_not_recorded"}
        renders = prompts.of(replies[0].routing_key)
        found |= {difference.name for difference in exact_episode(samples, renders, replies, template)}
        held = [0] + [len(reply.prompt) + len(reply.output) for reply in replies[:-1]]
        assert [render.tokenized for render in renders] == [
            len(r.tokens) - h for r, h in zip(renders, held, strict=True)
        ]
    assert found == set(TEMPLATE_DIFFERENCES[family.name, mode.thinks])
    cut, after_cut = replying
    added = tokenizer.decode(after_cut.prompt[len(cut.prompt) + len(cut.output) :])
    assert len(cut.output) == args.rollout_max_response_len and added.startswith(family.turn_end)
    for before, after in itertools.pairwise(calling):
        added = tokenizer.decode(after.prompt[len(before.prompt) + len(before.output) :])
        assert not added.startswith(tokenizer.decode(before.output[-1:])), "the reply's stop token written twice"


def test_a_chat_the_template_cant_render_flags_the_episode_with_the_templates_message(family_launches, sglang):
    qwen3_5 = family_named("Qwen3.5")
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


def test_with_the_setting_off_and_thinking_on_each_turn_whose_reasoning_qwen3_drops_starts_a_sample_still_trained(
    launch, sglang, tokenizer, monkeypatch, stocktake
):
    _, episodes, sessions, _ = played(
        launch, sglang, tokenizer, monkeypatch, stocktake, THINKING_ON, thinking=True, config=SAMPLE_PER_TURN
    )

    # Qwen3 drops a reply's reasoning once a user message follows it, so the next prompt parts from the tokens slime
    # holds inside that reply: slime's manager would REALIGN it into the same sample, the reply untrained.
    for samples in episodes:
        [replies] = [
            replies for replies in sessions if samples[-1].tokens[-len(replies[-1].output) :] == replies[-1].output
        ]
        assert len(samples) > 1
        assert_trained_once(samples, replies)


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
    assert caplog.text.count("so it was rendered whole with the chat template") == 2
    appended.forget(serving_episode)
    assert appended.apply_chat_template(answered, tools=tools) == whole.apply_chat_template(answered, tools)
    assert caplog.text.count("rendered whole") == 2
