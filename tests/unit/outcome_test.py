"""The episode's outcome as both helpers record it, the filter rules and per-episode metrics they share, and the
spans ``play`` reports for a trace viewer, from episodes played on agent-env's real server with the scripted
model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
from chat_core import OUTCOME_KEY, ChatEndpoint, EpisodeOutcome, EpisodeResult, Flag, FlagKind, Limits, play
from chat_core.prepare import write_rows
from chat_core.record.filters import Episode, scored_group_drop, scored_nonzero_std_group_drop
from chat_core.record.metrics import episode_metrics, rollout_log_metrics
from test_support import SCRIPTS, ScriptedModel, ServedBundle, error, text, tool_call

pytest_plugins = ["test_support.pytest_plugin"]


@pytest.fixture(scope="module")
def rows(sample_env_server: ServedBundle, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("rows") / "rows"
    asyncio.run(write_rows(sample_env_server.url, out, progress=False))
    lines = (out / "all.jsonl").read_text().splitlines()
    return {row["metadata"]["episode"]["task_name"]: row["metadata"] for row in map(json.loads, lines)}


class RecordedTrace:
    """A trace that keeps each span as ``(name, attrs at start, attrs added by the end, seconds)``."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, dict[str, Any], dict[str, Any], float]] = []

    @contextlib.contextmanager
    def span(self, name: str, attrs: dict[str, Any]) -> Iterator[dict[str, Any]]:
        end: dict[str, Any] = {}
        began = time.monotonic()
        try:
            yield end
        finally:
            self.spans.append((name, dict(attrs), end, time.monotonic() - began))


def _played(
    model: ScriptedModel,
    metadata: dict[str, Any],
    steps: Any,
    trace: RecordedTrace | None = None,
    limits: Limits | None = None,
):
    session = metadata["episode"]["task_name"]
    model.script(steps, session=session)
    chat = ChatEndpoint(model.base_url + "/chat/completions", "policy", {"Authorization": f"Bearer {session}"})
    return asyncio.run(play(metadata, chat, {}, limits or Limits(), trace=trace))


def metadata_server(metadata: dict[str, Any]) -> str:
    return metadata["server"]["url"]


def test_the_outcome_counts_the_episode_and_survives_a_trip_through_json(sample_env, rows, scripted_model):
    result = _played(scripted_model, rows["played"], SCRIPTS["played"])
    outcome = EpisodeOutcome.of(result)

    assert (outcome.reward, outcome.scored, outcome.reason, outcome.truncated) == (1.0, True, None, False)
    assert (outcome.turns, outcome.model_calls, outcome.tool_calls, outcome.tool_errors) == (1, 2, 1, 0)
    assert outcome.env_s > 0 and outcome.wall_s >= outcome.env_s + outcome.model_s
    assert outcome.env_server == metadata_server(rows["played"])
    assert outcome.model_retries == 0
    metadata = json.loads(json.dumps({OUTCOME_KEY: outcome.to_metadata()}))
    assert EpisodeOutcome.from_metadata(metadata) == outcome
    assert EpisodeOutcome.from_metadata({"episode": {}}) is None


def test_the_outcome_counts_the_chat_requests_sent_again(sample_env, rows, scripted_model):
    result = _played(scripted_model, rows["reply_only"], [error(503), error(502), text("A banana.")])
    outcome = EpisodeOutcome.of(result)

    assert (outcome.reward, outcome.model_retries) == (1.0, 2)
    assert EpisodeOutcome.from_metadata(json.loads(json.dumps({OUTCOME_KEY: outcome.to_metadata()}))) == outcome


def test_a_record_written_before_retries_were_counted_reads_as_none():
    metadata = _outcome(1.0).to_metadata()
    del metadata["model_retries"]

    assert EpisodeOutcome.from_metadata({OUTCOME_KEY: metadata}).model_retries == 0


def test_a_record_written_before_dropped_tool_calls_were_counted_reads_0():
    metadata = _outcome(1.0).to_metadata()
    del metadata["dropped_tool_calls"]

    assert EpisodeOutcome.from_metadata({OUTCOME_KEY: metadata}).dropped_tool_calls == 0


def test_a_record_written_before_resumed_calls_were_counted_reads_0():
    metadata = replace(_outcome(1.0), resumed_calls=2, cut_tokens=40).to_metadata()
    del metadata["resumed_calls"], metadata["cut_tokens"]

    outcome = EpisodeOutcome.from_metadata({OUTCOME_KEY: metadata})
    assert (outcome.resumed_calls, outcome.cut_tokens) == (0, 0)


