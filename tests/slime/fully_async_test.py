"""slime's fully-async rollout with this helper: ``slime_helper.generate_rollout_fully_async`` as
``--rollout-function-path``, running slime's own ``AsyncRolloutWorker`` (``slime.rollout.fully_async_rollout``) on
slime's own data source (``RolloutDataSourceWithBuffer``, watched for the groups the worker hands back to it), with
slime's ``parse_args``, slime's real adapter and the stand-in for SGLang, against the real env server. What comes
out goes through slime's own train-data conversion (``rollout.rollout_manager``).

The worker polls its data source once a second, so each test keeps to a few seconds of rollouts: two groups in
flight (``--sglang-server-concurrency 2``)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from chat_core import EpisodeOutcome
from launch import EVAL_SPLIT
from rollout import (
    MISSES,
    SAMPLE_PER_TURN,
    by_session,
    flattened,
    group_of,
    rollout,
    rollout_manager,
    split_response,
)
from slime.rollout import fully_async_rollout
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.filter_hub.base_types import call_dynamic_filter
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.misc import load_function
from slime.utils.types import Sample
from slime_helper import (
    AppendOnlyChatNeeded,
    FullyAsyncEvaluation,
    UnfilteredFullyAsync,
    generate_rollout_fully_async,
)
from test_support import REWARDS, SCRIPTS, error, text, tool_call

FULLY_ASYNC = (
    "--rollout-function-path", "slime_helper.generate_rollout_fully_async",
    "--sglang-server-concurrency", "2",
)  # fmt: skip
GRPO_FILTER = ("--dynamic-sampling-filter-path", "slime_helper.keep_scored_nonzero_std_groups")
WHOLE_REPLIES = {
    "played": '<tool_call>\n{"name": "find_crate", "arguments": {"name": "pears"}}\n</tool_call><|im_end|>'
    "The crate of pears is on shelf 9C.<|im_end|>",
    "two_turns": "Welcome to the warehouse!<|im_end|>Goodbye, and thank you!<|im_end|>",
}
"""What an episode of each task trains on when played with its test_support script: every reply, whole."""


class WatchedDataSource(RolloutDataSourceWithBuffer):
    """slime's own data source, keeping a copy of each group the worker hands back to it (``handed_back``)."""

    def __init__(self, args):
        super().__init__(args)
        self.handed_back: list[list[Sample]] = []

    def add_samples(self, samples: list[list[Sample]]) -> None:
        self.handed_back += copy.deepcopy(samples)
        super().add_samples(samples)


@pytest.fixture
def fully_async(launch, sglang) -> Iterator[Callable[..., tuple]]:
    """A fully-async launch with the extra flags given, and slime's data source for it.

    slime's fully-async worker is one per process and outlives a rollout call: the test's end stops it, once the
    episodes it still has in flight have ended, so that the next test starts one afresh. slime's ``GenerateState``
    is one per process too, keeping the arguments it was first made with: the test sets aside the one the tier's
    other tests made, so that the worker makes its own, as in a training run (its semaphore as large as the groups
    the worker keeps in flight, each of several episodes, so it fills and binds to the worker's event loop), and puts
    it back at the end."""
    instances = type(GenerateState)._instances
    before = instances.pop(GenerateState, None)

    def launched(*extra: str, config: str = "", thinking: bool = True) -> tuple:
        args = launch(extra=(*FULLY_ASYNC, *extra), config=config, thinking=thinking)
        return args, WatchedDataSource(args)

    yield launched
    worker = fully_async_rollout._global_worker
    fully_async_rollout._stop_global_worker()
    if worker is not None and worker.worker_thread is not None:
        worker.worker_thread.join(timeout=60)
        assert not worker.worker_thread.is_alive(), "slime's fully-async worker didn't stop"
    instances.pop(GenerateState, None)
    if before is not None:
        instances[GenerateState] = before


def task_of(sample: Sample) -> str:
    return sample.metadata["episode"]["task_name"]


def outcome_of(sample: Sample) -> EpisodeOutcome:
    outcome = EpisodeOutcome.from_metadata(sample.metadata)
    assert outcome is not None, f"no episode outcome in {sample.metadata}"
    return outcome


