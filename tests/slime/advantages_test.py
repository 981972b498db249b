"""GRPO advantages per episode, through slime's own train-data conversion (``rollout.rollout_manager``): groups read
by slime's data source, played through ``generate_and_rm_group`` with thinking off and the append-only rendering off
(``episode_append_only_chat: false``: a sample per turn, as a fork still gives where the rendering is on), kept or
dropped by the launch's dynamic filter, flattened as slime's rollout manager does, and converted by
``RolloutManager``'s own ``_post_process_rewards`` and ``_convert_samples_to_train_data`` with the launch's
``--custom-reward-post-process-path`` resolved by slime's ``load_function``."""

from __future__ import annotations

import copy
import statistics
from collections import defaultdict

import pytest
from rollout import SAMPLE_PER_TURN, TASKS, first_hits_then_misses, played_batch, rollout_manager
from slime.utils.types import Sample
from slime_helper import EpisodeRewardMismatch, normalize_per_episode


def episodes_of(samples) -> dict[int, dict[int, list[int]]]:
    """The positions of ``samples`` by group index, then by rollout id."""
    episodes: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for position, sample in enumerate(samples):
        episodes[sample.group_index][sample.rollout_id].append(position)
    return episodes


def per_episode_grpo(samples) -> list[float]:
    """GRPO's advantage per episode within each prompt group, worked out by hand, for every sample."""
    expected = [0.0] * len(samples)
    for group in episodes_of(samples).values():
        rewards = [samples[positions[0]].reward for positions in group.values()]
        mean, spread = statistics.mean(rewards), statistics.stdev(rewards)
        for positions, reward in zip(group.values(), rewards, strict=True):
            for position in positions:
                expected[position] = (reward - mean) / (spread + 1e-6)
    return expected


def batch_wide_grpo(samples) -> list[float]:
    """What slime's own normalisation gives when the sample count isn't a whole batch: one group of samples."""
    rewards = [sample.reward for sample in samples]
    mean, spread = statistics.mean(rewards), statistics.stdev(rewards)
    return [(reward - mean) / (spread + 1e-6) for reward in rewards]


@pytest.fixture
def batch(launch, sglang, env_server):
    args = launch(thinking=False, config=SAMPLE_PER_TURN)
    sglang.script_of = first_hits_then_misses(env_server)
    return args, played_batch(args)


def test_each_episode_of_several_samples_gets_one_advantage_within_its_prompt_group(batch):
    args, samples = batch
    train = rollout_manager(args)._convert_samples_to_train_data(samples)

    tasks = {sample.group_index: sample.metadata["episode"]["task_name"] for sample in samples}
    assert sorted(tasks.values()) == sorted(set(TASKS) - {"fails_after_the_turn"})
    sizes = {tasks[group]: sorted(len(p) for p in eps.values()) for group, eps in episodes_of(samples).items()}
    assert sizes == {"two_turns": [2, 2], "played": [1, 2], "reply_only": [1, 1], "scores_zero": [1, 1]}
    assert len(samples) != args.n_samples_per_prompt * args.rollout_batch_size

    by_task = {
        tasks[group]: sorted({round(train["rewards"][p], 6) for ps in eps.values() for p in ps})
        for group, eps in episodes_of(samples).items()
    }
    assert by_task == {
        "two_turns": [-0.707106, 0.707106],
        "played": [-0.707106, 0.707106],
        "reply_only": [0.0],
        "scores_zero": [0.0],
    }
    assert train["rewards"] == pytest.approx(per_episode_grpo(samples), abs=1e-6)
    assert train["raw_reward"] == [sample.reward for sample in samples]


def test_siblings_share_their_rollout_and_slime_counts_each_rollout_once(batch):
    args, samples = batch
    train = rollout_manager(args)._convert_samples_to_train_data(samples)

    for group in episodes_of(samples).values():
        for rollout_id, positions in group.items():
            assert {train["rollout_ids"][p] for p in positions} == {rollout_id}
            assert len({train["rewards"][p] for p in positions}) == 1
            whole = sum(sum(train["loss_masks"][p]) for p in positions)
            assert [train["rollout_mask_sums"][p] for p in positions] == [whole] * len(positions)
    assert [len(mask) for mask in train["loss_masks"]] == train["response_lengths"]
    assert all(sum(mask) > 0 for mask in train["loss_masks"])
    assert len(set(train["rollout_ids"])) == 4 * args.n_samples_per_prompt < len(train["rollout_ids"])


def test_without_the_function_slime_normalises_over_the_whole_batch_once_per_sample(batch):
    args, samples = batch
    train = rollout_manager(args, post_process=False)._convert_samples_to_train_data(samples)

    assert train["rewards"] == pytest.approx(batch_wide_grpo(samples), abs=1e-5)
    assert train["rewards"] != pytest.approx(per_episode_grpo(samples), abs=1e-3)
    all_scoring_one = [p for p, s in enumerate(samples) if s.metadata["episode"]["task_name"] == "reply_only"]
    assert [round(train["rewards"][p], 3) for p in all_scoring_one] == [0.87, 0.87]


@pytest.mark.parametrize(
    ("estimator", "std_normalization", "normalization"),
    [
        ("grpo", True, True),
        ("grpo", False, True),
        ("gspo", True, True),
        ("cispo", True, True),
        ("reinforce_plus_plus_baseline", True, True),
        ("grpo", True, False),
        ("ppo", True, True),
    ],
)
def test_with_one_sample_per_episode_it_equals_slimes_own_normalisation(
    launch, estimator, std_normalization, normalization
):
    args = copy.copy(launch())
    args.advantage_estimator = estimator
    args.grpo_std_normalization = std_normalization
    args.rewards_normalization = normalization
    rewards = [1.0, 0.0, 0.5, 0.5, 1.0, 1.0, 0.25, 0.0]
    samples = [Sample(group_index=i // 2, index=i, rollout_id=i, reward=r) for i, r in enumerate(rewards)]
    assert len(samples) == args.n_samples_per_prompt * args.rollout_batch_size

    ours = rollout_manager(args)._post_process_rewards(samples)
    slimes = rollout_manager(args, post_process=False)._post_process_rewards(samples)

    assert ours[0] == slimes[0] == rewards
    assert ours[1] == pytest.approx(slimes[1], abs=1e-6)


def test_siblings_with_different_rewards_are_refused_naming_the_episode(launch):
    args = launch()
    metadata = {"episode": {"task_name": "two_turns"}}
    samples = [
        Sample(group_index=3, index=6, rollout_id=6, reward=1.0, metadata=metadata),
        Sample(group_index=3, index=6, rollout_id=6, reward=0.0, metadata=metadata),
        Sample(group_index=3, index=7, rollout_id=7, reward=0.0, metadata=metadata),
    ]

    with pytest.raises(EpisodeRewardMismatch, match=r"task 'two_turns' \(sample index 6, group 3, rollout 6\).*"):
        normalize_per_episode(args, samples)


@pytest.mark.parametrize("missing", ["group_index", "rollout_id"])
def test_a_sample_without_its_group_or_rollout_is_refused_naming_it(launch, missing):
    args = launch()
    sample = Sample(group_index=1, index=2, rollout_id=2, reward=1.0, metadata={"episode": {"task_name": "played"}})
    setattr(sample, missing, None)

    with pytest.raises(EpisodeRewardMismatch, match=rf"task 'played'.*{missing}=None"):
        normalize_per_episode(args, [sample])
