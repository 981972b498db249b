"""slime's fully-async rollout with this helper: ``slime_helper.generate_rollout_fully_async`` as
``--rollout-function-path``, running slime's own ``AsyncRolloutWorker`` (``slime.rollout.fully_async_rollout``) on
slime's own data source (``RolloutDataSourceWithBuffer``, watched for the groups the worker hands back to it), with
slime's ``parse_args``, slime's real adapter and the stand-in for SGLang, against the real env server. What comes
out goes through slime's own train-data conversion (``rollout.rollout_manager``) and slime's rollout hooks
(``rollout_hooks``). What a weight update does to the episodes is ``weight_updates_test``'s.

The worker polls its data source once a second, so each test keeps to a few seconds of rollouts: two groups in
flight (``--sglang-server-concurrency 2``)."""

from __future__ import annotations

import json
import logging
import threading

import pytest
import rollout_hooks
from async_rollout import GRPO_FILTER, WHOLE_REPLIES, outcome_of, rows_file, task_of
from chat_core import ServerMismatch
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
from slime.rollout.filter_hub.base_types import call_dynamic_filter
from slime.utils.misc import load_function
from slime.utils.types import Sample
from slime_helper import (
    AppendOnlyChatNeeded,
    FullyAsyncEvaluation,
    PartialRolloutRefused,
    RolloutStarved,
    UnfilteredFullyAsync,
    generate_rollout_fully_async,
)
from test_support import REWARDS, SCRIPTS, error

HOOKS = (
    "--rollout-sample-filter-path", "rollout_hooks.note_kept",
    "--rollout-all-samples-process-path", "rollout_hooks.note_drawn",
)  # fmt: skip

TRAINED_AND_LEFT_OUT = ("reply_only", "fails_after_the_turn", "played", "two_turns")
"""The rows of the rollouts, in the order slime's data source gives them: with two groups in flight, the groups
left out end before those kept start. ``reply_only`` is scored beside a failed session, ``fails_after_the_turn``
fails in the env, and ``played`` and ``two_turns`` each score 1 and 0."""


def test_rollouts_through_slimes_worker_train_only_the_groups_the_filter_keeps_one_sample_an_episode(
    fully_async, sglang, env_server, rows, tmp_path, tokenizer
):
    prompts = rows_file(rows, TRAINED_AND_LEFT_OUT, tmp_path / "rows.jsonl")
    args, data_source = fully_async(
        *GRPO_FILTER, *HOOKS, "--prompt-data", str(prompts), "--rollout-batch-size", "2", "--global-batch-size", "4"
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
        assert rollout_hooks.KEPT[rollout_id] == groups
        drawn, handed = rollout_hooks.DRAWN[rollout_id]
        assert [task_of(group[0]) for group in drawn] == list(TRAINED_AND_LEFT_OUT)
        assert handed.__self__ is data_source and handed.__func__ is type(data_source).get_samples
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
        (("--partial-rollout",), "", PartialRolloutRefused, r"can't take --partial-rollout.*goes on from where it was"),
    ],
    ids=["several-samples-an-episode", "eval-off-the-workers-loop", "partial-rollout"],
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


def test_a_rollout_whose_every_group_is_left_out_raises_naming_the_drops_after_logging_each_round(
    fully_async, sglang, env_server, rows, tmp_path, caplog
):
    prompts = rows_file(rows, ("fails_after_the_turn",), tmp_path / "rows.jsonl")
    args, data_source = fully_async(
        "--prompt-data", str(prompts), "--rollout-batch-size", "1", config="fully_async_max_drawn_batches: 2\n"
    )

    raised: list[BaseException] = []

    def call() -> None:
        try:
            generate_rollout_fully_async(args, 0, data_source)
        except BaseException as error:
            raised.append(error)

    caller = threading.Thread(target=call, name="starved-rollout", daemon=True)
    with caplog.at_level(logging.INFO, logger="slime_helper"):
        caller.start()
        caller.join(timeout=120)

    assert not caller.is_alive(), "the rollout call is still waiting for groups"
    [starved] = raised
    assert isinstance(starved, RolloutStarved)
    assert "drew 2 groups from slime's worker" in str(starved)
    assert "kept 0 of the 1 it needs, past fully_async_max_drawn_batches=2" in str(starved)
    assert "dropped env_failed x2" in str(starved)
    rounds = [record.getMessage() for record in caplog.records if "fully-async rollout 0: the filter" in record.message]
    assert len(rounds) == 2 and all("kept 0 of 1 groups" in line and "dropped env_failed x1" in line for line in rounds)


def test_an_episode_that_raises_under_slimes_worker_comes_back_flagged_and_its_group_left_out(
    fully_async, sglang, env_server, rows, tmp_path
):
    broken = json.loads(next(line for line in (rows / "all.jsonl").open() if '"reply_only"' in line))
    del broken["metadata"]["episode"]["task_id"]
    prompts = rows_file(rows, ("two_turns",), tmp_path / "rows.jsonl")
    prompts.write_text(json.dumps(broken) + "\n" + prompts.read_text())
    args, data_source = fully_async(*HOOKS, "--prompt-data", str(prompts), "--rollout-batch-size", "1")

    output = generate_rollout_fully_async(args, 0, data_source)

    assert [task_of(group[0]) for group in output.samples] == ["two_turns"]
    [(drawn, _)] = rollout_hooks.DRAWN
    raised = [group for group in drawn if task_of(group[0]) == "reply_only"]
    assert raised and output.metrics == {"rollout/dynamic_filter/drop_episode_raised": len(raised)}
    for sample in (sample for group in raised for sample in group):
        outcome = outcome_of(sample)
        assert sample.status == Sample.Status.FAILED and sample.loss_mask == [0] and sample.remove_sample
        assert (outcome.reward, outcome.reason) == (None, "episode_raised")
        assert outcome.flags[0].message.startswith("the episode raised ValueError: ")
    assert data_source.handed_back == []


def test_a_fault_of_the_launch_an_episode_raises_is_raised_from_the_rollout_call(
    fully_async, sglang, env_server, rows, tmp_path
):
    stale = json.loads(next(line for line in (rows / "all.jsonl").open() if '"played"' in line))
    stale["metadata"]["episode"]["task_id"] = "a-task-the-server-no-longer-serves"
    prompts = tmp_path / "rows.jsonl"
    prompts.write_text(json.dumps(stale) + "\n")
    args, data_source = fully_async(
        "--prompt-data", str(prompts), "--rollout-batch-size", "1", config=f"episode_env_servers: [{env_server.url}]\n"
    )

    with pytest.raises(ServerMismatch, match=r"the row is for 'a-task-the-server-no-longer-serves'"):
        generate_rollout_fully_async(args, 0, data_source)

    assert data_source.handed_back == [] and sglang.requests == []


def test_partial_rollout_with_slimes_standard_rollout_is_refused_before_the_episode_plays(launch, sglang, env_server):
    args = launch(extra=("--partial-rollout",))

    with pytest.raises(PartialRolloutRefused, match=r"sample\.response of each episode"):
        rollout(args, group_of(args, "played"))
    assert sglang.requests == [] and env_server.open_episodes() == 0
