"""``miles_helper.reward`` and the two filters on Miles' own Samples, called the way Miles calls them: its reward
step (``async_rm`` for one sample, ``batched_async_rm`` for a list) and ``call_dynamic_filter``, with arguments from
Miles' parse_args."""

from __future__ import annotations

import asyncio
from argparse import Namespace
from pathlib import Path
from unittest.mock import patch

import pytest
from chat_core import OUTCOME_KEY, EpisodeOutcome, Flag, FlagKind, MissingFilter
from miles.rollout.filter_hub.base_types import call_dynamic_filter
from miles.rollout.rm_hub import async_rm, batched_async_rm
from miles.utils.misc import load_function
from miles.utils.types import Sample


def _outcome(reward: float | None, *flags: Flag) -> dict:
    fatal = [flag for flag in flags if flag.fatal]
    outcome = EpisodeOutcome(
        reward=None if fatal else reward,
        scored=not fatal and reward is not None,
        reason=str(fatal[0].kind) if fatal else None,
        flags=flags,
        turns=1,
        model_calls=2,
        tool_calls=1,
        tool_errors=0,
        env_s=1.0,
        model_s=0.5,
        capacity_wait_s=0.0,
        wall_s=1.6,
        truncated=False,
        env_server=None,
    )
    return {OUTCOME_KEY: outcome.to_metadata()}


SCORED = _outcome(1.0)
ZERO = _outcome(0.0)
NOTED = _outcome(0.5, Flag(FlagKind.BAD_TOOL_ARGUMENTS, "turn 1: find_crate: not JSON"))
FAILED = _outcome(None, Flag(FlagKind.ENV_FAILED, "the verifier 'scanned' raised"))
SCORED_FILTER = "miles_helper.keep_scored_groups"
NONZERO_STD_FILTER = "miles_helper.keep_scored_nonzero_std_groups"


def _args(checkpoint: Path, *flags: str) -> Namespace:
    from miles.utils.arguments import parse_args

    argv = [
        "train.py",
        "--train-backend", "fsdp",
        "--hf-checkpoint", str(checkpoint),
        "--rollout-batch-size", "1",
        "--num-rollout", "1",
        "--rollout-num-gpus", "1",
        "--custom-rm-path", "miles_helper.reward",
        *flags,
    ]  # fmt: skip
    with patch("sys.argv", argv):
        return parse_args()


@pytest.fixture(scope="module")
def filtered(checkpoint: Path) -> Namespace:
    """A launch whose dynamic filter is ``keep_scored_groups``."""
    return _args(checkpoint, "--dynamic-sampling-filter-path", SCORED_FILTER)


@pytest.fixture(scope="module")
def nonzero_std(checkpoint: Path) -> Namespace:
    """A launch whose dynamic filter is ``keep_scored_nonzero_std_groups``."""
    return _args(checkpoint, "--dynamic-sampling-filter-path", NONZERO_STD_FILTER)


@pytest.fixture(scope="module")
def unfiltered(checkpoint: Path) -> Namespace:
    """A launch with Miles' own dynamic filter instead of ours."""
    return _args(
        checkpoint,
        "--dynamic-sampling-filter-path",
        "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
    )


def _sample(metadata: dict | None, status: Sample.Status = Sample.Status.COMPLETED) -> Sample:
    episode = {"episode": {"split": "all", "index": 0, "task_id": "t", "task_name": "played"}}
    return Sample(metadata={**episode, **(metadata or {})}, status=status)


def test_a_scored_episode_gives_its_reward(filtered, nonzero_std):
    assert asyncio.run(async_rm(filtered, _sample(SCORED))) == 1.0
    assert asyncio.run(async_rm(nonzero_std, _sample(NOTED))) == 0.5


def test_a_list_of_samples_gets_a_list_of_rewards(filtered):
    samples = [_sample(SCORED), _sample(FAILED), _sample(NOTED)]
    asyncio.run(batched_async_rm(filtered, samples, inplace_set_reward_field=True))
    assert [sample.reward for sample in samples] == [1.0, None, 0.5]


@pytest.mark.parametrize("metadata", [FAILED, None], ids=["flagged", "no_outcome"])
def test_an_unscored_episode_has_no_reward_when_the_filter_keeps_it_out(filtered, metadata):
    assert asyncio.run(async_rm(filtered, _sample(metadata))) is None


@pytest.mark.parametrize("metadata", [SCORED, FAILED], ids=["scored", "flagged"])
def test_the_first_reward_of_a_run_without_one_of_our_filters_refuses_naming_both(unfiltered, metadata):
    with pytest.raises(MissingFilter) as refused:
        asyncio.run(async_rm(unfiltered, _sample(metadata)))
    assert f"--dynamic-sampling-filter-path {SCORED_FILTER} (or {NONZERO_STD_FILTER})" in str(refused.value)
    assert "check_reward_nonzero_std" in str(refused.value)


def _filter(args: Namespace, group: list) -> tuple[bool, str | None]:
    output = call_dynamic_filter(load_function(args.dynamic_sampling_filter_path), args, group)
    return output.keep, output.reason


def test_a_group_of_scored_episodes_is_kept(filtered):
    assert _filter(filtered, [_sample(SCORED), _sample(NOTED)]) == (True, None)
    assert _filter(filtered, [[_sample(SCORED), _sample(SCORED)], [_sample(NOTED)]]) == (True, None)


def test_a_v1_group_holding_a_flagged_episode_is_left_out_with_the_flags_kind(filtered, nonzero_std):
    assert _filter(filtered, [_sample(SCORED), _sample(FAILED)]) == (False, "env_failed")
    assert _filter(nonzero_std, [_sample(ZERO), _sample(FAILED)]) == (False, "env_failed")


def test_a_v2_group_holding_a_flagged_leaf_is_left_out_with_the_flags_kind(filtered):
    assert _filter(filtered, [[_sample(SCORED)], [_sample(FAILED), _sample(FAILED)]]) == (False, "env_failed")


def test_a_group_holding_a_sample_miles_aborted_is_left_out(filtered):
    aborted = _sample(None, Sample.Status.ABORTED)
    assert _filter(filtered, [_sample(SCORED), aborted]) == (False, "sample_aborted")


def test_a_group_holding_a_sample_without_an_outcome_is_left_out(filtered):
    assert _filter(filtered, [[_sample(SCORED)], [_sample(None)]]) == (False, "no_episode_outcome")


def test_the_combined_filter_leaves_out_a_scored_group_whose_episodes_all_earned_the_same(filtered, nonzero_std):
    same = [[_sample(SCORED), _sample(SCORED)], [_sample(SCORED)]]
    assert _filter(nonzero_std, same) == (False, "same_reward_1")
    assert _filter(nonzero_std, [_sample(ZERO), _sample(ZERO)]) == (False, "same_reward_0")
    assert _filter(filtered, same) == (True, None)


def test_the_combined_filter_keeps_a_scored_group_whose_episodes_differ(nonzero_std):
    assert _filter(nonzero_std, [[_sample(SCORED), _sample(SCORED)], [_sample(ZERO)]]) == (True, None)
