"""``miles_helper.reward`` and ``miles_helper.keep_scored_groups`` on Miles' own Samples, called the way Miles calls
them: its reward step (``async_rm`` for one sample, ``batched_async_rm`` for a list) and ``call_dynamic_filter``, with
arguments from Miles' parse_args."""

from __future__ import annotations

import asyncio
from argparse import Namespace
from pathlib import Path
from unittest.mock import patch

import pytest
from miles.rollout.filter_hub.base_types import call_dynamic_filter
from miles.rollout.rm_hub import async_rm, batched_async_rm
from miles.utils.misc import load_function
from miles.utils.types import Sample
from miles_helper import FilterMissing, keep_scored_groups

SCORED = {"episode_reward": 1.0, "episode_flags": []}
NOTED = {
    "episode_reward": 0.5,
    "episode_flags": [{"kind": "bad_tool_arguments", "message": "turn 1: find_crate: not JSON", "fatal": False}],
}
FAILED = {
    "episode_reward": None,
    "episode_flags": [{"kind": "env_failed", "message": "the verifier 'scanned' raised", "fatal": True}],
}


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
    """A launch whose dynamic filter is ours."""
    return _args(checkpoint, "--dynamic-sampling-filter-path", "miles_helper.keep_scored_groups")


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


def test_a_scored_episode_gives_its_reward(filtered):
    assert asyncio.run(async_rm(filtered, _sample(SCORED))) == 1.0
    assert asyncio.run(async_rm(filtered, _sample(NOTED))) == 0.5


def test_a_list_of_samples_gets_a_list_of_rewards(filtered):
    samples = [_sample(SCORED), _sample(FAILED), _sample(NOTED)]
    asyncio.run(batched_async_rm(filtered, samples, inplace_set_reward_field=True))
    assert [sample.reward for sample in samples] == [1.0, None, 0.5]


@pytest.mark.parametrize("metadata", [FAILED, None], ids=["flagged", "no_outcome"])
def test_an_unscored_episode_has_no_reward_when_the_filter_keeps_it_out(filtered, metadata):
    assert asyncio.run(async_rm(filtered, _sample(metadata))) is None


@pytest.mark.parametrize("metadata", [FAILED, None], ids=["flagged", "no_outcome"])
def test_an_unscored_episode_is_refused_when_nothing_keeps_it_out_of_training(unfiltered, metadata):
    with pytest.raises(FilterMissing) as refused:
        asyncio.run(async_rm(unfiltered, _sample(metadata)))
    assert "--dynamic-sampling-filter-path miles_helper.keep_scored_groups" in str(refused.value)


def test_the_refusal_names_the_episode_and_what_went_wrong(unfiltered):
    with pytest.raises(FilterMissing) as refused:
        asyncio.run(async_rm(unfiltered, _sample(FAILED)))
    assert "'task_name': 'played'" in str(refused.value)
    assert "env_failed: the verifier 'scanned' raised" in str(refused.value)


def test_a_scored_episode_needs_no_filter(unfiltered):
    assert asyncio.run(async_rm(unfiltered, _sample(SCORED))) == 1.0


def _filter(args: Namespace, group: list) -> tuple[bool, str | None]:
    output = call_dynamic_filter(load_function(args.dynamic_sampling_filter_path), args, group)
    return output.keep, output.reason


def test_a_group_of_scored_episodes_is_kept(filtered):
    assert _filter(filtered, [_sample(SCORED), _sample(NOTED)]) == (True, None)
    assert _filter(filtered, [[_sample(SCORED), _sample(SCORED)], [_sample(NOTED)]]) == (True, None)


def test_a_v1_group_holding_a_flagged_episode_is_left_out_with_the_flags_kind(filtered):
    assert _filter(filtered, [_sample(SCORED), _sample(FAILED)]) == (False, "env_failed")


def test_a_v2_group_holding_a_flagged_leaf_is_left_out_with_the_flags_kind(filtered):
    assert _filter(filtered, [[_sample(SCORED)], [_sample(SCORED), _sample(FAILED)]]) == (False, "env_failed")


def test_a_group_holding_a_sample_miles_aborted_is_left_out(filtered):
    aborted = _sample(None, Sample.Status.ABORTED)
    assert keep_scored_groups(filtered, [_sample(SCORED), aborted]).reason == "sample_aborted"


def test_a_group_holding_a_sample_without_an_outcome_is_left_out(filtered):
    assert keep_scored_groups(filtered, [[_sample(SCORED)], [_sample(None)]]).reason == "no_episode_outcome"
