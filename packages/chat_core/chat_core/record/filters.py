"""The rules by which both trainer helpers' dynamic-sampling filters keep or drop a prompt group, read from its
episodes' outcomes, and the refusal to train without one of them.

A group is dropped when one of its episodes can't be trained on, with the reason a trainer counts drops by: the
kind of the episode's first fatal flag (``env_failed``, ``model_deadline``, ``rollout_aborted``, ...),
``sample_aborted`` when the trainer aborted a sample itself, or ``no_episode_outcome`` when no helper of ours wrote
the sample. The combined rule, for GRPO, also drops a scored group whose episodes all earned the same reward
(``same_reward_<reward>``), which teaches nothing: the trainers' own nonzero-std rule, applied to one reward per
episode rather than one per sample."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chat_core.record.outcome import EpisodeOutcome

SAMPLE_ABORTED = "sample_aborted"
NO_OUTCOME = "no_episode_outcome"
SAME_REWARD = "same_reward"


class MissingFilter(RuntimeError):
    """A trainer was launched without one of this project's dynamic-sampling filters, so an episode with no reward
    would train as if it had one."""


@dataclass(frozen=True)
class Episode:
    """What a filter reads of one episode of a group: its outcome (None when the samples hold none) and whether the
    trainer marked a sample of it aborted."""

    outcome: EpisodeOutcome | None
    aborted: bool


def episodes_of(group: Sequence[Any], aborted_status: object) -> list[Episode]:
    """The episodes of a prompt group as slime and Miles hand it to a dynamic filter: for each episode one sample or
    the list of its samples, each carrying a helper's outcome in its ``metadata`` (read from the first) and the
    trainer's ``status``, ``aborted_status`` being the status the trainer gives a sample it aborted."""
    episodes = []
    for entry in group:
        samples = entry if isinstance(entry, list) else [entry]
        outcome = EpisodeOutcome.from_metadata(samples[0].metadata)
        episodes.append(Episode(outcome, any(sample.status == aborted_status for sample in samples)))
    return episodes


def unscored_reason(episode: Episode) -> str | None:
    """Why ``episode`` can't be trained on, as a drop reason; None when it can."""
    if episode.outcome is not None and not episode.outcome.scored:
        return episode.outcome.reason or NO_OUTCOME
    if episode.aborted:
        return SAMPLE_ABORTED
    if episode.outcome is None:
        return NO_OUTCOME
    return None


def scored_group_drop(episodes: Sequence[Episode]) -> str | None:
    """The reason to drop a group holding an episode that can't be trained on, or None to keep it."""
    return next((reason for episode in episodes if (reason := unscored_reason(episode)) is not None), None)


def scored_nonzero_std_group_drop(episodes: Sequence[Episode]) -> str | None:
    """``scored_group_drop``'s reason, else ``same_reward_<reward>`` when every episode earned the same reward, else
    None to keep the group."""
    if (reason := scored_group_drop(episodes)) is not None:
        return reason
    rewards = {episode.outcome.reward for episode in episodes if episode.outcome is not None}
    if len(rewards) == 1:
        return f"{SAME_REWARD}_{rewards.pop():g}"
    return None


def require_filter(trainer: str, configured: str | None, resolved: object, ours: Mapping[str, object]) -> None:
    """Raise MissingFilter unless the launch's ``--dynamic-sampling-filter-path`` (``configured``, which the
    trainer's loader resolved to ``resolved``) is one of ``ours`` (import path → function), naming them."""
    if configured is not None and any(resolved is function for function in ours.values()):
        return
    first, *others = ours
    raise MissingFilter(
        f"{trainer} was launched with --dynamic-sampling-filter-path {configured!r}; launch it with "
        f"--dynamic-sampling-filter-path {first}" + "".join(f" (or {other})" for other in others) + ". An episode "
        "the env or the model failed has no reward, and only these filters keep its group out of training"
    )