def rows_file(rows: Path, tasks: tuple[str, ...], path: Path) -> Path:
    """``path``, holding the rows of ``tasks`` from ``rows/all.jsonl`` in that order."""
    by_task = {json.loads(line)["metadata"]["episode"]["task_name"]: line for line in (rows / "all.jsonl").open()}
    path.write_text("".join(by_task[task] for task in tasks))
    return path


TRAINED_AND_LEFT_OUT = ("reply_only", "fails_after_the_turn", "played", "two_turns")
"""The rows of the rollouts, in the order slime's data source gives them: with two groups in flight, the groups
left out end before those kept start. ``reply_only`` is scored beside a failed session, ``fails_after_the_turn``
fails in the env, and ``played`` and ``two_turns`` each score 1 and 0."""


def test_rollouts_through_slimes_worker_train_only_the_groups_the_filter_keeps_one_sample_an_episode(
    fully_async, sglang, env_server, rows, tmp_path, tokenizer
):
    prompts = rows_file(rows, TRAINED_AND_LEFT_OUT, tmp_path / "rows.jsonl")
    args, data_source = fully_async(
        *GRPO_FILTER, "--prompt-data", str(prompts), "--rollout-batch-size", "2", "--global-batch-size", "4"
    )
    second = {"reply_only": (error(500),), **MISSES}
    sglang.script_of = by_session(
        env_server, lambda task, n: second[task] if n % 2 == 0 and task in second else SCRIPTS[task]
    )
    keep = load_function(args.dynamic_sampling_filter_path)

    for rollout_id in range(2):
        output = generate_rollout_fully_async(args, rollout_id, data_source)

        groups = output.samples
        assert [task_of(group[0]) for group in groups] == ["played", "two_turns"]
        assert [group[0].group_index for group in groups] == [4 * rollout_id + 2, 4 * rollout_id + 3]
        assert output.metrics == {
            "rollout/dynamic_filter/drop_session_failed": 1,
            "rollout/dynamic_filter/drop_env_failed": 1,
        }
        for group in groups:
            assert [type(sample) for sample in group] == [Sample] * args.n_samples_per_prompt
            assert call_dynamic_filter(keep, args, group).keep
            assert sorted(sample.reward for sample in group) == [0.0, 1.0]
            for sample in group:
                outcome = outcome_of(sample)
                assert outcome.scored and outcome.reward == sample.reward and outcome.flags == ()
                trained, _ = split_response(sample)
                assert (tokenizer.decode(trained) == WHOLE_REPLIES[task_of(sample)]) == (sample.reward == 1.0)

        batch = flattened(groups)
        train = rollout_manager(args)._convert_samples_to_train_data(batch)
        assert train["raw_reward"] == [sample.reward for sample in batch]
        assert train["rewards"] == pytest.approx([0.707106 if r else -0.707106 for r in train["raw_reward"]], abs=1e-5)
        assert all(sum(mask) > 0 for mask in train["loss_masks"])
    assert data_source.handed_back == []

    evaluated = generate_rollout_fully_async(args, 2, data_source, evaluation=True).data[EVAL_SPLIT]
    names = [task_of(sample) for sample in evaluated["samples"]]
    assert names and evaluated["rewards"] == [REWARDS[name] for name in names] == [1.0] * len(names)
    assert all(outcome_of(sample).scored and sample.remove_sample for sample in evaluated["samples"])


