"""Our samples through Miles' own train-data conversion (``postprocess_rollout_data`` then
``convert_samples_to_train_data``, as Miles' rollout manager runs them), after a rollout through Miles' agentic
path: Miles already normalises one reward per rollout within each prompt group, so Miles needs no reward
post-processing of ours. Under Qwen3's TITO an episode is one sample, the shape Miles' conversion takes as it is."""

from __future__ import annotations

import statistics

import pytest
from miles.ray.rollout.rollout_data_conversion import postprocess_rollout_data
from miles.ray.rollout.train_data_conversion import convert_samples_to_train_data
from test_support import text

TASKS = ["reply_only", "two_turns", "scores_zero"]
"""A group whose two episodes score 1 and 0 (the stand-in answers them in turn), and two whose episodes all score
the same, 1 and 0."""


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_miles_gives_each_episode_its_advantage_within_its_prompt_group(miles, version):
    args = miles.args(
        TASKS,
        version=version,
        extra=["--n-samples-per-prompt", "2", "--rollout-batch-size", "3", "--global-batch-size", "6"],
    )
    miles.chat.take_turns(miles.prompt("reply_only"), [text("A banana."), text("A cherry.")])
    output = miles.rollout(args)

    data, metadata = postprocess_rollout_data(args, output.samples, {"dp_size": 1})
    train = convert_samples_to_train_data(args, data, metadata, None, None)

    assert len(data) == len(TASKS) * args.n_samples_per_prompt
    by_task: dict[str, list[tuple[float, float]]] = {}
    for sample, advantage in zip(data, train["rewards"], strict=True):
        by_task.setdefault(miles.task_of(sample), []).append((sample.reward, round(advantage, 6)))
    assert sorted(by_task["reply_only"]) == [(0.0, -0.707106), (1.0, 0.707106)]
    assert by_task["two_turns"] == [(1.0, 0.0), (1.0, 0.0)]
    assert by_task["scores_zero"] == [(0.0, 0.0), (0.0, 0.0)]
    rewards = [sample.reward for sample in data]
    batch_wide = [(r - statistics.mean(rewards)) / statistics.stdev(rewards) for r in rewards]
    assert train["rewards"] != pytest.approx(batch_wide, abs=1e-3)
    assert len(set(train["rollout_ids"])) == len(data)
    assert train["rollout_mask_sums"] == [sum(mask) for mask in train["loss_masks"]]
    assert [len(mask) for mask in train["loss_masks"]] == train["response_lengths"]
