"""Long episodes played as the model wrote them, through ``slime_helper.generate`` by slime's own rollout on slime's
real ``OpenAIAdapter`` and ``parse_args``, for every model family slime's users train (its real tokenizer and chat
template, the stand-in for SGLang writing each reply as the family's template writes it), against agent-env's real
env server:

- every tool call of a reply (two, then three) is run by the env, answered in order, and trained on in one exact
  sample, and the reward is the env's for every call;
- a context that fills ends the episode at that turn, with no further model call or env turn, and its sample ends on
  the last reply;
- a reply cut at the response limit ends its episode, nothing of it handed to the env;
- a tool answer past ``episode_max_tool_answer_chars`` reaches the model cut, with the line saying so;
- with ``episode_score_cut_short: true`` an episode cut short is scored as it stands and trained.

The episodes play ``restock``, a task of two turns whose reward holds only when the env ran the call adding the
oranges, the second of a reply's three."""

from __future__ import annotations

import copy
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chat_core import EpisodeOutcome, FlagKind
from exact_samples import Prompts, exact_episode
from family_play import FamilyLaunch, family_launcher, served_rows, sessions_of, whole_episode, writes_as
from rollout import group_of, rollout, split_response
from sglang_stand_in import StandInSGLang
from slime_helper import AdapterService
from slime_helper.chat_template import ChatTemplate
from test_support import text, tool_call, tool_calls
from test_support.families import FAMILIES

RESTOCK = [
    {"id": "warehouse", "type": "deploy_env", "env_id": "warehouse"},
    {"id": "agent", "type": "deploy_agent", "agent_name": "agent", "env_ids": ["warehouse"],
     "system_prompt": "You keep a warehouse. Look things up and change it with your tools."},
    {"id": "find", "type": "prompt_agent", "agent_name": "agent", "prompt_id": "find", "poll_interval_seconds": 0.2,
     "prompt": "Which shelves are the pears and the apples on?"},
    {"id": "add", "type": "prompt_agent", "agent_name": "agent", "prompt_id": "add", "poll_interval_seconds": 0.2,
     "prompt": "Crates of kiwis and oranges have arrived. Add both, then say where the oranges are."},
    {"id": "holds_oranges", "type": "env_outcome_verifier", "env_id": "warehouse", "file_artifact_id": "check_crates",
     "verifier_id": "holds_oranges"},
]  # fmt: skip
FIRST_PROMPT = RESTOCK[2]["prompt"]
LOOKS_UP = tool_calls(tool_call("find_crate", {"name": "pears"}), tool_call("find_crate", {"name": "apples"}))
FOUND = text("The pears are on shelf 9C and the apples on shelf 4B.")
DOCKED = text("The oranges are on the loading dock.")
ADDS = (
    LOOKS_UP,
    FOUND,
    tool_calls(
        tool_call("add_crate", {"name": "kiwis"}),
        tool_call("add_crate", {"name": "oranges"}),
        tool_call("find_crate", {"name": "oranges"}),
    ),
    DOCKED,
)
"""An episode whose replies make two tool calls, then three, the second adding the oranges: reward 1."""
FORGETS = (
    LOOKS_UP,
    FOUND,
    tool_calls(
        tool_call("add_crate", {"name": "kiwis"}),
        tool_call("find_crate", {"name": "oranges"}),
        tool_call("find_crate", {"name": "pears"}),
    ),
    DOCKED,
)
"""The same but for the oranges, never added: reward 0."""
ANSWERS = {
    1.0: (
        ("The crate 'pears' is on shelf 9C.", "The crate 'apples' is on shelf 4B."),
        (),
        (
            "Added the crate 'kiwis'; the warehouse holds 3 crates.",
            "Added the crate 'oranges'; the warehouse holds 4 crates.",
            "The crate 'oranges' is on shelf dock.",
        ),
        (),
    ),
    0.0: (
        ("The crate 'pears' is on shelf 9C.", "The crate 'apples' is on shelf 4B."),
        (),
        (
            "Added the crate 'kiwis'; the warehouse holds 3 crates.",
            "there is no crate 'oranges'; the crates are apples, kiwis, pears",
            "The crate 'pears' is on shelf 9C.",
        ),
        (),
    ),
}
"""The env's answers to each reply's calls, in order, by the reward the episode earns."""
CALLS_A_REPLY = {"DeepSeek-V3": 2}
"""The most tool calls a family's chat template writes in a reply, where it writes fewer than the reply makes:
DeepSeek-V3's writes the end of the calls and of the reply after each call past the first, so a model writing as
it does stops after its second call."""
RAMBLES = text("I will look up where both crates are, then answer. " * 200)
"""A reply running past the launch's ``--rollout-max-response-len`` (1,024 tokens)."""
FAMILY_MODES = [
    (family, mode, bool(mode.thinks and family.reasoning_parser)) for family in FAMILIES for mode in family.modes
]