def test_an_episode_a_helper_ended_before_recording_anything_is_unscored_with_the_kind_it_names():
    outcome = EpisodeOutcome.unplayed(FlagKind.EPISODE_RAISED, "the episode raised KeyError: 'episode'")

    assert (outcome.reward, outcome.scored, outcome.reason) == (None, False, "episode_raised")
    assert [(flag.kind, flag.fatal) for flag in outcome.flags] == [(FlagKind.EPISODE_RAISED, True)]
    assert EpisodeOutcome.from_metadata(json.loads(json.dumps({OUTCOME_KEY: outcome.to_metadata()}))) == outcome


def test_the_helpers_new_kinds_leave_an_episode_unscored():
    assert Flag(FlagKind.RESUME_LIMIT, "cut past the bound").fatal
    assert Flag(FlagKind.EPISODE_RAISED, "raised").fatal


def test_a_record_written_before_turns_not_appended_were_counted_reads_0():
    metadata = _outcome(1.0).to_metadata()
    del metadata["turns_not_appended"]

    assert EpisodeOutcome.from_metadata({OUTCOME_KEY: metadata}).turns_not_appended == 0


def test_a_turn_not_appended_or_not_recorded_is_flagged_without_leaving_the_episode_unscored():
    flags = (
        Flag(FlagKind.TURN_NOT_APPENDED, "model call 3's prompt couldn't be appended"),
        Flag(FlagKind.TURN_NOT_RECORDED, "model call 2's turn couldn't be held"),
    )
    outcome = replace(_outcome(1.0), flags=flags, turns_not_appended=1)

    assert not any(flag.fatal for flag in flags) and outcome.scored
    assert EpisodeOutcome.from_metadata(json.loads(json.dumps({OUTCOME_KEY: outcome.to_metadata()}))) == outcome


def test_a_record_of_tool_calls_slimes_adapter_dropped_reads_back_scored():
    flag = Flag(FlagKind.TOOL_CALLS_DROPPED, "reply 1 made 2 tool calls")
    outcome = replace(_outcome(1.0), flags=(flag,), dropped_tool_calls=1)

    assert not flag.fatal and outcome.scored
    assert EpisodeOutcome.from_metadata(json.loads(json.dumps({OUTCOME_KEY: outcome.to_metadata()}))) == outcome


def test_a_flag_reads_back_as_fatal_as_it_was_written_and_one_written_without_saying_by_its_kind():
    scored_as_it_stands = Flag(FlagKind.CONTEXT_EXHAUSTED, "turn 3: the context is full", fatal=False)
    outcome = replace(_outcome(1.0), flags=(scored_as_it_stands, Flag(FlagKind.RESPONSE_LIMIT, "turn 1: cut")))
    metadata = json.loads(json.dumps({OUTCOME_KEY: outcome.to_metadata()}))
    read = EpisodeOutcome.from_metadata(metadata)
    del metadata[OUTCOME_KEY]["flags"][0]["fatal"]

    assert read == outcome and [flag.fatal for flag in read.flags] == [False, True]
    assert EpisodeOutcome.from_metadata(metadata).flags[0].fatal


def test_a_record_written_before_tool_answers_were_cut_reads_0():
    metadata = _outcome(1.0).to_metadata()
    del metadata["tool_answers_cut"], metadata["tool_answer_bytes_cut"]

    read = EpisodeOutcome.from_metadata({OUTCOME_KEY: metadata})

    assert (read.tool_answers_cut, read.tool_answer_bytes_cut) == (0, 0)


def test_the_outcome_counts_the_tool_answers_cut_and_the_calls_answered_not_run(sample_env, rows, scripted_model):
    steps = [tool_call("find_crate", {"name": "apples"}), tool_call("find_crate", {"name": "pears"}, content="9C")]
    limits = Limits(max_tool_calls_per_turn=1, max_tool_answer_chars=10)

    outcome = EpisodeOutcome.of(_played(scripted_model, rows["played"], steps, limits=limits))

    assert (outcome.dropped_tool_calls, outcome.tool_answers_cut) == (1, 1)
    assert outcome.tool_answer_bytes_cut == len("The crate 'apples' is on shelf 4B.") - 10


