"""A turn that can't be appended to the tokens its episode holds: played through slime's own rollout, adapter and
trajectory manager with Qwen3's tokenizer and the stand-in for SGLang, against the real env server, on ``ships``, a
task whose env lists one more tool once a crate was added, so that its second turn's tools differ from its first's.

The turn is rendered whole and starts a new sample, flagged ``turn_not_appended`` and counted, and every reply is
still trained exactly once: slime's manager, left to itself, would REALIGN the turn into the sample it builds and
stop training the reply before it. Under the fully-async rollout the split episode is left out, flagged
``episode_split``. A turn the helper fails to hold for the next one is flagged ``turn_not_recorded``."""

from __future__ import annotations

import asyncio
import json
import shutil
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path

import pytest
from chat_core import EpisodeOutcome
from chat_core.prepare import write_rows
from chat_core.record.metrics import rollout_log_metrics
from exact_samples import Prompts, exact_episode
from rollout import group_of, rollout
from sglang_stand_in import Generated
from slime.agent.trajectory import TrajectoryManager, TurnRecord
from slime.utils.types import Sample
from slime_helper import AdapterService
from slime_helper.chat_template import ChatTemplate
from slime_helper.tokenizers import AppendOnlyTokenizer
from test_support import SAMPLE_BUNDLE, serve_bundle, text, tool_call

SHIPS = [
    {"id": "annex", "type": "deploy_env", "env_id": "annex"},
    {"id": "agent", "type": "deploy_agent", "agent_name": "agent", "env_ids": ["annex"],
     "system_prompt": "You keep a warehouse annex. Use your tools."},
    {"id": "add", "type": "prompt_agent", "agent_name": "agent", "prompt_id": "add", "poll_interval_seconds": 0.2,
     "prompt": "A crate of plums has arrived. Add it."},
    {"id": "ship", "type": "prompt_agent", "agent_name": "agent", "prompt_id": "ship", "poll_interval_seconds": 0.2,
     "prompt": "Ship the plums, then say so."},
    {"id": "shipped", "type": "agent_prompt_response_verifier", "prompt_id": "ship", "verifier_id": "shipped",
     "criteria": [{"type": "response_contains", "criterion": "says shipped", "needles": ["shipped"]}]},
]  # fmt: skip
ANNEX = 'type = "local_tools"\nstock = { pears = "9C" }\nships = true\n'
"""A warehouse whose tools list ``ship_crate`` once a crate was added."""
SHIPPING = (
    tool_call("add_crate", {"name": "plums"}),
    text("<think>\nIt went to the dock.\n</think>\n\nThe plums are in."),
    tool_call("ship_crate", {"name": "plums"}),
    text("<think>\nDone.\n</think>\n\nThe plums are shipped."),
)
"""Qwen3 thinking; the second turn's first prompt, its tools changed, is rendered whole."""


