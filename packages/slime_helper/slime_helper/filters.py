"""slime's dynamic-sampling filters (``--dynamic-sampling-filter-path``), on ``chat_core.record.filters``' rules:

- ``slime_helper.keep_scored_groups`` leaves out a group holding an episode with no reward to train on;
- ``slime_helper.keep_scored_nonzero_std_groups`` also leaves out a scored group whose episodes all earned the same
  reward (slime's ``check_reward_nonzero_std``, applied per episode rather than per sample).

slime counts each drop under its reason. A group is as ``generate_and_rm_group`` returns it: a sample or a list of
samples per episode."""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from chat_core.record.filters import Episode, episodes_of, scored_group_drop, scored_nonzero_std_group_drop

from slime_helper._slime import slime


def keep_scored_groups(args: Namespace, samples: list, **kwargs: Any) -> Any:
    """Keep a group only when every episode in it can be trained on; the reason otherwise is the first unscored
    episode's (``chat_core.record.filters``)."""
    return _output(scored_group_drop(_episodes(samples)))


def keep_scored_nonzero_std_groups(args: Namespace, samples: list, **kwargs: Any) -> Any:
    """``keep_scored_groups``, and leave out a group whose episodes all earned the same reward
    (``same_reward_<reward>``), which gives GRPO no signal."""
    return _output(scored_nonzero_std_group_drop(_episodes(samples)))


FILTERS = {
    "slime_helper.keep_scored_groups": keep_scored_groups,
    "slime_helper.keep_scored_nonzero_std_groups": keep_scored_nonzero_std_groups,
}
"""This helper's filters by the import path a launch names them with."""


def _episodes(samples: list) -> list[Episode]:
    return episodes_of(samples, slime().Sample.Status.ABORTED)


def _output(reason: str | None) -> Any:
    return slime().DynamicFilterOutput(keep=reason is None, reason=reason)