def test_an_unscored_outcome_names_its_first_fatal_flag_and_has_no_reward(sample_env, rows, scripted_model):
    result = _played(scripted_model, rows["fails_after_the_turn"], SCRIPTS["fails_after_the_turn"])
    outcome = EpisodeOutcome.of(result)

    assert (outcome.reward, outcome.scored, outcome.reason) == (None, False, "env_failed")


def test_a_reply_cut_at_the_token_limit_is_marked_truncated_whether_it_ended_the_episode_or_was_played_on(
    sample_env, rows, scripted_model
):
    steps = [text("A banana, which is", finish_reason="length")]

    ended = EpisodeOutcome.of(_played(scripted_model, rows["reply_only"], steps))
    played_on = EpisodeOutcome.of(
        _played(scripted_model, rows["reply_only"], steps, limits=Limits(play_on_cut_reply=True))
    )

    assert (ended.truncated, ended.scored, ended.reason) == (True, False, "response_limit")
    assert (played_on.truncated, played_on.scored, played_on.reward) == (True, True, 1.0)


def test_an_aborted_outcome_is_unscored_with_its_own_kind():
    outcome = EpisodeOutcome.aborted("the trainer aborted the rollout")

    assert (outcome.reward, outcome.reason) == (None, "rollout_aborted")
    assert outcome.flags[0].kind == FlagKind.ROLLOUT_ABORTED and outcome.flags[0].fatal


def test_something_else_under_the_outcome_key_is_refused():
    with pytest.raises(ValueError, match="isn't an episode outcome"):
        EpisodeOutcome.from_metadata({OUTCOME_KEY: {"reward": 1.0}})


def _outcome(
    reward: float | None,
    *,
    turns: int = 1,
    tool_calls: int = 0,
    reason: str | None = None,
    dropped: int = 0,
    resumed: int = 0,
    cut: int = 0,
    not_appended: int = 0,
):
    return EpisodeOutcome(
        reward=reward,
        scored=reason is None and reward is not None,
        reason=reason,
        flags=(),
        turns=turns,
        model_calls=turns,
        tool_calls=tool_calls,
        tool_errors=0,
        env_s=2.0,
        model_s=1.0,
        capacity_wait_s=0.0,
        wall_s=3.5,
        truncated=False,
        env_server=None,
        dropped_tool_calls=dropped,
        resumed_calls=resumed,
        cut_tokens=cut,
        turns_not_appended=not_appended,
    )


def test_the_filters_drop_unscored_and_same_reward_groups_with_distinct_reasons():
    one, zero = _outcome(1.0), _outcome(0.0)
    failed = _outcome(None, reason="env_failed")

    assert scored_group_drop([Episode(one, False), Episode(zero, False)]) is None
    assert scored_group_drop([Episode(one, False), Episode(failed, False)]) == "env_failed"
    assert scored_group_drop([Episode(one, False), Episode(one, True)]) == "sample_aborted"
    assert scored_group_drop([Episode(None, False)]) == "no_episode_outcome"
    assert scored_nonzero_std_group_drop([Episode(one, False), Episode(one, False)]) == "same_reward_1"
    assert scored_nonzero_std_group_drop([Episode(zero, False), Episode(failed, False)]) == "env_failed"
    assert scored_nonzero_std_group_drop([Episode(one, False), Episode(zero, False)]) is None


def test_metrics_count_each_episode_once_whatever_its_samples():
    outcomes = [
        _outcome(1.0, turns=3, tool_calls=4, dropped=2, resumed=3, cut=120, not_appended=1),
        _outcome(0.0),
        _outcome(1.0, turns=2, resumed=1, cut=8),
        _outcome(None, reason="env_failed"),
    ]

    metrics = episode_metrics(outcomes, [3, 1, 2, 1])

    assert metrics["episodes"] == 4 and metrics["samples_per_episode"] == 7 / 4
    assert metrics["reward_mean"] == pytest.approx(2 / 3)
    assert metrics["reward_se"] == pytest.approx((1 / 3) ** 0.5 / 3**0.5)
    assert metrics["zero_reward_share"] == pytest.approx(1 / 3)
    assert metrics["scored_share"] == 0.75 and metrics["unscored_share/env_failed"] == 0.25
    assert (metrics["turns_mean"], metrics["turns_p90"]) == (7 / 4, 3.0)
    assert (metrics["tool_calls_mean"], metrics["tool_calls_p90"]) == (1.0, 4.0)
    assert (metrics["dropped_tool_calls_mean"], metrics["dropped_tool_calls_p90"]) == (0.5, 2.0)
    assert (metrics["resumed_calls_mean"], metrics["resumed_calls_p90"]) == (1.0, 3.0)
    assert (metrics["cut_tokens_mean"], metrics["cut_tokens_p90"]) == (32.0, 120.0)
    assert (metrics["turns_not_appended_mean"], metrics["turns_not_appended_p90"]) == (0.25, 1.0)
    assert metrics["env_s_mean"] == 2.0 and metrics["wall_s_mean"] == 3.5


