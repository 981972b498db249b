"""What a weight update does to this helper's episodes: slime pauses SGLang in its default ``abort`` mode, flushes its
cache, loads the weights under the next version and continues (``sglang_stand_in.WeightUpdates``, through the
stand-in's HTTP endpoints), while the stand-in generates at ``SECONDS_PER_TOKEN`` so a pause cuts replies mid-way.
Episodes are played by slime's own fully-async worker through ``slime_helper.generate_rollout_fully_async``, or by
slime's own standard rollout, with slime's ``parse_args``, its data source, its real adapter and the real env
server. A cut model call is asked again and goes on from the cut; an abort while slime's rollout is over, or past
``episode_max_resumed_calls``, ends its episode flagged."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

import rollout_hooks
from async_rollout import WHOLE_REPLIES, outcome_of, rows_file, task_of
from rollout import by_session, group_of, on_slime_loop, sampling_params, split_response
from sglang_stand_in import Generated, StandInSGLang, WeightUpdates
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sglang_rollout import generate_and_rm_group, generate_rollout
from slime.utils.http_utils import init_http_client
from slime.utils.types import Sample
from slime_helper import generate_rollout_fully_async
from test_support import REWARDS, SCRIPTS, delay, text, tool_call

SECONDS_PER_TOKEN = 0.04
HOOKS = ("--rollout-all-samples-process-path", "rollout_hooks.note_drawn")


@contextlib.contextmanager
def weight_updates(
    sglang: StandInSGLang, times: int, *, when: Callable[[], bool] | None = None, settle_s: float = 0.1
) -> Iterator[WeightUpdates]:
    """``times`` weight updates, each ``settle_s`` after ``when()`` (by default: once the stand-in is generating), so
    it cuts what is generating; the updates not done when the block ends are left out."""
    updates = WeightUpdates(sglang.url)
    stop = threading.Event()
    ready = when or sglang.generating

    def update() -> None:
        for _ in range(times):
            while not ready():
                if stop.wait(0.01):
                    return
            time.sleep(settle_s)
            updates.update()

    thread = threading.Thread(target=update, name="weight-updates", daemon=True)
    thread.start()
    try:
        yield updates
    finally:
        stop.set()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the weight updates didn't end"


def cuts(sglang: StandInSGLang) -> list[Generated]:
    """The replies the stand-in answered cut by a pause."""
    return [reply for reply in sglang.generated if reply.finish == "abort"]


def test_episodes_longer_than_the_time_between_weight_updates_come_back_one_sample_each_of_whole_replies(
    fully_async, sglang, env_server, rows, tmp_path, tokenizer
):
    prompts = rows_file(rows, ("played", "two_turns"), tmp_path / "rows.jsonl")
    args, data_source = fully_async(
        "--prompt-data", str(prompts), "--rollout-batch-size", "2", "--global-batch-size", "4"
    )
    sglang.seconds_per_token = SECONDS_PER_TOKEN
    sglang.script_of = by_session(
        env_server, lambda task, n: (delay(0.3 * (n % 2), SCRIPTS[task][0]), *SCRIPTS[task][1:])
    )

    with weight_updates(sglang, times=3) as updates:
        output = generate_rollout_fully_async(args, 0, data_source)

    assert updates.versions == 3 and len(cuts(sglang)) >= 3
    assert data_source.handed_back == []
    assert [task_of(group[0]) for group in output.samples] == ["played", "two_turns"]
    sessions: dict[str, list[Generated]] = {}
    for reply in sglang.generated:
        sessions.setdefault(reply.routing_key, []).append(reply)
    answered = {
        key: (
            [token for reply in replies for token in reply.output],
            [lp for reply in replies for lp in reply.logprobs],
        )
        for key, replies in sessions.items()
    }
    cut_points = []
    for group in output.samples:
        cut_points.append([])
        for sample in group:
            trained, _ = split_response(sample)
            logprobs = [lp for lp, mask in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if mask]
            outcome = outcome_of(sample)
            assert sample.status == Sample.Status.COMPLETED and outcome.scored and outcome.flags == ()
            assert sample.reward == REWARDS[task_of(sample)]
            assert tokenizer.decode(trained) == WHOLE_REPLIES[task_of(sample)]
            key = next(key for key, tokens in answered.items() if tokens == (trained, logprobs))
            del answered[key]
            assert outcome.resumed_calls == sum(reply.finish == "abort" for reply in sessions[key])
            assert outcome.cut_tokens == sum(len(reply.output) for reply in sessions[key] if reply.finish == "abort")
            cut_points[-1].append([len(reply.output) for reply in sessions[key] if reply.finish == "abort"])
    assert sum(outcome_of(sample).resumed_calls for group in output.samples for sample in group) == len(cuts(sglang))
    assert any(len({reply.weight_version for reply in replies}) > 1 for replies in sessions.values())
    assert any(first != second for first, second in cut_points)


def test_a_later_reply_a_weight_update_cut_goes_on_from_the_cut_within_the_token_limit(
    launch, sglang, env_server, tokenizer
):
    args = launch(thinking=False)
    reply = (
        "The crate of pears is on shelf 9C, the third shelf of aisle nine, behind the apples and the plums; it came "
        "in on Tuesday from the farm by the river, and the next one is due on Friday."
    )
    sglang.seconds_per_token = SECONDS_PER_TOKEN
    sglang.script_of = by_session(env_server, lambda task, n: (tool_call("find_crate", {"name": "pears"}), text(reply)))
    sampling = {**sampling_params(args), "max_new_tokens": 30}

    with weight_updates(sglang, times=1, when=lambda: len(sglang.generated) == 1 and sglang.generating()) as updates:
        played = on_slime_loop(generate_and_rm_group(args, group_of(args, "played")[:1], sampling))

    [[sample]] = played
    first, cut, rest = sglang.generated
    [asked] = [body for body in sglang.requests if body["input_ids"] == rest.prompt]
    trained, _ = split_response(sample)
    assert updates.versions == 1 and first.finish == "stop" and cut.finish == "abort" and 0 < len(cut.output) < 30
    assert rest.prompt == cut.prompt + cut.output and rest.weight_version == 1
    assert asked["sampling_params"]["max_new_tokens"] == 30 - len(cut.output)
    assert rest.finish == "length" and trained == first.output + cut.output + rest.output
    assert tokenizer.decode(cut.output + rest.output) == tokenizer.decode(tokenizer.encode(reply)[:30])
    assert [str(flag.kind) for flag in outcome_of(sample).flags] == ["response_limit"]
    assert (outcome_of(sample).resumed_calls, outcome_of(sample).cut_tokens) == (1, len(cut.output))


def test_an_episode_cut_more_often_than_its_bound_ends_flagged_and_its_group_is_left_out(
    fully_async, sglang, env_server, rows, tmp_path
):
    prompts = rows_file(rows, ("played", "two_turns"), tmp_path / "rows.jsonl")
    args, data_source = fully_async(
        *HOOKS, "--prompt-data", str(prompts), "--rollout-batch-size", "1", config="episode_max_resumed_calls: 1\n"
    )
    sglang.seconds_per_token = SECONDS_PER_TOKEN
    long_reply = (text("Far " + "far " * 200),)
    first_played = {("played", 1), ("played", 2)}
    sglang.script_of = by_session(
        env_server, lambda task, n: long_reply if (task, n) in first_played else SCRIPTS[task]
    )

    with weight_updates(sglang, times=2, when=lambda: sglang.generating() == 2) as updates:
        output = generate_rollout_fully_async(args, 0, data_source)

    assert updates.versions == 2
    [(drawn, _)] = rollout_hooks.DRAWN
    left_out = [group for group in drawn if group not in output.samples]
    assert [task_of(group[0]) for group in left_out] == ["played"]
    assert [task_of(group[0]) for group in output.samples] == ["two_turns"]
    assert output.metrics == {"rollout/dynamic_filter/drop_resume_limit": 1}
    for group in left_out:
        for sample in group:
            outcome = outcome_of(sample)
            assert sample.status == Sample.Status.FAILED and sample.loss_mask == [0] and sample.remove_sample
            assert outcome.reward is None and outcome.resumed_calls == 1
            assert "a weight update cut model call 2 of the episode" in outcome.flags[0].message
            assert "past episode_max_resumed_calls=1" in outcome.flags[0].message
    assert data_source.handed_back == []


def test_a_reply_slimes_standard_rollout_aborts_once_its_batch_is_full_ends_its_episode_flagged(
    launch, sglang, env_server, rows, tmp_path, caplog, own_generate_state
):
    prompts = rows_file(rows, ("reply_only", "played"), tmp_path / "rows.jsonl")
    args = launch(extra=("--prompt-data", str(prompts), "--rollout-batch-size", "1", "--over-sampling-batch-size", "2"))
    sglang.seconds_per_token = SECONDS_PER_TOKEN
    scripts = {"reply_only": (delay(2.0, SCRIPTS["reply_only"][0]),), "played": (text("Far " + "far " * 200),)}
    sglang.script_of = by_session(env_server, lambda task, n: scripts[task])
    init_http_client(args)

    with caplog.at_level(logging.WARNING, logger="slime_helper"):
        output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))

    assert [task_of(group[0][0]) for group in output.samples] == ["reply_only"]
    aborted = cuts(sglang)
    assert len(aborted) == 2 and {reply.routing_key for reply in aborted} != {""}
    for cut in aborted:
        assert [body["input_ids"] for body in sglang.requests if body["routing_key"] == cut.routing_key] == [cut.prompt]
    unscored = [
        record.getMessage() for record in caplog.records if "train episode played is unscored" in record.message
    ]
    assert len(unscored) == 2 and all("reply_aborted: " in line for line in unscored)
