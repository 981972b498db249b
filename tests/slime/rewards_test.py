"""``normalize_per_episode`` as slime's own ``RolloutManager._post_process_rewards`` calls it, on a batch where a
prompt group came back with one episode: its samples get an advantage of 0, never NaN, which would poison the
step's loss (slime's ``RolloutManager`` without its engines: ``rollout.rollout_manager``)."""

from __future__ import annotations

import copy
import math

import pytest
from rollout import rollout_manager
from slime.utils.types import Sample


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "cispo"])
def test_a_prompt_group_of_one_episode_gets_an_advantage_of_zero_not_nan(launch, estimator):
    args = copy.copy(launch())
    args.advantage_estimator = estimator
    args.grpo_std_normalization = True
    args.rewards_normalization = True
    samples = [
        Sample(group_index=0, index=0, rollout_id=0, reward=1.0),
        Sample(group_index=0, index=0, rollout_id=0, reward=1.0),
        Sample(group_index=1, index=2, rollout_id=2, reward=1.0),
        Sample(group_index=1, index=3, rollout_id=3, reward=0.0),
    ]

    raw_rewards, rewards = rollout_manager(args)._post_process_rewards(samples)

    assert raw_rewards == [1.0, 1.0, 1.0, 0.0]
    assert all(math.isfinite(reward) for reward in rewards), rewards
    assert rewards == pytest.approx([0.0, 0.0, 0.707106, -0.707106], abs=1e-6)