def test_metrics_give_the_share_of_episodes_cut_short_each_way_scored_or_not_and_the_tool_answers_cut():
    full = Flag(FlagKind.CONTEXT_EXHAUSTED, "turn 2: the context is full")
    outcomes = [
        replace(_outcome(None, reason="context_exhausted"), flags=(full,)),
        replace(_outcome(0.0), flags=(Flag(FlagKind.CONTEXT_EXHAUSTED, "turn 4: the context is full", fatal=False),)),
        replace(_outcome(None, reason="response_limit"), flags=(Flag(FlagKind.RESPONSE_LIMIT, "turn 1: cut"),)),
        replace(_outcome(1.0), tool_answers_cut=3, tool_answer_bytes_cut=4_000),
    ]

    metrics = episode_metrics(outcomes, [1, 1, 1, 1])

    assert metrics["cut_short_share/context_exhausted"] == 0.5 and metrics["cut_short_share/response_limit"] == 0.25
    assert metrics["unscored_share/context_exhausted"] == 0.25 and metrics["scored_share"] == 0.5
    assert (metrics["tool_answers_cut_mean"], metrics["tool_answers_cut_p90"]) == (0.75, 3.0)
    assert metrics["tool_answer_bytes_cut_mean"] == 1_000


@dataclass(frozen=True)
class TrainingSample:
    """What the metrics read of a trainer's training sample; slime's and Miles' ``Sample`` have these fields."""

    index: int
    rollout_id: int
    metadata: dict[str, Any]


def test_a_rollout_log_counts_an_episode_once_by_its_rollout_whatever_its_samples_indexes(
    sample_env, rows, scripted_model
):
    # slime's adapter gives an episode's samples one index today; a trainer numbering each sample wouldn't.
    two_turns = EpisodeOutcome.of(_played(scripted_model, rows["two_turns"], SCRIPTS["two_turns"]))
    scores_zero = EpisodeOutcome.of(_played(scripted_model, rows["scores_zero"], SCRIPTS["scores_zero"]))
    samples = [
        TrainingSample(index=4, rollout_id=7, metadata={OUTCOME_KEY: two_turns.to_metadata()}),
        TrainingSample(index=5, rollout_id=7, metadata={OUTCOME_KEY: two_turns.to_metadata()}),
        TrainingSample(index=6, rollout_id=8, metadata={OUTCOME_KEY: scores_zero.to_metadata()}),
    ]

    metrics = rollout_log_metrics(samples)

    assert metrics["rollout/episode/episodes"] == 2
    assert metrics["rollout/episode/samples_per_episode"] == 1.5
    assert metrics["rollout/episode/reward_mean"] == 0.5
    assert metrics["rollout/episode/turns_mean"] == 1.5


def test_play_reports_each_stretch_of_the_episode_as_a_span(sample_env, rows, scripted_model):
    trace = RecordedTrace()
    result: EpisodeResult = _played(scripted_model, rows["played"], SCRIPTS["played"], trace)

    names = [name for name, *_ in trace.spans]
    assert names == ["reset", "list_tools", "model_call", "tool_call", "model_call", "end_turn"]
    _, started, ended, _ = trace.spans[names.index("tool_call")]
    assert (started, ended) == ({"turn": 1, "tool": "find_crate"}, {"error": False})
    assert trace.spans[-1][2] == {"episode_ended": True}
    env = sum(seconds for name, _, _, seconds in trace.spans if name != "model_call")
    assert env == pytest.approx(result.timings.env_s, rel=0.05, abs=0.01)


def test_a_two_turn_episode_ends_its_first_turn_without_ending_the_episode(sample_env, rows, scripted_model):
    trace = RecordedTrace()
    _played(scripted_model, rows["two_turns"], SCRIPTS["two_turns"], trace)

    end_turns = [(started, ended) for name, started, ended, _ in trace.spans if name == "end_turn"]
    assert end_turns == [({"turn": 1}, {"episode_ended": False}), ({"turn": 2}, {"episode_ended": True})]
