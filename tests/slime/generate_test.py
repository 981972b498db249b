"""Rows played through ``slime_helper.generate`` by slime's own rollout, eval and dynamic filter, on slime's real
adapter with Qwen3's tokenizer, against the real env server and the stand-in for SGLang."""

from __future__ import annotations

import asyncio
import copy
import time
from dataclasses import replace

import pytest
from chat_core import EpisodeOutcome
from launch import EVAL_SPLIT
from rollout import SAMPLE_PER_TURN, group_of, on_slime_loop, rollout, sampling_params, split_response
from slime.rollout.filter_hub.base_types import call_dynamic_filter, should_drop_dynamic_filter_output
from slime.rollout.sglang_rollout import eval_rollout_single_dataset, generate_and_rm_group
from slime.utils.misc import load_function
from slime.utils.types import Sample
from slime_helper import AdapterService, MissingEpisodeNormalization, MissingFilter, MissingToolParser
from slime_helper.generate import episode_limits
from test_support import REWARDS, delay, error, text, tool_call

FIND_PEARS = '<tool_call>\n{"name": "find_crate", "arguments": {"name": "pears"}}\n</tool_call><|im_end|>'
PEARS_REPLY = "The crate of pears is on shelf 9C.<|im_end|>"
TIMED = {"env_s": 0.0, "model_s": 0.0, "capacity_wait_s": 0.0, "wall_s": 0.0}
"""The outcome's timings, which differ from one play of an episode to the next."""


def kept(args, played) -> tuple[bool, str | None]:
    """Whether slime keeps the group ``played``, running the launch's dynamic filter as slime's rollout does."""
    output = call_dynamic_filter(load_function(args.dynamic_sampling_filter_path), args, played)
    dropped = should_drop_dynamic_filter_output(output, remaining_batch_size=8, target_data_size=4)
    return not dropped, output.reason


def outcome_of(sample) -> EpisodeOutcome:
    outcome = EpisodeOutcome.from_metadata(sample.metadata)
    assert outcome is not None, f"no episode outcome in {sample.metadata}"
    return outcome


def kinds(sample) -> list[str]:
    return [str(flag.kind) for flag in outcome_of(sample).flags]


def eventually(check, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.05)


def test_a_played_row_trains_the_tool_call_and_the_reply_and_masks_the_tool_answer(launch, sglang, tokenizer):
    args = launch()
    played = rollout(args, group_of(args, "played"))

    assert len(played) == args.n_samples_per_prompt
    for samples in played:
        [sample] = samples
        trained, masked = split_response(sample)
        assert sample.reward == REWARDS["played"] == 1.0
        assert outcome_of(sample).scored and outcome_of(sample).flags == ()
        assert sample.metadata["episode"]["task_name"] == "played"
        assert tokenizer.decode(trained) == FIND_PEARS + PEARS_REPLY
        assert tokenizer.decode(masked).startswith("\n<|im_start|>user\n<tool_response>\n")
        assert tokenizer.decode(masked).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
        trained_logprobs = [lp for lp, mask in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if mask]
        assert all(logprob < 0 for logprob in trained_logprobs)
    assert kept(args, played) == (True, None)


def test_an_episode_answered_in_process_comes_back_as_it_does_over_the_adapters_http_endpoint(
    launch, sglang, monkeypatch
):
    args = launch()
    adapter = AdapterService.of(args).adapter
    answer, handed = adapter.answer_in_process, []

    async def counted(body: bytes, headers) -> object:
        handed.append(body)
        return await answer(body, headers)

    monkeypatch.setattr(adapter, "answer_in_process", counted)
    in_process = rollout(args, group_of(args, "played"))
    calls_in_process = len(handed)
    endpoint = AdapterService.chat
    monkeypatch.setattr(AdapterService, "chat", lambda self, sid: replace(endpoint(self, sid), in_process=None))
    over_http = rollout(args, group_of(args, "played"))

    assert calls_in_process == 2 * args.n_samples_per_prompt and len(handed) == calls_in_process
    for [near], [far] in zip(in_process, over_http, strict=True):
        assert (near.tokens, near.loss_mask) == (far.tokens, far.loss_mask)
        assert near.rollout_log_probs == far.rollout_log_probs
        assert (near.response, near.response_length, near.reward, near.status) == (
            far.response, far.response_length, far.reward, far.status
        )  # fmt: skip
        assert replace(outcome_of(near), **TIMED) == replace(outcome_of(far), **TIMED)
        assert outcome_of(near).scored and outcome_of(near).flags == ()


