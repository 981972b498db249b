"""The episode's reward as Miles' reward function (``--custom-rm-path miles_helper.reward``), and the dynamic
sampling filter (``--dynamic-sampling-filter-path miles_helper.keep_scored_groups``) that keeps every group holding an
unscored episode out of training.

Both read the outcome ``miles_helper.agent`` leaves in each sample's metadata. An episode the env failed, that ended
without a reward, ran past a limit or was aborted has no reward to train on. Its reward is None, Miles' own mark of
a trial that errored (its eval logs count them as ``none_reward_ratio``), and the filter drops its group with the
flag's kind as the reason, which Miles counts as ``rollout/dynamic_filter/drop_<kind>``. A failed episode doesn't
raise: Miles would then lose its whole group without a count, stop an eval, or fail the rollout while it drains the
episodes its abort cut short. Only the filter keeps a None out of training, so the reward refuses to leave an episode
unscored in a run launched without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from miles.rollout.filter_hub.base_types import DynamicFilterOutput
from miles.utils.misc import load_function
from miles.utils.types import Sample

from miles_helper.agent import FLAGS_KEY, REWARD_KEY

NO_OUTCOME = "no_episode_outcome"
ABORTED = "sample_aborted"


class FilterMissing(RuntimeError):
    """An episode is unscored in a run whose dynamic filter wouldn't keep it out of training."""


async def reward(
    args: Any, sample_or_samples: Sample | list[Sample], **kwargs: Any
) -> float | None | list[float | None]:
    """The reward of each sample's episode: a float when the env scored it, None when the episode can't be trained
    on. Takes one Sample (Miles' v1 session server) or a list (v2, or ``--group-rm``) and answers in kind.

    Raises FilterMissing for an unscored episode when the run's ``--dynamic-sampling-filter-path`` isn't
    ``miles_helper.keep_scored_groups``, since nothing else would keep its None out of training."""
    if isinstance(sample_or_samples, list):
        return [_reward_of(args, sample) for sample in sample_or_samples]
    return _reward_of(args, sample_or_samples)


def keep_scored_groups(args: Any, group: list[Sample] | list[list[Sample]]) -> DynamicFilterOutput:
    """Keep a group only when every episode in it was scored. A group is a list of samples (v1) or a list of each
    episode's samples (v2). A dropped group's reason is the kind of the first unscored episode's first fatal flag
    (``env_failed``, ``model_deadline``, ``rollout_aborted``, ...), ``sample_aborted`` for a sample Miles aborted
    itself (e.g. an episode that failed before the model spoke), or ``no_episode_outcome`` when no outcome of
    ``miles_helper.agent`` reached the sample."""
    for sample in _samples_of(group):
        if (why := _unscored_because(sample)) is not None:
            return DynamicFilterOutput(keep=False, reason=why)
    return DynamicFilterOutput(keep=True)


def _reward_of(args: Any, sample: Sample) -> float | None:
    value = sample.metadata.get(REWARD_KEY)
    if value is None and load_function(args.dynamic_sampling_filter_path) is not keep_scored_groups:
        raise FilterMissing(
            f"the episode {sample.metadata.get('episode')} has no reward to train on "
            f"({_unscored_because(sample)}: {_messages(sample)}), and only miles_helper.keep_scored_groups keeps "
            f"it out of training; launch Miles with --dynamic-sampling-filter-path miles_helper.keep_scored_groups "
            f"(it is {args.dynamic_sampling_filter_path!r})"
        )
    return value


def _unscored_because(sample: Sample) -> str | None:
    """Why ``sample``'s episode can't be trained on, as a filter reason; None when it can."""
    flags = sample.metadata.get(FLAGS_KEY)
    fatal = [flag["kind"] for flag in flags or () if flag.get("fatal")]
    if fatal:
        return fatal[0]
    if sample.status == Sample.Status.ABORTED:
        return ABORTED
    if flags is None or sample.metadata.get(REWARD_KEY) is None:
        return NO_OUTCOME
    return None


def _messages(sample: Sample) -> str:
    flags = sample.metadata.get(FLAGS_KEY) or ()
    return "; ".join(flag["message"] for flag in flags if flag.get("fatal")) or "no flag was recorded"


def _samples_of(group: list[Sample] | list[list[Sample]]) -> Iterator[Sample]:
    for member in group:
        if isinstance(member, list):
            yield from member
        else:
            yield member
