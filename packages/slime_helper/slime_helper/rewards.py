"""GRPO advantages per episode for slime, when an episode comes back as several samples:

    --custom-reward-post-process-path slime_helper.rewards.normalize_per_episode

slime's own reward post-processing groups rewards by reshaping the batch into rows of ``--n-samples-per-prompt``,
which only lines up when every episode is one sample. With a sample per turn (Qwen3 with thinking off) the count is
off, and slime falls back to one group over the whole batch, where a long episode also counts once per turn. This
function groups by ``group_index`` (the prompt), takes one reward per episode (``rollout_id``), normalises across
the group's episodes as slime does, and gives each episode's value to all of its samples.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Sequence
from typing import Any

NORMALIZED_ESTIMATORS = frozenset({"grpo", "gspo", "cispo", "reinforce_plus_plus_baseline"})
"""The advantage estimators whose rewards slime centres per group when ``--rewards-normalization`` is on."""
STD_NORMALIZED_ESTIMATORS = frozenset({"grpo", "gspo", "cispo"})
"""Those of them slime also divides by the group's standard deviation under ``--grpo-std-normalization``."""
_STD_EPSILON = 1e-6


class EpisodeRewardMismatch(ValueError):
    """Samples of one episode carry different rewards, or lack the ids that say which episode they belong to."""


def normalizes_per_group(args: Namespace) -> bool:
    """Whether slime's launch ``args`` have rewards normalised per prompt group (slime's defaults do)."""
    return args.advantage_estimator in NORMALIZED_ESTIMATORS and bool(args.rewards_normalization)


def normalize_per_episode(args: Namespace, samples: Sequence[Any]) -> tuple[list[float], list[float]]:
    """slime's reward post-processing hook: ``(raw_rewards, rewards)``, one entry per sample of the flat batch
    ``samples``, as slime's ``RolloutManager._post_process_rewards`` returns them.

    Under a per-group launch (``normalizes_per_group``) each prompt group's episodes, one reward each, are centred on
    their mean and, for ``grpo``/``gspo``/``cispo`` with ``--grpo-std-normalization``, divided by their standard
    deviation plus 1e-6, with torch's float32 arithmetic; each episode's value goes to every one of its samples.
    When every episode is one sample this equals slime's own result. A group of a single episode gets 0 (slime's
    own would divide by the NaN standard deviation of one value). Otherwise the rewards pass through unchanged.

    Raises EpisodeRewardMismatch naming the episode when a sample has no ``group_index`` or ``rollout_id``, or
    when samples of one episode carry different rewards."""
    raw_rewards = [sample.get_reward_value(args) for sample in samples]
    if not normalizes_per_group(args):
        return raw_rewards, raw_rewards
    divide = args.advantage_estimator in STD_NORMALIZED_ESTIMATORS and bool(args.grpo_std_normalization)
    rewards = [0.0] * len(samples)
    for episodes in _groups(samples, raw_rewards).values():
        for positions, value in zip(episodes.values(), _normalized(episodes, raw_rewards, divide), strict=True):
            for position in positions:
                rewards[position] = value
    return raw_rewards, rewards


def _groups(samples: Sequence[Any], raw_rewards: list[float]) -> dict[int, dict[int, list[int]]]:
    """The positions of ``samples`` by prompt group, then by episode, in batch order; refuses a sample without ids
    and an episode whose samples disagree on the reward."""
    groups: dict[int, dict[int, list[int]]] = {}
    for position, sample in enumerate(samples):
        if sample.group_index is None or sample.rollout_id is None:
            raise EpisodeRewardMismatch(
                f"{_described(sample)} has group_index={sample.group_index!r} and rollout_id={sample.rollout_id!r}; "
                "per-episode normalisation needs both, as slime's data source and adapter set them"
            )
        groups.setdefault(sample.group_index, {}).setdefault(sample.rollout_id, []).append(position)
    for episodes in groups.values():
        for positions in episodes.values():
            rewards = [raw_rewards[position] for position in positions]
            if any(reward != rewards[0] for reward in rewards):
                raise EpisodeRewardMismatch(
                    f"{_described(samples[positions[0]])} comes back as {len(positions)} samples with rewards "
                    f"{rewards}; the samples of one episode must share its reward"
                )
    return groups


def _normalized(episodes: dict[int, list[int]], raw_rewards: list[float], divide: bool) -> list[float]:
    """One value per episode of a group: its reward less the group's mean, over the standard deviation when
    ``divide`` and the group has more than one episode."""
    import torch

    rewards = torch.tensor([raw_rewards[positions[0]] for positions in episodes.values()], dtype=torch.float)
    centred = rewards - rewards.mean()
    if divide and len(rewards) > 1:
        centred = centred / (rewards.std() + _STD_EPSILON)
    return centred.tolist()


def _described(sample: Any) -> str:
    """The episode a sample belongs to, as a person finds it in the rows and in slime's logs."""
    episode = (sample.metadata or {}).get("episode") or {}
    task = f"task {episode['task_name']!r} " if "task_name" in episode else ""
    return (
        f"the episode of {task}(sample index {sample.index}, group {sample.group_index}, rollout {sample.rollout_id})"
    )