def test_an_episode_the_env_failed_is_flagged_and_the_filter_leaves_its_group_out(launch, sglang):
    args = launch()
    played = rollout(args, group_of(args, "fails_after_the_turn"))

    for samples in played:
        [sample] = samples
        assert sample.reward == 0.0
        assert not outcome_of(sample).scored and outcome_of(sample).reward is None
        assert kinds(sample) == ["env_failed"]
        assert sum(sample.loss_mask) > 0
    assert kept(args, played) == (False, "env_failed")


def test_an_episode_that_ends_with_nothing_to_train_is_one_placeholder_sample_the_filter_leaves_out(launch, sglang):
    args = launch()
    sglang.script_of = lambda prompt: [error(500)]
    before = len(sglang.requests)
    played = rollout(args, group_of(args, "played"))

    for samples in played:
        [sample] = samples
        assert sample.status == Sample.Status.FAILED and sample.remove_sample
        assert sample.loss_mask == [0] and sample.reward == 0.0
        assert kinds(sample) == ["session_failed"]
        assert "HTTP 500" in outcome_of(sample).flags[0].message
    assert len(sglang.requests) - before == len(played)
    assert kept(args, played) == (False, "session_failed")


def test_an_eval_returns_one_untrained_sample_per_episode_and_drops_the_sessions(launch, sglang, rows):
    args = launch()
    [dataset] = [config for config in args.eval_datasets if config.name == EVAL_SPLIT]
    before = len(sglang.requests)

    evaluated = on_slime_loop(eval_rollout_single_dataset(args, 0, dataset))[EVAL_SPLIT]

    names = [sample.metadata["episode"]["task_name"] for sample in evaluated["samples"]]
    episodes = len((rows / f"{EVAL_SPLIT}.jsonl").read_text().splitlines()) * dataset.n_samples_per_eval_prompt
    assert len(names) == episodes
    assert evaluated["rewards"] == [REWARDS[name] for name in names] == [1.0] * len(names)
    for sample in evaluated["samples"]:
        assert sample.loss_mask == [0] and sample.remove_sample
        assert outcome_of(sample).scored
    adapter = AdapterService.of(args).adapter
    sessions = {request["routing_key"] for request in sglang.requests[before:]}
    assert len(sessions) == len(names)
    assert not adapter.store
    assert not any(adapter.manager.has_session(sid) for sid in sessions)


def test_a_rollout_cancelled_mid_episode_drops_its_sessions_and_closes_its_episodes(launch, sglang, env_server):
    args = launch()
    sglang.script_of = lambda prompt: [tool_call("find_crate", {"name": "pears"}), delay(30, text("Too late."))]
    group = group_of(args, "played")
    before = len(sglang.requests)

    async def cancelled_mid_episode() -> bool:
        rolling = asyncio.create_task(generate_and_rm_group(args, group, sampling_params(args)))
        deadline = time.monotonic() + 60
        while len(sglang.requests) - before < 2 * len(group):
            assert time.monotonic() < deadline, "the episodes never reached their second model call"
            await asyncio.sleep(0.05)
        assert env_server.open_episodes() == len(group)
        rolling.cancel()
        try:
            await rolling
        except asyncio.CancelledError:
            return True
        return False

    assert on_slime_loop(cancelled_mid_episode())
    adapter = AdapterService.of(args).adapter
    by_session: dict[str, list[dict]] = {}
    for request in sglang.requests[before:]:
        by_session.setdefault(request["routing_key"], []).append(request)
    assert [len(requests) for requests in by_session.values()] == [2] * len(group)
    waiting = [requests[-1]["rid"] for requests in by_session.values()]
    # slime's group gathers its episodes, so the group ends with the first cancelled episode; the others finish
    # unwinding just after.
    eventually(lambda: not adapter.store, "the adapter dropped the sessions")
    assert not any(adapter.manager.has_session(sid) for sid in by_session)
    eventually(lambda: env_server.open_episodes() == 0, "the server closed the episodes")
    eventually(lambda: sorted(sglang.aborted) == sorted(waiting), "the adapter aborted the waiting SGLang requests")