@pytest.fixture(scope="module")
def ships(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The rows of a server serving ``ships`` with the annex's warehouse."""
    bundle = tmp_path_factory.mktemp("bundles") / "annex-env"
    (bundle / "tasks").mkdir(parents=True)
    shutil.copytree(SAMPLE_BUNDLE / "envs", bundle / "envs")
    (bundle / "envs" / "annex").mkdir()
    (bundle / "envs" / "annex" / "env.toml").write_text(ANNEX)
    (bundle / "tasks" / "ships.json").write_text(json.dumps(SHIPS))
    with serve_bundle(bundle) as served:
        rows = tmp_path_factory.mktemp("annex") / "rows"
        asyncio.run(write_rows(served.url, rows, progress=False))
        yield rows / "all.jsonl"


def sessions_of(generated: list[Generated], prompts: Prompts) -> dict[str, list[Generated]]:
    """The replies generated for each session whose prompts ``prompts`` kept, in order."""
    by_session: dict[str, list[Generated]] = {render.sid or "": [] for render in prompts.rendered}
    for reply in generated:
        if reply.routing_key in by_session:
            by_session[reply.routing_key].append(reply)
    return by_session


def test_a_turn_whose_tools_changed_starts_a_new_sample_flagged_and_counted_each_reply_trained_once(
    launch, ships, sglang, tokenizer, monkeypatch
):
    args = Namespace(**{**vars(launch()), "prompt_data": str(ships)})
    sglang.script_of = lambda prompt: SHIPPING
    prompts = Prompts(AdapterService.of(args).adapter.tokenizer, type(tokenizer), monkeypatch)

    episodes = rollout(args, group_of(args, "ships"))

    assert AdapterService.of(args).append_only
    for samples, (sid, replies) in zip(episodes, sessions_of(sglang.generated, prompts).items(), strict=True):
        assert len(samples) == 2 and len(replies) == len(SHIPPING)
        exact_episode(samples, prompts.of(sid), replies, ChatTemplate(tokenizer, {}))
        outcome = EpisodeOutcome.from_metadata(samples[0].metadata)
        assert outcome.scored and outcome.reward == 1.0 and outcome.turns_not_appended == 1
        [flag] = [flag for flag in outcome.flags if str(flag.kind) == "turn_not_appended"]
        assert not flag.fatal
        assert flag.message.startswith(
            "model call 3's prompt couldn't be appended to the tokens of the turn before (its chat doesn't extend the "
            "last turn's with the same tools)"
        )
    metrics = rollout_log_metrics([sample for samples in episodes for sample in samples])
    assert metrics["rollout/episode/turns_not_appended_mean"] == 1.0
    assert metrics["rollout/episode/samples_per_episode"] == 2.0


def test_the_adapters_manager_forks_a_turn_slimes_default_one_would_realign_untraining_the_reply_before(launch):
    """slime's default manager REALIGNs a turn whose prompt parts from the held tokens inside the last reply (when
    the turn's own reply is shorter than 1,024 tokens), overwriting that reply with the prompt's tokens, untrained;
    the adapter's starts a new sample there."""
    first = TurnRecord(prompt_ids=[1, 2], output_ids=[7, 8, 9], finish_reason="stop", output_log_probs=[-0.1] * 3)
    realigned = TurnRecord(prompt_ids=[1, 2, 7, 5, 6], output_ids=[4], finish_reason="stop", output_log_probs=[-0.2])
    chat = [{"role": "user", "content": "Add the plums."}]
    samples = {}
    for name, manager in (("default", TrajectoryManager()), ("helper", AdapterService.of(launch()).adapter.manager)):
        manager.record_turn("sid", turn=first, prompt_messages=chat, response_message={"role": "assistant"})
        answered = [*chat, {"role": "assistant"}, {"role": "user", "content": "Ship them."}]
        manager.record_turn("sid", turn=realigned, prompt_messages=answered, response_message=None)
        samples[name] = manager.get_trajectory("sid", base_sample=Sample(index=0))

    [merged] = samples["default"]
    assert merged.loss_mask == [0, 0, 0, 1]
    assert [sample.loss_mask for sample in samples["helper"]] == [[1, 1, 1], [1]]


def test_under_the_fully_async_rollout_such_an_episode_is_flagged_split_and_left_out(launch, ships, sglang):
    args = Namespace(
        **{
            **vars(launch(extra=("--rollout-function-path", "slime_helper.generate_rollout_fully_async"))),
            "prompt_data": str(ships),
        }
    )
    sglang.script_of = lambda prompt: SHIPPING

    played = rollout(args, group_of(args, "ships"))

    for sample in played:
        assert sample.status == Sample.Status.FAILED and sample.remove_sample and sample.loss_mask == [0]
        outcome = EpisodeOutcome.from_metadata(sample.metadata)
        assert (outcome.reward, outcome.reason) == (None, "episode_split")
        assert {str(flag.kind) for flag in outcome.flags} >= {"turn_not_appended", "episode_split"}


@pytest.mark.parametrize(
    ("failing", "not_appended"),
    [(1, ["model call 2", "model call 3"]), (3, ["model call 3", "model call 4"])],
    ids=["first-turn", "third-turn"],
)
def test_a_turn_the_helper_fails_to_hold_for_the_next_one_is_flagged_and_every_reply_still_trained_once(
    failing, not_appended, launch, ships, sglang, tokenizer, monkeypatch
):
    args = Namespace(**{**vars(launch()), "prompt_data": str(ships)})
    sglang.script_of = lambda prompt: SHIPPING
    prompts = Prompts(AdapterService.of(args).adapter.tokenizer, type(tokenizer), monkeypatch)
    record = AppendOnlyTokenizer.record

    def fails_on_one_turn(self, sid, messages, *recorded):
        if sum(message["role"] == "assistant" for message in messages) + 1 == failing:
            raise MemoryError("no room to hold the turn")
        record(self, sid, messages, *recorded)

    monkeypatch.setattr(AppendOnlyTokenizer, "record", fails_on_one_turn)

    episodes = rollout(args, group_of(args, "ships"))

    for samples, (sid, replies) in zip(episodes, sessions_of(sglang.generated, prompts).items(), strict=True):
        exact_episode(samples, prompts.of(sid), replies, ChatTemplate(tokenizer, {}))
        outcome = EpisodeOutcome.from_metadata(samples[0].metadata)
        assert outcome.scored
        [unrecorded] = [flag for flag in outcome.flags if str(flag.kind) == "turn_not_recorded"]
        assert not unrecorded.fatal
        assert unrecorded.message == (
            f"model call {failing}'s turn couldn't be held for the next one (MemoryError: no room to hold the turn), "
            "so the next turn is rendered whole"
        )
        flagged = [flag.message for flag in outcome.flags if str(flag.kind) == "turn_not_appended"]
        assert outcome.turns_not_appended == 2
        assert [message.partition("'s prompt")[0] for message in flagged] == not_appended
