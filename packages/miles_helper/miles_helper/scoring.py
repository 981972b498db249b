"""The episode's reward as Miles' reward function (``--custom-rm-path miles_helper.reward``), and the dynamic
sampling filters (``--dynamic-sampling-filter-path``) on ``chat_core.record.filters``' rules:

- ``miles_helper.keep_scored_groups`` leaves out a group holding an episode with no reward to train on;
- ``miles_helper.keep_scored_nonzero_std_groups`` also leaves out a scored group whose episodes all earned the same
  reward (Miles' ``check_reward_nonzero_std``, applied per episode rather than per sample).

All read the outcome ``miles_helper.agent`` leaves in each sample's metadata. An episode that can't be trained on
gets reward None, Miles' own mark of a trial that errored (its eval logs count them as ``none_reward_ratio``), and the
filters drop its group with the reason ``chat_core.record.filters`` gives, which Miles counts as
``rollout/dynamic_filter/drop_<reason>``. A failed episode doesn't raise: Miles would then lose its whole group
without a count, stop an eval, or fail the rollout while it drains the episodes its abort cut short. Only the filters
keep a None out of training, so the reward refuses to score anything in a run launched without one of them: Miles
hands the agent no launch arguments, so the first reward is the earliest point that can see them.
"""

from __future__ import annotations

from typing import Any

from chat_core import EpisodeOutcome
from chat_core.record.filters import (
    Episode,
    episodes_of,
    require_filter,
    scored_group_drop,
    scored_nonzero_std_group_drop,
)
from miles.rollout.filter_hub.base_types import DynamicFilterOutput
from miles.utils.misc import load_function
from miles.utils.types import Sample


async def reward(
    args: Any, sample_or_samples: Sample | list[Sample], **kwargs: Any
) -> float | None | list[float | None]:
    """The reward of each sample's episode: a float when the env scored it, None when the episode can't be trained
    on. Takes one Sample (Miles' v1 session server) or a list (v2, or ``--group-rm``) and answers in kind.

    Raises chat_core's MissingFilter when the run's ``--dynamic-sampling-filter-path`` isn't one of this helper's
    filters, since nothing else would keep a None out of training."""
    configured = args.dynamic_sampling_filter_path
    require_filter("Miles", configured, configured and load_function(configured), FILTERS)
    if isinstance(sample_or_samples, list):
        return [_reward_of(sample) for sample in sample_or_samples]
    return _reward_of(sample_or_samples)


def keep_scored_groups(args: Any, group: list[Sample] | list[list[Sample]], **kwargs: Any) -> DynamicFilterOutput:
    """Keep a group only when every episode in it can be trained on. A group is a list of samples (v1) or a list
    of each episode's samples (v2)."""
    return _output(scored_group_drop(_episodes(group)))


def keep_scored_nonzero_std_groups(
    args: Any, group: list[Sample] | list[list[Sample]], **kwargs: Any
) -> DynamicFilterOutput:
    """``keep_scored_groups``, and leave out a group whose episodes all earned the same reward
    (``same_reward_<reward>``), which gives GRPO no signal."""
    return _output(scored_nonzero_std_group_drop(_episodes(group)))


FILTERS = {
    "miles_helper.keep_scored_groups": keep_scored_groups,
    "miles_helper.keep_scored_nonzero_std_groups": keep_scored_nonzero_std_groups,
}
"""This helper's filters by the import path a launch names them with."""


def _reward_of(sample: Sample) -> float | None:
    outcome = EpisodeOutcome.from_metadata(sample.metadata)
    return outcome.reward if outcome is not None else None


def _episodes(group: list[Sample] | list[list[Sample]]) -> list[Episode]:
    return episodes_of(group, Sample.Status.ABORTED)


def _output(reason: str | None) -> DynamicFilterOutput:
    return DynamicFilterOutput(keep=reason is None, reason=reason)