def test_an_episode_whose_reply_sglang_aborted_is_handed_back_flagged_and_played_again(
    fully_async, sglang, env_server, rows, tmp_path, tokenizer
):
    prompts = rows_file(rows, ("played", "two_turns"), tmp_path / "rows.jsonl")
    args, data_source = fully_async("--prompt-data", str(prompts))
    cut = {"played": "The crate of pe", "two_turns": "Welcome to the ware"}
    aborted = {
        "played": (tool_call("find_crate", {"name": "pears"}), text(cut["played"], finish_reason="abort")),
        "two_turns": (text(cut["two_turns"], finish_reason="abort"),),
    }
    sglang.script_of = by_session(env_server, lambda task, n: aborted[task] if n == 1 else SCRIPTS[task])

    groups = generate_rollout_fully_async(args, 0, data_source).samples

    handed_back = {task_of(group[0]): group for group in data_source.handed_back}
    assert sorted(handed_back) == ["played", "two_turns"]
    for task, group in handed_back.items():
        [placeholder] = [sample for sample in group if sample.status == Sample.Status.ABORTED]
        outcome = outcome_of(placeholder)
        assert (outcome.reward, outcome.reason) == (None, "reply_aborted")
        assert f"aborted the reply (finish_reason 'abort'), cut at {cut[task]!r}" in outcome.flags[0].message
        assert placeholder.loss_mask == [0] and placeholder.remove_sample and placeholder.reward == 0.0
    assert [group[0].group_index for group in groups] == [0, 1, 2, 3]
    for group in groups[:2]:
        task = task_of(group[0])
        assert [sample.index for sample in group] == [sample.index for sample in handed_back[task]]
        for sample in group:
            trained, _ = split_response(sample)
            assert sample.status == Sample.Status.COMPLETED and sample.reward == REWARDS[task]
            assert outcome_of(sample).scored and outcome_of(sample).flags == ()
            assert tokenizer.decode(trained) == WHOLE_REPLIES[task]
    answered = [tokenizer.decode(reply.output) for reply in sglang.generated]
    assert sorted(reply for reply in answered if reply in cut.values()) == sorted(cut.values())


@pytest.mark.parametrize(
    ("extra", "config", "refusal", "says"),
    [
        ((), SAMPLE_PER_TURN, AppendOnlyChatNeeded, r"episode_append_only_chat is false.*slime's standard rollout"),
        (
            ("--eval-function-path", "slime.rollout.sglang_rollout.generate_rollout"),
            "",
            FullyAsyncEvaluation,
            r"GenerateState semaphore.*leave --eval-function-path out",
        ),
    ],
    ids=["several-samples-an-episode", "eval-off-the-workers-loop"],
)
def test_a_launch_the_fully_async_rollout_cant_train_right_is_refused_before_anything_plays(
    fully_async, sglang, env_server, extra, config, refusal, says
):
    args, data_source = fully_async(*extra, config=config, thinking=False)

    with pytest.raises(refusal, match=says):
        generate_rollout_fully_async(args, 0, data_source)

    assert fully_async_rollout._global_worker is None
    assert sglang.requests == [] and env_server.open_episodes() == 0


def test_an_evaluation_before_the_worker_played_is_refused(fully_async, sglang, env_server):
    args, data_source = fully_async()

    with pytest.raises(FullyAsyncEvaluation, match=r"before slime's fully-async worker played any episode"):
        generate_rollout_fully_async(args, 0, data_source, evaluation=True)

    assert sglang.requests == [] and env_server.open_episodes() == 0


def test_an_episode_slimes_adapter_records_as_several_samples_is_flagged_and_its_group_left_out(fully_async, sglang):
    args, _ = fully_async(config=SAMPLE_PER_TURN, thinking=False)

    played = rollout(args, group_of(args, "two_turns"))

    for sample in played:
        assert isinstance(sample, Sample) and sample.status == Sample.Status.FAILED
        assert sample.loss_mask == [0] and sample.remove_sample
        outcome = outcome_of(sample)
        assert (outcome.reward, outcome.reason) == (None, "episode_split")
        assert "recorded the episode as 2 samples" in outcome.flags[0].message
    assert not call_dynamic_filter(load_function(args.dynamic_sampling_filter_path), args, played).keep


def test_slimes_worker_named_as_the_rollout_function_is_refused_naming_ours(launch, sglang, env_server):
    args = launch(extra=("--rollout-function-path", "slime.rollout.fully_async_rollout.generate_rollout_fully_async"))

    with pytest.raises(UnfilteredFullyAsync, match=r"--rollout-function-path slime_helper\.generate_rollout_fully_a"):
        rollout(args, group_of(args, "played"))
    assert env_server.open_episodes() == 0