@pytest.mark.parametrize(
    ("thinking", "samples_per_episode"), [(False, 2), (True, 1)], ids=["thinking-off", "thinking-on"]
)
def test_with_qwen3s_own_template_and_thinking_off_each_turn_comes_back_as_its_own_sample_with_the_reward(
    launch, sglang, tokenizer, thinking, samples_per_episode
):
    args = launch(thinking=thinking, config=SAMPLE_PER_TURN)
    before = len(sglang.requests)
    played = rollout(args, group_of(args, "two_turns"))

    first_prompt = tokenizer.decode(sglang.requests[before]["input_ids"])
    assert first_prompt.endswith("<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n"))
    for samples in played:
        assert len(samples) == samples_per_episode
        assert [sample.reward for sample in samples] == [REWARDS["two_turns"]] * samples_per_episode
        trained = [tokenizer.decode(split_response(sample)[0]) for sample in samples]
        assert "".join(trained) == "Welcome to the warehouse!<|im_end|>Goodbye, and thank you!<|im_end|>"
    assert kept(args, played) == (True, None)


def test_the_adapter_refuses_to_start_without_a_tool_call_parser(launch, sglang, env_server):
    args = launch(tool_parser=False)
    assert args.sglang_tool_call_parser is None

    with pytest.raises(MissingToolParser, match=r"--sglang-tool-call-parser.*qwen25"):
        rollout(args, group_of(args, "played"))
    assert env_server.open_episodes() == 0


def test_episode_bounds_come_from_the_custom_config_and_a_bounded_episode_is_left_out(launch, sglang, env_server):
    config = "episode_max_turns: 1\nepisode_model_deadline_s: 120\nepisode_env_call_deadline_s: 30\n"
    config += "episode_max_chat_answer_bytes: 2000000\nepisode_max_env_message_bytes: 3000000\n"
    args = launch(config=config + f"episode_env_servers: [{env_server.url}]\n")
    limits = episode_limits(args)
    assert (limits.model_deadline_s, limits.env_call_deadline_s) == (120, 30)
    assert args.episode_env_servers == [env_server.url]
    assert (limits.max_chat_answer_bytes, limits.max_env_message_bytes) == (2_000_000, 3_000_000)
    played = rollout(args, group_of(args, "two_turns"))

    for samples in played:
        [sample] = samples
        assert not outcome_of(sample).scored
        assert kinds(sample) == ["turn_limit"]
    assert kept(args, played) == (False, "turn_limit")


def test_the_adapter_refuses_to_start_without_the_dynamic_filter(launch, sglang, env_server):
    args = copy.copy(launch())
    args.dynamic_sampling_filter_path = None

    with pytest.raises(MissingFilter, match=r"--dynamic-sampling-filter-path slime_helper\.keep_scored_groups"):
        rollout(args, group_of(args, "played"))
    assert env_server.open_episodes() == 0


def test_the_adapter_refuses_to_start_when_slime_would_normalise_over_the_whole_batch(launch, sglang, env_server):
    args = copy.copy(launch())
    args.custom_reward_post_process_path = None

    with pytest.raises(
        MissingEpisodeNormalization, match=r"--custom-reward-post-process-path slime_helper\.rewards\.normalize_per"
    ):
        rollout(args, group_of(args, "played"))
    assert env_server.open_episodes() == 0


def test_a_launch_that_leaves_rewards_unnormalised_needs_no_reward_post_processing(launch, sglang):
    args = copy.copy(launch())
    args.custom_reward_post_process_path = None
    args.rewards_normalization = False

    played = rollout(args, group_of(args, "played"))

    assert [sample.reward for samples in played for sample in samples] == [1.0] * args.n_samples_per_prompt
