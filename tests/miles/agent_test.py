"""``miles_helper.agent.run`` through Miles' own agentic rollout: Miles' parse_args, its session server (v1 and v2),
``InferenceRolloutFn`` → ``agentic_tool_call.generate`` → our agent → the real env server, then Miles' reward step
and dynamic filter with ``miles_helper.reward`` and ``miles_helper.keep_scored_groups``; every sample carries the
episode's outcome (``chat_core.EpisodeOutcome``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import miles_hooks
import pytest
from chat_core import EpisodeOutcome
from miles.utils.types import Sample
from miles_helper.agent import abort, run
from samples import dropped_samples, kept_samples, trained_and_masked
from test_support import delay, text, tool_call

VERSIONS = ["v1", "v2"]
HELD_S = 60.0


@pytest.mark.parametrize("version", VERSIONS)
def test_a_played_row_trains_the_models_tokens_and_masks_the_tool_output(miles, version):
    args = miles.args(["played"], version=version, extra=["--n-samples-per-prompt", "2"])
    assert args.rollout_function_path == "miles.rollout.inference_rollout.inference_rollout_common.InferenceRolloutFn"
    output = miles.rollout(args)

    samples = kept_samples(miles, output, "played")
    assert len(samples) == 2
    for sample in samples:
        assert sample.status == Sample.Status.COMPLETED
        assert sample.reward == 1.0
        outcome = EpisodeOutcome.from_metadata(sample.metadata)
        assert (outcome.reward, outcome.scored, outcome.flags) == (1.0, True, ())
        assert (outcome.turns, outcome.model_calls, outcome.tool_calls) == (1, 2, 1)
        assert sample.metadata["tito_session_mismatch"] == []
        trained, masked = trained_and_masked(miles, sample)
        assert trained == [
            '<tool_call>\n{"name": "find_crate", "arguments": {"name": "pears"}}\n</tool_call><|im_end|>',
            "The crate of pears is on shelf 9C.<|im_end|>",
        ]
        assert len(masked) == 1
        assert "<tool_response>\nThe crate 'pears' is on shelf 9C.\n</tool_response>" in masked[0]
    requests = miles.chat.requests_for(miles.prompt("played"))
    assert len(requests) == 4
    assert all(request["top_k"] == 20 and request["model"] == "default" for request in requests)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_two_turn_episode_trains_both_replies(miles, version):
    output = miles.rollout(miles.args(["two_turns"], version=version))

    (sample,) = kept_samples(miles, output, "two_turns")
    assert sample.reward == 1.0
    trained, masked = trained_and_masked(miles, sample)
    assert trained == ["Welcome to the warehouse!<|im_end|>", "Goodbye, and thank you!<|im_end|>"]
    assert "<|im_start|>user\nTheir shift is over. Say goodbye to them.<|im_end|>" in masked[0]


@pytest.mark.parametrize("version", VERSIONS)
def test_an_env_failure_is_flagged_and_its_group_left_out(miles, version):
    output = miles.rollout(miles.args(["fails_after_the_turn", "played"], version=version))

    (kept,) = kept_samples(miles, output, "played")
    assert kept.reward == 1.0
    assert output.metrics == {"rollout/dynamic_filter/drop_env_failed": 1}
    (failed,) = dropped_samples("fails_after_the_turn")
    assert failed.reward is None
    outcome = EpisodeOutcome.from_metadata(failed.metadata)
    assert (outcome.reward, outcome.scored, outcome.reason) == (None, False, "env_failed")
    (flag,) = outcome.flags
    assert flag.kind == "env_failed" and flag.fatal


def test_a_model_past_its_deadline_is_flagged_and_left_out(miles):
    miles.chat.script(
        miles.prompt("played"), [tool_call("find_crate", {"name": "pears"}), delay(HELD_S, text("Shelf 9C."))]
    )
    args = miles.args(["played", "reply_only"], extra=["--custom-agent-function-path", "miles_hooks.run_with_deadline"])

    began = time.monotonic()
    output = miles.rollout(args)

    assert time.monotonic() - began < HELD_S / 2
    (kept,) = kept_samples(miles, output, "reply_only")
    assert kept.reward == 1.0
    assert output.metrics == {"rollout/dynamic_filter/drop_model_deadline": 1}
    (late,) = dropped_samples("played")
    assert late.reward is None
    (flag,) = EpisodeOutcome.from_metadata(late.metadata).flags
    assert flag.kind == "model_deadline"
    assert f"model_deadline_s={miles_hooks.MODEL_DEADLINE_S}" in flag.message
    trained, _ = trained_and_masked(miles, late)
    assert trained == ['<tool_call>\n{"name": "find_crate", "arguments": {"name": "pears"}}\n</tool_call><|im_end|>']


def test_an_aborted_rollout_closes_the_episodes_still_playing(miles, env_server):
    miles.chat.script(miles.prompt("reply_only"), [delay(HELD_S, text("A banana."))])
    args = miles.args(["played", "reply_only"], extra=["--over-sampling-batch-size", "2"])

    began = time.monotonic()
    output = miles.rollout(args)

    assert time.monotonic() - began < HELD_S / 2
    kept_samples(miles, output, "played")
    assert miles.chat.aborts == 1
    assert len(miles.chat.requests_for(miles.prompt("reply_only"))) == 1
    env_server.wait_until_closed(timeout=5)


def _play(miles: Any, task: str) -> asyncio.Task[dict[str, Any]]:
    return asyncio.create_task(
        run(
            base_url=miles.chat.url,
            prompt=miles.rows[task]["messages"],
            request_kwargs={},
            metadata=miles.rows[task]["metadata"],
        )
    )


async def _until_asked(miles: Any, task: str) -> None:
    while not miles.chat.requests_for(miles.prompt(task)):
        await asyncio.sleep(0.05)


def test_abort_returns_the_episodes_it_cut_short_flagged(miles, env_server):
    miles.chat.script(miles.prompt("reply_only"), [delay(HELD_S, text("A banana."))])

    async def scenario() -> dict[str, Any]:
        playing = _play(miles, "reply_only")
        await _until_asked(miles, "reply_only")
        await abort(None)
        return await playing

    outcome = asyncio.run(scenario())

    aborted = EpisodeOutcome.from_metadata(outcome)
    assert (aborted.reward, aborted.reason) == (None, "rollout_aborted")
    (flag,) = aborted.flags
    assert (flag.kind, flag.fatal) == ("rollout_aborted", True)
    env_server.wait_until_closed(timeout=5)


def test_an_agent_cancelled_by_miles_closes_its_episode_and_stays_cancelled(miles, env_server):
    miles.chat.script(miles.prompt("reply_only"), [delay(HELD_S, text("A banana."))])

    async def scenario() -> None:
        playing = _play(miles, "reply_only")
        await _until_asked(miles, "reply_only")
        playing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await playing

    asyncio.run(scenario())
    env_server.wait_until_closed(timeout=5)
