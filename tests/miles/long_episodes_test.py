"""Long episodes through Miles' own agentic rollout (``miles_helper.agent.run`` against Miles' session server, v1
and v2 where the shape of the samples differs), on agent-env's real env server: every tool call of a reply run,
answered and trained; a prompt SGLang refuses as too long for the model's context, and a context that reaches Miles'
``--max-seq-len``, end the episode there with no further model call or env turn; a reply cut at the response limit
ends it; a long tool answer reaches the model cut, with the line saying so."""

from __future__ import annotations

import miles_hooks
import pytest
from chat_core import EpisodeOutcome
from samples import dropped_samples, kept_samples, trained_and_masked
from test_support import SCRIPTS, error, text, tool_call, tool_calls
from test_support.qwen3 import output_token_logprobs

THREE_CALLS = tool_calls(
    tool_call("find_crate", {"name": "pears"}),
    tool_call("add_crate", {"name": "oranges"}),
    tool_call("find_crate", {"name": "oranges"}),
)
SGLANG_CONTEXT_REFUSAL = {
    "object": "error",
    "message": "The input (40960 tokens) is longer than the model's context length (40960 tokens).",
    "type": "BadRequest",
    "param": None,
    "code": 400,
}
"""What SGLang's OpenAI server answers a prompt too long for the model's context, with HTTP 400."""


def _outcome(sample) -> EpisodeOutcome:
    return EpisodeOutcome.from_metadata(sample.metadata)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_every_tool_call_of_a_reply_is_run_answered_and_trained(miles, version):
    miles.chat.script(miles.prompt("adds_a_crate"), [THREE_CALLS, text("The oranges are on the loading dock.")])

    output = miles.rollout(miles.args(["adds_a_crate"], version=version))

    (sample,) = kept_samples(miles, output, "adds_a_crate")
    assert sample.reward == 1.0
    outcome = _outcome(sample)
    assert (outcome.scored, outcome.flags, outcome.model_calls, outcome.tool_calls) == (True, (), 2, 3)
    trained, masked = trained_and_masked(miles, sample)
    assert trained == [
        '<tool_call>\n{"name": "find_crate", "arguments": {"name": "pears"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add_crate", "arguments": {"name": "oranges"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "find_crate", "arguments": {"name": "oranges"}}\n</tool_call><|im_end|>',
        "The oranges are on the loading dock.<|im_end|>",
    ]
    assert (
        "<|im_start|>user\n<tool_response>\nThe crate 'pears' is on shelf 9C.\n</tool_response>\n"
        "<tool_response>\nAdded the crate 'oranges'; the warehouse holds 3 crates.\n</tool_response>\n"
        "<tool_response>\nThe crate 'oranges' is on shelf dock.\n</tool_response><|im_end|>"
    ) in masked[0]
    assert sample.metadata["tito_session_mismatch"] == []


def test_a_prompt_sglang_refuses_as_too_long_ends_the_episode_there(miles):
    miles.chat.script(
        miles.prompt("played"), [SCRIPTS["played"][0], error(400, SGLANG_CONTEXT_REFUSAL), *SCRIPTS["played"][1:]]
    )

    output = miles.rollout(miles.args(["played", "reply_only"]))

    kept_samples(miles, output, "reply_only")
    assert output.metrics == {"rollout/dynamic_filter/drop_context_exhausted": 1}
    (full,) = dropped_samples("played")
    outcome = _outcome(full)
    assert (outcome.reward, outcome.reason, outcome.model_calls, outcome.tool_calls) == (
        None,
        "context_exhausted",
        1,
        1,
    )
    assert SGLANG_CONTEXT_REFUSAL["message"] in outcome.flags[0].message
    assert len(miles.chat.requests_for(miles.prompt("played"))) == 2
    trained, _ = trained_and_masked(miles, full)
    assert trained == ['<tool_call>\n{"name": "find_crate", "arguments": {"name": "pears"}}\n</tool_call><|im_end|>']


def test_a_context_reaching_max_seq_len_ends_the_episode_without_another_model_call(miles):
    miles.rollout(miles.args(["played"]))
    first_prompt = len(miles.chat.requests_for(miles.prompt("played"))[0]["input_ids"])
    full = first_prompt + len(output_token_logprobs(miles.tokenizer, SCRIPTS["played"][0]))
    miles.chat.reset({miles.prompt(task): SCRIPTS[task] for task in ("played", "two_turns")})

    output = miles.rollout(miles.args(["played", "two_turns"], extra=["--max-seq-len", str(full)]))

    kept_samples(miles, output, "two_turns")
    assert output.metrics == {"rollout/dynamic_filter/drop_context_exhausted": 1}
    (cut_short,) = dropped_samples("played")
    outcome = _outcome(cut_short)
    assert (outcome.reason, outcome.turns, outcome.model_calls, outcome.tool_calls) == ("context_exhausted", 1, 1, 1)
    assert f"the context holds {full} tokens, max_context_tokens={full}" in outcome.flags[0].message
    assert len(miles.chat.requests_for(miles.prompt("played"))) == 1


def test_a_reply_cut_at_the_response_limit_ends_the_episode(miles):
    output = miles.rollout(miles.args(["played", "reply_only"], extra=["--rollout-max-response-len", "10"]))

    kept_samples(miles, output, "reply_only")
    assert output.metrics == {"rollout/dynamic_filter/drop_response_limit": 1}
    (cut,) = dropped_samples("played")
    outcome = _outcome(cut)
    assert (outcome.reason, outcome.truncated, outcome.model_calls, outcome.tool_calls) == (
        "response_limit",
        True,
        1,
        0,
    )
    assert len(miles.chat.requests_for(miles.prompt("played"))) == 1
    trained, _ = trained_and_masked(miles, cut)
    assert trained == [
        miles.decode([token for _, token, _ in output_token_logprobs(miles.tokenizer, SCRIPTS["played"][0])[:10]])
    ]


def test_a_long_tool_answer_reaches_the_model_cut_with_a_line_saying_so(miles):
    agent = ["--custom-agent-function-path", "miles_hooks.run_with_short_tool_answers"]

    output = miles.rollout(miles.args(["played"], extra=agent))

    (sample,) = kept_samples(miles, output, "played")
    assert sample.reward == 1.0
    outcome = _outcome(sample)
    assert (outcome.tool_answers_cut, outcome.tool_answer_bytes_cut) == (1, 33 - miles_hooks.TOOL_ANSWER_CHARS)
    _, masked = trained_and_masked(miles, sample)
    cut = "The crate 'p\n[the tool's answer is cut here: 21 more characters, past the 12 shown]"
    assert f"<tool_response>\n{cut}\n</tool_response>" in masked[0]