@pytest.fixture(scope="module")
def restock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The rows of a server serving ``restock``."""
    with served_rows(tmp_path_factory.mktemp("restock"), {"restock": RESTOCK}) as rows:
        yield rows


@pytest.fixture(scope="module")
def family_launches(
    tmp_path_factory: pytest.TempPathFactory, restock: Path, sglang_server: StandInSGLang, family_checkpoints
) -> FamilyLaunch:
    """Each family's launch on the ``restock`` rows, with chat_core's default episode settings."""
    config = "episode_max_turns: 4\n"
    return family_launcher(tmp_path_factory.mktemp("launches"), restock, sglang_server, family_checkpoints, config)


@pytest.fixture(scope="module")
def restock_group(launch, restock: Path) -> list:
    """The group of ``restock``'s row (two episodes) as slime's data source gives it; a test plays a copy."""
    return group_of(Namespace(**{**vars(launch()), "prompt_data": str(restock)}), "restock")


def _outcome(sample: Any) -> EpisodeOutcome:
    return EpisodeOutcome.from_metadata(sample.metadata)


def _in_order(text_: str, parts: list[str]) -> bool:
    """Whether ``text_`` holds each of ``parts`` in order."""
    at = 0
    for part in parts:
        found = text_.find(part, at)
        if found < 0:
            return False
        at = found + len(part)
    return True


@pytest.mark.parametrize(
    ("family", "mode", "reasoning_parser"),
    FAMILY_MODES,
    ids=[f"{f.name}-{m.name}".replace(" ", "-") for f, m, _ in FAMILY_MODES],
)
def test_every_family_runs_answers_and_trains_every_parallel_tool_call_in_one_exact_sample(
    family, mode, reasoning_parser, family_launches, restock_group, sglang, monkeypatch
):
    args, tokenizer = family_launches(family, mode, reasoning_parser)
    scripts = iter((ADDS, FORGETS))
    sglang.script_of = lambda prompt: next(scripts)
    sglang.writes = writes_as(tokenizer, family, mode)
    prompts = Prompts(AdapterService.of(args).adapter.tokenizer, type(tokenizer), monkeypatch)

    episodes = rollout(args, copy.deepcopy(restock_group))

    sessions = sessions_of(sglang.generated, tokenizer, FIRST_PROMPT)
    assert sorted(len(replies) for replies in sessions) == [len(ADDS), len(FORGETS)]
    rewards = []
    for samples in episodes:
        [sample] = samples
        [replies] = [replies for replies in sessions if whole_episode(replies)[0] == sample.tokens]
        tokens, mask, logprobs = whole_episode(replies)
        assert sample.response_length == len(sample.loss_mask) == len(tokens) - len(replies[0].prompt)
        assert sample.loss_mask == mask and sample.rollout_log_probs == logprobs
        exact_episode(
            samples, prompts.of(replies[0].routing_key), replies, ChatTemplate(tokenizer, mode.template_kwargs)
        )
        outcome = _outcome(sample)
        assert outcome.scored and sample.reward == outcome.reward and outcome.flags == ()
        answers = [answer for reply in ANSWERS[outcome.reward] for answer in reply[: CALLS_A_REPLY.get(family.name)]]
        assert (outcome.turns, outcome.model_calls, outcome.tool_calls, outcome.dropped_tool_calls) == (
            2,
            4,
            len(answers),
            0,
        )
        assert _in_order(tokenizer.decode(replies[-1].prompt), answers)
        rewards.append(outcome.reward)
    assert sorted(rewards) == [0.0, 1.0]


@pytest.mark.parametrize("family", FAMILIES, ids=[family.name for family in FAMILIES])
def test_every_family_ends_an_episode_where_its_context_fills_and_at_a_cut_reply(
    family, family_launches, restock_group, sglang
):
    mode = family.modes[0]
    args, tokenizer = family_launches(family, mode, bool(mode.thinks and family.reasoning_parser))
    sglang.script_of = lambda prompt: ADDS
    sglang.writes = writes_as(tokenizer, family, mode)
    rollout(args, copy.deepcopy(restock_group))
    whole = sessions_of(sglang.generated, tokenizer, FIRST_PROMPT)[0]
    sglang.clear()
    AdapterService.reset()
    turn_two = len(whole[2].prompt)
    filled = Namespace(**{**vars(args), "rollout_max_context_len": turn_two})

    episodes = rollout(filled, copy.deepcopy(restock_group))

    for replies, samples in zip(sessions_of(sglang.generated, tokenizer, FIRST_PROMPT), episodes, strict=True):
        assert [reply.prompt for reply in replies] == [reply.prompt for reply in whole[:2]]
        [sample] = samples
        assert sample.tokens == whole_episode(replies)[0] and sample.reward == 0.0
        outcome = _outcome(sample)
        assert (outcome.reason, outcome.turns, outcome.model_calls, outcome.tool_calls) == (
            "context_exhausted",
            2,
            2,
            2,
        )
        [flag] = outcome.flags
        assert flag.message.startswith("turn 2: the next prompt doesn't fit the model's context (the chat endpoint")
        assert (
            f"this turn's prompt is {turn_two} tokens, and the model's maximum context length is {turn_two} tokens "
            "(slime's --rollout-max-context-len)"
        ) in flag.message

    sglang.clear()
    AdapterService.reset()
    sglang.script_of = lambda prompt: (RAMBLES, *ADDS)

    episodes = rollout(args, copy.deepcopy(restock_group))

    for [cut], samples in zip(sessions_of(sglang.generated, tokenizer, FIRST_PROMPT), episodes, strict=True):
        [sample] = samples
        assert len(cut.output) == args.rollout_max_response_len
        assert sample.tokens == [*cut.prompt, *cut.output] and split_response(sample)[0] == cut.output
        outcome = _outcome(sample)
        assert (outcome.reason, outcome.turns, outcome.model_calls, outcome.tool_calls) == ("response_limit", 1, 1, 0)
        assert outcome.truncated


def test_a_long_tool_answer_reaches_the_model_cut_with_a_line_saying_so(launch, sglang, tokenizer):
    args = launch(thinking=False, config="episode_max_tool_answer_chars: 12\n")

    episodes = rollout(args, group_of(args, "played"))

    cut = "The crate 'p\n[the tool's answer is cut here: 21 more characters, past the 12 shown]"
    for samples in episodes:
        [sample] = samples
        outcome = _outcome(sample)
        assert outcome.scored and sample.reward == 1.0
        assert (outcome.tool_answers_cut, outcome.tool_answer_bytes_cut) == (1, 21)
        assert f"<tool_response>\n{cut}\n</tool_response>" in tokenizer.decode(sample.tokens)


def test_with_score_cut_short_a_cut_reply_is_scored_as_it_stands_and_trained(launch, sglang, tokenizer):
    args = launch(thinking=False, config="episode_score_cut_short: true\n")
    rambles = text("A banana is long and yellow. " * 200)
    sglang.script_of = lambda prompt: [rambles]

    episodes = rollout(args, group_of(args, "reply_only"))

    [replies, _] = sessions_of(sglang.generated, tokenizer, "Name a long yellow fruit.")
    for samples in episodes:
        [sample] = samples
        outcome = _outcome(sample)
        assert outcome.scored and sample.reward == 1.0 and outcome.reason is None
        [flag] = outcome.flags
        assert (flag.kind, flag.fatal) == (FlagKind.RESPONSE_LIMIT, False)
        assert (
            split_response(sample)[0] == replies[0].output and len(replies[0].output) == args.rollout_max_response_len
        )


def test_a_reply_cut_in_its_second_tool_call_ends_the_episode_its_whole_first_call_not_run(launch, sglang, tokenizer):
    args = launch(thinking=False)
    cut_in_the_second = tool_calls(
        tool_call("find_crate", {"name": "pears"}), tool_call("find_crate", {"name": "apples " * 2000})
    )
    sglang.script_of = lambda prompt: [cut_in_the_second, text("The crate of pears is on shelf 9C.")]

    episodes = rollout(args, group_of(args, "played"))

    for [sample] in episodes:
        outcome = _outcome(sample)
        assert (outcome.reason, outcome.model_calls, outcome.tool_calls) == ("response_limit", 1, 0)
        trained = tokenizer.decode(split_response(sample)[0])
        assert trained.startswith('<tool_call>\n{"name": "find_crate", "arguments": {"name": "pears"}}\n</tool_call>')
    assert len(sglang.requests) == 2
