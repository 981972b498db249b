"""chat_core's episode loop, played through agent-env's real server and the scripted model: every sample task earns
the reward the server gives it, and each way an episode goes wrong ends in a result with its own flag, never a
silent 0, with the server holding nothing open afterwards (the serve fixture checks after every test)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import shutil
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import chat_core.net.parking
import pytest
from chat_core import ChatEndpoint, EpisodeResult, FlagKind, Limits, play
from chat_core.env.session import EpisodeSession
from chat_core.net.http_request import Answer
from chat_core.net.http_session import http_session
from chat_core.net.parking import IDLE_S
from chat_core.prepare import write_rows
from test_support import (
    REWARDS,
    SAMPLE_BUNDLE,
    SCRIPTS,
    TASKS,
    ScriptedModel,
    ServedBundle,
    broken,
    delay,
    error,
    serve_bundle,
    text,
    tool_call,
    tool_calls,
)
from test_support.script import Reply
from test_support.waits import free_port, until
from websockets.asyncio.server import ServerConnection, serve

pytest_plugins = ["test_support.pytest_plugin"]

Rows = dict[str, dict[str, Any]]
TOO_DEEP = "[" * 100_000 + "]" * 100_000  # JSON nested far deeper than Python's parser can recurse
EXTRA_TASKS = {
    "unscored": [
        {"id": "agent", "type": "deploy_agent", "agent_name": "agent"},
        {"id": "ask", "type": "prompt_agent", "agent_name": "agent", "prompt_id": "ask", "poll_interval_seconds": 0.2,
         "prompt": "Say anything."},
    ],
    "greets": [
        {"id": "agent", "type": "deploy_agent", "agent_name": "agent"},
        {"id": "ask", "type": "prompt_agent", "agent_name": "agent", "prompt_id": "ask", "poll_interval_seconds": 0.2,
         "prompt": "Greet the new worker."},
        {"id": "says_hello", "type": "agent_prompt_response_verifier", "prompt_id": "ask", "verifier_id": "says_hello",
         "criteria": [{"type": "response_regex_present", "criterion": "says hello", "pattern": "hello",
                       "flags": ["IGNORECASE"]}]},
    ],
    "hurried": [
        {"id": "warehouse", "type": "deploy_env", "env_id": "warehouse"},
        {"id": "agent", "type": "deploy_agent", "agent_name": "agent", "env_ids": ["warehouse"]},
        {"id": "ask", "type": "prompt_agent", "agent_name": "agent", "prompt_id": "ask", "poll_interval_seconds": 0.2,
         "timeout_seconds": 2, "prompt": "Find the pears, quickly."},
    ],
}  # fmt: skip
# A task whose first turn can't open: a script run before it raises. prepare refuses such a bundle, so it is served
# on its own and its row written by hand.
JAMMED_AT_RESET = [
    {"id": "bay", "type": "deploy_sandbox", "sandbox_name": "bay", "sandbox_type": "local", "sandbox_mode": "vm"},
    {"id": "jam", "type": "run_code", "script_artifact_id": "jam", "sandbox_name": "bay"},
    {"id": "agent", "type": "deploy_agent", "agent_name": "agent"},
    {"id": "ask", "type": "prompt_agent", "agent_name": "agent", "prompt_id": "ask", "prompt": "Unload the truck."},
]


def _as_sent(message: dict[str, Any]) -> Any:
    """A completion holding ``message`` exactly as given, for the shapes servers other than OpenAI's write and the
    scripted model's own replies don't (``broken`` sends any body as it is)."""
    return broken(json.dumps({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}))


def _rows_of(url: str, out: Path) -> Rows:
    asyncio.run(write_rows(url, out, progress=False))
    lines = (out / "all.jsonl").read_text().splitlines()
    return {row["metadata"]["episode"]["task_name"]: row["metadata"] for row in map(json.loads, lines)}


@pytest.fixture(scope="module")
def rows(sample_env_server: ServedBundle, tmp_path_factory: pytest.TempPathFactory) -> Rows:
    """The metadata of the sample server's rows in the split ``all``, by task name."""
    return _rows_of(sample_env_server.url, tmp_path_factory.mktemp("sample") / "rows")


@pytest.fixture(scope="module")
def single_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedBundle]:
    """A server of one session at a time, with a task that records no score, one that greets, and one whose turn
    times out after 2 s."""
    bundle = tmp_path_factory.mktemp("bundles") / "single-env"
    (bundle / "tasks").mkdir(parents=True)
    shutil.copytree(SAMPLE_BUNDLE / "envs", bundle / "envs")
    for name, steps in EXTRA_TASKS.items():
        (bundle / "tasks" / f"{name}.json").write_text(json.dumps(steps))
    with serve_bundle(bundle, max_concurrent_envs=1) as served:
        yield served


@pytest.fixture
def single(single_server: ServedBundle) -> Iterator[ServedBundle]:
    yield single_server
    single_server.wait_until_closed()


@pytest.fixture(scope="module")
def single_rows(single_server: ServedBundle, tmp_path_factory: pytest.TempPathFactory) -> Rows:
    return _rows_of(single_server.url, tmp_path_factory.mktemp("single") / "rows")


def _chat(model: ScriptedModel, session: str) -> ChatEndpoint:
    return ChatEndpoint(model.base_url + "/chat/completions", "policy", {"Authorization": f"Bearer {session}"})


def _play(
    server: ServedBundle | None,
    metadata: dict[str, Any],
    model: ScriptedModel,
    steps: Any,
    *,
    session: str = "episode",
    limits: Limits | None = None,
    sampling: dict[str, Any] | None = None,
) -> EpisodeResult:
    """Play with ``steps`` scripted in an event loop of its own, then wait for ``server`` to hold nothing open: the
    loop's end closes the session it parked, if any."""
    model.script(steps, session=session)
    result = asyncio.run(play(metadata, _chat(model, session), sampling or {}, limits or Limits()))
    if server is not None:
        server.wait_until_closed()
    return result


async def _closed(server: ServedBundle) -> None:
    await asyncio.to_thread(server.wait_until_closed)


def _kinds(result: EpisodeResult) -> list[str]:
    return [flag.kind for flag in result.flags]


def test_every_sample_task_earns_its_reward(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    for task in TASKS:
        scripted_model.script(SCRIPTS[task], session=task)

    async def all_at_once() -> list[EpisodeResult]:
        return await asyncio.gather(*(play(rows[task], _chat(scripted_model, task), {}, Limits()) for task in TASKS))

    results = dict(zip(TASKS, asyncio.run(all_at_once()), strict=True))
    sample_env.wait_until_closed()

    for task, result in results.items():
        assert result.reward == REWARDS[task], (task, result.flags)
        assert result.scored == (REWARDS[task] is not None)
        assert result.episode.task_name == task
    assert results["scores_zero"].flags == []
    failed = results["fails_after_the_turn"]
    assert _kinds(failed) == [FlagKind.ENV_FAILED]
    assert "the crate scanner is broken" in failed.flags[0].message
    assert scripted_model.unscripted == []


def test_the_timings_add_up_to_the_wall_time(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    """Connecting and closing are counted in env_s or model_s, so what is left of wall_s
    is the loop's own work: a few milliseconds of CPU, whatever the server's close takes."""
    results = [
        _play(sample_env, rows[task], scripted_model, SCRIPTS[task], session=f"timed-{task}-{n}")
        for n in range(3)
        for task in ("played", "two_turns")
    ]

    for result in results:
        timings = result.timings
        own = timings.wall_s - timings.env_s - timings.model_s - timings.capacity_wait_s
        assert result.scored, result.flags
        assert 0 <= own < 0.015, (result.episode.task_name, timings)


def test_an_event_loops_http_client_session_is_its_own_and_closed_with_it() -> None:
    async def sessions() -> tuple[Any, Any]:
        return await http_session(), await http_session()

    first, again = asyncio.run(sessions())
    other, _ = asyncio.run(sessions())

    assert first is again and other is not first
    assert first.closed and other.closed


def test_an_ended_episodes_session_starts_the_next_episode_and_closes_once_idle(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    for session in ("first", "second"):
        scripted_model.script(SCRIPTS["played"], session=session)

    with asyncio.Runner() as loop:
        first = loop.run(play(rows["played"], _chat(scripted_model, "first"), {}, Limits()))
        after_first = sample_env.open_sessions()
        second = loop.run(play(rows["played"], _chat(scripted_model, "second"), {}, Limits()))
        after_second = sample_env.open_sessions()
        loop.run(until(lambda: not sample_env.held_open(), "the parked session closed", timeout=IDLE_S + 10))

    assert first.scored and second.scored
    assert (after_first, after_second) == (1, 1)


def test_the_sessions_a_loop_parked_are_closed_with_it_leaving_nothing_unclosed(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    scripted_model.script(SCRIPTS["played"], session="parks")

    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always", ResourceWarning)
        result = asyncio.run(play(rows["played"], _chat(scripted_model, "parks"), {}, Limits()))
        gc.collect()

    assert result.scored, result.flags
    assert [str(each.message) for each in warned if issubclass(each.category, ResourceWarning)] == []
    sample_env.wait_until_closed()


@pytest.mark.parametrize("ending", ["model_deadline", "env_deadline", "cancelled"])
def test_a_session_whose_episode_is_still_open_is_closed_not_parked(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    monkeypatch.setattr(chat_core.net.parking, "IDLE_S", 600.0)
    limits = {"model_deadline": Limits(model_deadline_s=1), "env_deadline": Limits(env_call_deadline_s=1)}
    steps = [tool_call("wait_for_truck", {"seconds": 3}), delay(30, text("The truck came."))]
    scripted_model.script(steps, session=ending)

    async def scenario() -> None:
        playing = asyncio.create_task(
            play(rows["played"], _chat(scripted_model, ending), {}, limits.get(ending, Limits()))
        )
        if ending == "cancelled":
            await until(lambda: sample_env.open_episodes() == 1, "the episode started")
            playing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await playing
        await until(lambda: not sample_env.held_open(), "the session closed", timeout=10)

    asyncio.run(scenario())


def test_a_parked_session_the_server_dropped_is_replaced_by_a_new_one(
    tmp_path: Path, scripted_model: ScriptedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chat_core.net.parking, "IDLE_S", 600.0)
    port = free_port()
    for session in ("before", "after"):
        scripted_model.script(SCRIPTS["played"], session=session)

    with asyncio.Runner() as loop:
        with serve_bundle(port=port) as crashed:
            played = _rows_of(crashed.url, tmp_path / "rows")["played"]
            before = loop.run(play(played, _chat(scripted_model, "before"), {}, Limits()))
            crashed.kill()
        with serve_bundle(port=port) as restarted:
            after = loop.run(play(played, _chat(scripted_model, "after"), {}, Limits()))
            parked = restarted.open_sessions()
            loop.close()

    assert before.scored and after.scored, after.flags
    assert parked == 1


def test_a_session_answers_the_servers_pings_while_the_model_thinks_a_tool_runs_and_it_is_parked(
    tmp_path: Path, scripted_model: ScriptedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tool call longer than the ping timeout, with another after it: a call sent before the one ahead of it is
    # answered would have uvicorn stop reading the session, pongs included, until the slow one is done.
    monkeypatch.setattr(chat_core.net.parking, "IDLE_S", 600.0)
    slow_tools = tool_calls(tool_call("wait_for_truck", {"seconds": 1}), tool_call("find_crate", {"name": "pears"}))
    scripted_model.script([delay(2, slow_tools), delay(2, SCRIPTS["played"][-1])], session="slow")
    scripted_model.script(SCRIPTS["played"], session="next")

    with serve_bundle(ws_ping_s=0.25) as pinging, asyncio.Runner() as loop:
        played = _rows_of(pinging.url, tmp_path / "rows")["played"]
        slow = loop.run(play(played, _chat(scripted_model, "slow"), {}, Limits()))
        loop.run(asyncio.sleep(2))
        parked = pinging.open_sessions()
        after = loop.run(play(played, _chat(scripted_model, "next"), {}, Limits()))
        loop.close()

    assert slow.scored, slow.flags
    assert parked == 1
    assert after.scored, after.flags


def test_a_reply_at_the_token_limit_and_a_tool_answer_of_several_mb_fit_the_default_limits(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    # A 32,768-token reply is about 150 KB of text; the env answers the unknown crate with its 6 MB name.
    long_reply = tool_call("find_crate", {"name": "x" * 6_000_000}, content="thinking " * 32_768)
    steps = [long_reply, *SCRIPTS["played"]]

    result = _play(sample_env, rows["played"], scripted_model, steps, session="large")

    assert result.scored and result.reward == 1.0, result.flags
    answered = result.transcript[3]
    shown = Limits().max_tool_answer_chars
    assert answered["role"] == "tool" and answered["content"].startswith("error (")
    assert answered["content"].endswith(" more characters, past the 16,000 shown]")
    assert len(answered["content"]) < shown + 100
    assert result.tool_answers_cut == 1 and result.tool_answer_bytes_cut > 6_000_000 - shown
    assert result.turns[0].tool_errors == 1


def test_a_tool_call_is_run_and_answered(sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel) -> None:
    sampling = {"temperature": 0.7, "top_k": 20, "max_tokens": 64}

    result = _play(sample_env, rows["played"], scripted_model, SCRIPTS["played"], session="played", sampling=sampling)

    assert result.reward == 1.0 and result.scored
    system, user, called, answered, replied = result.transcript
    assert (system["role"], user["role"], replied) == (
        "system",
        "user",
        {"role": "assistant", "content": "The crate of pears is on shelf 9C."},
    )
    assert called["tool_calls"][0]["function"]["name"] == "find_crate"
    assert answered == {
        "role": "tool",
        "tool_call_id": called["tool_calls"][0]["id"],
        "content": "The crate 'pears' is on shelf 9C.",
    }
    assert [(turn.model_calls, turn.tool_calls, turn.tool_errors) for turn in result.turns] == [(2, 1, 0)]
    first, second = scripted_model.requests_of("played")
    assert first.body["model"] == "policy" and first.extra == sampling
    assert [tool["function"]["name"] for tool in first.tools] == [
        "list_crates",
        "find_crate",
        "add_crate",
        "wait_for_truck",
        "end_turn",
    ]
    assert first.messages == [system, user]
    assert second.messages == [system, user, called, answered]
    assert first.headers["authorization"] == "Bearer played"


def test_each_turn_opens_with_its_prompt(sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel) -> None:
    result = _play(sample_env, rows["two_turns"], scripted_model, SCRIPTS["two_turns"])

    assert result.reward == 1.0
    assert [message["role"] for message in result.transcript] == ["system", "user", "assistant", "user", "assistant"]
    assert result.transcript[3]["content"] == "Their shift is over. Say goodbye to them."
    assert len(result.turns) == 2


def test_a_tool_error_goes_back_to_the_model(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    steps = [tool_call("find_crate", {"name": "plums"}), *SCRIPTS["played"]]

    result = _play(sample_env, rows["played"], scripted_model, steps)

    assert result.reward == 1.0 and result.flags == []
    assert result.transcript[3]["role"] == "tool"
    assert result.transcript[3]["content"].startswith("error (execution_error)")
    assert "plums" in result.transcript[3]["content"]
    assert [(turn.tool_calls, turn.tool_errors) for turn in result.turns] == [(2, 1)]


def test_a_tool_call_without_an_id_and_with_arguments_as_an_object_is_run(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    call = {"type": "function", "function": {"name": "find_crate", "arguments": {"name": "pears"}}}
    steps = [_as_sent({"role": "assistant", "content": None, "tool_calls": [call]}), *SCRIPTS["played"][1:]]

    result = _play(sample_env, rows["played"], scripted_model, steps)

    assert result.reward == 1.0 and result.flags == []
    called, answered = result.transcript[2:4]
    assert answered == {
        "role": "tool",
        "tool_call_id": called["tool_calls"][0]["id"],
        "content": "The crate 'pears' is on shelf 9C.",
    }


def test_tool_calls_without_ids_get_ids_no_other_call_of_the_episode_has(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    # A model whose calls carry no id would otherwise have each reply's first call answered as the one before it:
    # the chat template puts each tool message under the call whose id it names.
    def without_id(name: str) -> Any:
        call = {"type": "function", "function": {"name": name, "arguments": '{"name": "pears"}'}}
        return _as_sent({"role": "assistant", "content": None, "tool_calls": [call]})

    steps = [without_id("find_crate"), without_id("find_crate"), *SCRIPTS["played"][1:]]

    result = _play(sample_env, rows["played"], scripted_model, steps)

    called = [call["id"] for message in result.transcript for call in message.get("tool_calls", [])]
    answered = [message["tool_call_id"] for message in result.transcript if message["role"] == "tool"]
    assert len(called) == 2 and len(set(called)) == 2 and answered == called


def test_a_reply_in_text_parts_is_read_and_kept_without_empty_fields(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    parts = [{"type": "text", "text": "A "}, {"type": "text", "text": "banana."}]
    steps = [_as_sent({"role": "assistant", "content": parts, "tool_calls": [], "function_call": None})]

    result = _play(sample_env, rows["reply_only"], scripted_model, steps)

    assert result.reward == 1.0 and result.flags == []
    assert result.transcript[-1] == {"role": "assistant", "content": parts}


def test_a_reply_only_pythons_json_reads_is_played_and_kept_as_it_came(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    # NaN isn't JSON, but Python's encoder writes it; an integer past 64 bits is JSON that orjson can't encode.
    steps = [_as_sent({"role": "assistant", "content": "A banana.", "seed": 2**70 + 1, "logprob": math.nan})]

    result = _play(sample_env, rows["reply_only"], scripted_model, steps)

    assert result.reward == 1.0 and result.flags == []
    kept = result.transcript[-1]
    assert (kept["content"], kept["seed"], math.isnan(kept["logprob"])) == ("A banana.", 2**70 + 1, True)


def test_blank_arguments_are_no_arguments(sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel) -> None:
    steps = [tool_call("list_crates", " "), *SCRIPTS["played"]]

    result = _play(sample_env, rows["played"], scripted_model, steps)

    assert result.reward == 1.0 and result.flags == []
    assert "pears" in result.transcript[3]["content"]
    assert [(turn.tool_calls, turn.tool_errors) for turn in result.turns] == [(2, 0)]


@pytest.mark.parametrize("arguments", ['{"name": "pears"', '["pears"]', '"pears"', TOO_DEEP, 7])
def test_arguments_that_arent_an_object_are_answered_as_an_error(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel, arguments: str | int
) -> None:
    if isinstance(arguments, str):
        called = tool_call("find_crate", arguments)
    else:
        call = {"id": "call_7", "type": "function", "function": {"name": "find_crate", "arguments": arguments}}
        called = _as_sent({"role": "assistant", "tool_calls": [call]})
    steps = [called, *SCRIPTS["played"]]

    result = _play(sample_env, rows["played"], scripted_model, steps)

    assert result.reward == 1.0 and result.scored
    assert _kinds(result) == [FlagKind.BAD_TOOL_ARGUMENTS]
    assert not result.flags[0].fatal
    assert result.transcript[3]["role"] == "tool" and result.transcript[3]["content"].startswith("error: ")
    assert [(turn.tool_calls, turn.tool_errors) for turn in result.turns] == [(2, 1)]


def test_a_reply_cut_at_the_token_limit_is_played_on_and_noted_when_the_launch_asks(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    steps = [text("Welcome to the ware", finish_reason="length"), text("Goodbye!")]

    result = _play(sample_env, rows["two_turns"], scripted_model, steps, limits=Limits(play_on_cut_reply=True))

    assert result.reward == 1.0 and result.scored
    assert _kinds(result) == [FlagKind.REPLY_TRUNCATED]
    assert result.flags[0].message.startswith("turn 1: ")
    assert not result.flags[0].fatal
    assert len(result.turns) == 2


def test_a_reply_cut_at_the_token_limit_ends_the_episode_there_unscored_its_calls_not_run(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    cut = Reply("Let me look.", tool_call("find_crate", {"name": "pears"}).tool_calls, finish_reason="length")
    steps = [cut, text("The crate of pears is on shelf 9C.")]

    result = _play(sample_env, rows["played"], scripted_model, steps)

    assert result.reward is None and not result.scored
    assert _kinds(result) == [FlagKind.RESPONSE_LIMIT] and result.flags[0].fatal
    assert result.flags[0].message == (
        "turn 1: reply 1 was cut at the model's token limit (finish_reason 'length'), and play_on_cut_reply is "
        "false; the episode ended there unscored, its verifiers not run (score_cut_short is false)"
    )
    assert [(turn.model_calls, turn.tool_calls) for turn in result.turns] == [(1, 0)]
    assert len(scripted_model.requests) == 1


def test_a_cut_reply_is_scored_as_it_stands_with_score_cut_short(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    steps = [text("A banana, which is long and", finish_reason="length")]

    result = _play(sample_env, rows["reply_only"], scripted_model, steps, limits=Limits(score_cut_short=True))

    assert result.reward == 1.0 and result.scored
    assert _kinds(result) == [FlagKind.RESPONSE_LIMIT] and not result.flags[0].fatal
    assert result.flags[0].message.endswith(
        "the turn was handed to the env with the latest reply's text and the episode scored as it stands, as "
        "score_cut_short asks"
    )


def test_an_episode_cut_short_that_the_env_goes_on_with_is_unscored_even_with_score_cut_short(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    steps = [text("Welcome to the ware", finish_reason="length"), text("Goodbye!")]

    result = _play(sample_env, rows["two_turns"], scripted_model, steps, limits=Limits(score_cut_short=True))

    assert result.reward is None and not result.scored
    assert _kinds(result) == [FlagKind.RESPONSE_LIMIT] and result.flags[0].fatal
    assert "but the env opened turn 2 rather than score the episode, so it ended unscored" in result.flags[0].message
    assert len(result.turns) == 1 and len(scripted_model.requests) == 1


CONTEXT_REFUSALS = {
    "OpenAI": {
        "error": {
            "message": "This model's maximum context length is 8192 tokens. However, your messages resulted in 8200 "
            "tokens. Please reduce the length of the messages.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    },
    "vLLM": {
        "object": "error",
        "message": "This model's maximum context length is 8192 tokens. However, your request has 8200 input tokens. "
        "Please reduce the length of the input messages.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    },
    "SGLang": {
        "object": "error",
        "message": "The input (8200 tokens) is longer than the model's context length (8192 tokens).",
        "type": "BadRequest",
        "param": None,
        "code": 400,
    },
    "SGLang, prompt and max_tokens": {
        "object": "error",
        "message": "Requested token count exceeds the model's maximum context length of 8192 tokens. You requested "
        "a total of 9000 tokens: 7000 tokens from the input messages and 2000 tokens for the completion. Please "
        "reduce the number of tokens in the input messages or the completion to fit within the limit.",
        "type": "BadRequest",
        "param": None,
        "code": 400,
    },
}
"""How OpenAI's API, vLLM's and SGLang's OpenAI servers refuse a prompt too long for the model's context."""


@pytest.mark.parametrize("server", list(CONTEXT_REFUSALS))
def test_a_prompt_the_chat_endpoint_refuses_as_too_long_ends_the_episode_there(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel, server: str
) -> None:
    steps = [tool_call("find_crate", {"name": "pears"}), error(400, CONTEXT_REFUSALS[server]), text("Shelf 9C.")]

    result = _play(sample_env, rows["played"], scripted_model, steps)

    assert result.reward is None and not result.scored
    assert _kinds(result) == [FlagKind.CONTEXT_EXHAUSTED] and result.flags[0].fatal
    said = CONTEXT_REFUSALS[server].get("error", CONTEXT_REFUSALS[server])["message"]
    assert result.flags[0].message.startswith(
        f"turn 1: the next prompt doesn't fit the model's context (the chat endpoint {_chat(scripted_model, '').url} "
        f'refused the prompt: "{said[:40]}'
    )
    assert [(turn.model_calls, turn.tool_calls) for turn in result.turns] == [(1, 1)]
    assert len(scripted_model.requests) == 2


def test_a_full_context_hands_the_turn_to_the_env_with_the_latest_text_with_score_cut_short(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    looked = tool_call("find_crate", {"name": "pears"}, content="The pears are on shelf 9C, I think.")
    steps = [looked, error(400, CONTEXT_REFUSALS["SGLang"])]

    result = _play(sample_env, rows["played"], scripted_model, steps, limits=Limits(score_cut_short=True))

    assert result.reward == 1.0 and result.scored
    assert _kinds(result) == [FlagKind.CONTEXT_EXHAUSTED] and not result.flags[0].fatal


def _counted(message: dict[str, Any], prompt_tokens: int, completion_tokens: int) -> Any:
    """A completion holding ``message``, whose usage counts ``prompt_tokens`` and ``completion_tokens``."""
    choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if "tool_calls" in message else "stop"}
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    return broken(json.dumps({"choices": [choice], "usage": usage}))


FIND_PEARS = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "find_crate", "arguments": "{}"}}],
}


def test_a_reply_taking_the_context_past_max_context_tokens_is_left_unplayed_and_the_episode_ended(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    answer = {"role": "assistant", "content": "The crate of pears is on shelf 9C."}
    steps = [_counted(FIND_PEARS, 100, 20), _counted(answer, 125, 10)]

    result = _play(sample_env, rows["played"], scripted_model, steps, limits=Limits(max_context_tokens=130))

    assert _kinds(result) == [FlagKind.CONTEXT_EXHAUSTED] and not result.scored
    assert "the reply took the context to 135 tokens, past max_context_tokens=130" in result.flags[0].message
    assert [message["role"] for message in result.transcript] == ["system", "user", "assistant", "tool"]
    assert len(scripted_model.requests) == 2


def test_a_context_holding_max_context_tokens_asks_the_model_no_more(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    steps = [_counted(FIND_PEARS, 100, 30), text("The crate of pears is on shelf 9C.")]

    result = _play(sample_env, rows["played"], scripted_model, steps, limits=Limits(max_context_tokens=130))

    assert _kinds(result) == [FlagKind.CONTEXT_EXHAUSTED] and not result.scored
    assert "the context holds 130 tokens, max_context_tokens=130" in result.flags[0].message
    assert [(turn.model_calls, turn.tool_calls) for turn in result.turns] == [(1, 1)]
    assert len(scripted_model.requests) == 1


def test_max_context_tokens_needs_the_chat_endpoint_to_report_usage(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    steps = [_as_sent({"role": "assistant", "content": "A banana."})]

    result = _play(sample_env, rows["reply_only"], scripted_model, steps, limits=Limits(max_context_tokens=8192))

    assert _kinds(result) == [FlagKind.SESSION_FAILED]
    assert "answered without usage" in result.flags[0].message


def test_a_tool_answer_past_max_tool_answer_chars_reaches_the_model_cut_with_a_line_saying_so(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    result = _play(
        sample_env, rows["played"], scripted_model, SCRIPTS["played"], limits=Limits(max_tool_answer_chars=12)
    )

    assert result.reward == 1.0 and result.scored and result.flags == []
    shown = "The crate 'p\n[the tool's answer is cut here: 21 more characters, past the 12 shown]"
    assert result.transcript[3]["content"] == shown
    assert scripted_model.requests[1].messages[3]["content"] == shown
    assert (result.tool_answers_cut, result.tool_answer_bytes_cut) == (1, 21)


def test_every_tool_call_of_a_reply_is_run_in_order_and_answered(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    three = tool_calls(
        tool_call("find_crate", {"name": "pears"}),
        tool_call("add_crate", {"name": "oranges"}),
        tool_call("find_crate", {"name": "oranges"}),
    )

    result = _play(sample_env, rows["adds_a_crate"], scripted_model, [three, text("The oranges are in.")])

    assert result.reward == 1.0 and result.scored and result.flags == []
    called, *answers, _ = result.transcript[2:]
    assert [answer["tool_call_id"] for answer in answers] == [call["id"] for call in called["tool_calls"]]
    assert [answer["content"] for answer in answers] == [
        "The crate 'pears' is on shelf 9C.",
        "Added the crate 'oranges'; the warehouse holds 3 crates.",
        "The crate 'oranges' is on shelf dock.",
    ]
    assert [(turn.model_calls, turn.tool_calls, turn.dropped_tool_calls) for turn in result.turns] == [(2, 3, 0)]


def test_the_model_may_end_its_turn_itself(sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel) -> None:
    result = _play(sample_env, rows["reply_only"], scripted_model, [tool_call("end_turn", {"response": "A banana."})])

    assert result.reward == 1.0 and result.flags == []
    assert result.transcript[-1]["role"] == "tool"
    assert result.turns[0].tool_calls == 0


def test_end_turn_without_a_response_hands_back_the_replys_text(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    steps = [tool_call("end_turn", {}, content="A banana.")]

    result = _play(sample_env, rows["reply_only"], scripted_model, steps)

    assert result.reward == 1.0 and result.flags == []


def test_end_turn_with_a_response_that_isnt_text_is_answered_as_an_error(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    steps = [tool_call("end_turn", {"response": ["A", "banana"]}), text("A banana.")]

    result = _play(sample_env, rows["reply_only"], scripted_model, steps)

    assert result.reward == 1.0 and result.scored
    assert _kinds(result) == [FlagKind.BAD_TOOL_ARGUMENTS]
    assert result.transcript[-2]["content"].startswith('error: end_turn takes {"response": string}')


def test_calls_after_end_turn_are_not_run(sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel) -> None:
    steps = [
        tool_calls(tool_call("end_turn", {"response": "I added it."}), tool_call("add_crate", {"name": "oranges"}))
    ]

    result = _play(sample_env, rows["adds_a_crate"], scripted_model, steps)

    assert result.reward == 0.0 and result.scored
    assert result.transcript[-1]["content"] == "error: not run: the turn had already ended"
    assert result.turns[0].dropped_tool_calls == 1


def test_past_the_tool_call_limit_the_turn_ends_with_the_latest_text(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    steps = [
        tool_call("find_crate", {"name": "apples"}),
        tool_call("find_crate", {"name": "pears"}, content="The pears are on shelf 9C, I think."),
    ]

    result = _play(sample_env, rows["played"], scripted_model, steps, limits=Limits(max_tool_calls_per_turn=1))

    assert result.reward == 1.0 and result.scored
    assert _kinds(result) == [FlagKind.TOOL_CALL_LIMIT]
    assert result.transcript[-1]["content"] == "error: not run: the turn's tool-call limit was reached"
    assert result.turns[0].tool_calls == 1 and result.turns[0].dropped_tool_calls == 1


def test_past_the_turn_limit_the_episode_is_abandoned_unscored(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    result = _play(sample_env, rows["two_turns"], scripted_model, SCRIPTS["two_turns"], limits=Limits(max_turns=1))

    assert result.reward is None and not result.scored
    assert _kinds(result) == [FlagKind.TURN_LIMIT]
    assert len(scripted_model.requests) == 1


def test_past_the_model_deadline_the_episode_is_abandoned(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    steps = [text("Let me see."), delay(30, text("A banana."))]

    result = _play(sample_env, rows["two_turns"], scripted_model, steps, limits=Limits(model_deadline_s=3))

    assert result.reward is None and not result.scored
    assert _kinds(result) == [FlagKind.MODEL_DEADLINE]
    assert "model_deadline_s=3" in result.flags[0].message
    assert len(result.turns) == 2


def test_the_model_deadline_bounds_all_of_an_episodes_model_calls_together(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    # Each reply alone comes within the deadline; the two together don't.
    steps = [delay(2.5, text("Welcome to the warehouse!")), delay(2.5, text("Goodbye, and thank you!"))]

    result = _play(sample_env, rows["two_turns"], scripted_model, steps, limits=Limits(model_deadline_s=4))

    assert result.reward is None and not result.scored
    assert _kinds(result) == [FlagKind.MODEL_DEADLINE]
    assert [turn.model_calls for turn in result.turns] == [1, 0]


def test_an_env_call_past_its_deadline_is_flagged_and_its_session_closed(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    steps = [tool_call("wait_for_truck", {"seconds": 6}), text("The truck came.")]

    result = _play(sample_env, rows["played"], scripted_model, steps, limits=Limits(env_call_deadline_s=2))

    assert result.reward is None and not result.scored
    assert _kinds(result) == [FlagKind.ENV_DEADLINE]
    assert "didn't answer call_tool 'wait_for_truck' within 2 s" in result.flags[0].message
    assert "env_call_deadline_s=2" in result.flags[0].message
    assert result.timings.wall_s < 6
    assert len(scripted_model.requests) == 1


@pytest.mark.parametrize(("step", "says"), [
    (error(500, "upstream exploded"), "upstream exploded"),
    (error(400, "no such parameter"), "HTTP 400"),
    (broken(), "isn't JSON"),
    (broken('{"choices": []}'), "without a choice"),
    (broken(TOO_DEEP), "nested too deeply"),
    (_as_sent({"role": "assistant", "tool_calls": [{"id": "call_1", "function": {}}]}), "aren't OpenAI tool calls"),
    (_as_sent({"role": "assistant", "content": {"text": "A pear."}}), "neither text nor text parts"),
])  # fmt: skip
def test_a_failed_chat_session_is_flagged(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel, step: Any, says: str
) -> None:
    result = _play(sample_env, rows["played"], scripted_model, [step])

    assert result.reward is None and not result.scored
    assert _kinds(result) == [FlagKind.SESSION_FAILED]
    assert says in result.flags[0].message


def test_a_reply_the_server_aborted_ends_the_episode_with_a_flag_of_its_own(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    steps = [text("The crate of pe", finish_reason="abort"), text("The crate of pears is on shelf 9C.")]

    result = _play(sample_env, rows["played"], scripted_model, steps)

    assert result.reward is None and not result.scored
    assert _kinds(result) == [FlagKind.REPLY_ABORTED]
    assert "aborted the reply (finish_reason 'abort'), cut at 'The crate of pe'" in result.flags[0].message
    assert len(scripted_model.requests) == 1


@pytest.mark.parametrize("status", [429, 502, 503, 504])
def test_an_overloaded_model_is_waited_for_as_retry_after_asks(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel, status: int
) -> None:
    steps = [error(status, headers={"Retry-After": "0.3"}), text("A banana.")]

    result = _play(sample_env, rows["reply_only"], scripted_model, steps)

    assert result.reward == 1.0 and result.scored and result.flags == []
    assert result.model_retries == 1 and result.timings.model_s >= 0.3
    assert len(scripted_model.requests) == 2


def test_a_model_overloaded_past_the_deadline_is_a_failed_session(
    sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel
) -> None:
    began = time.monotonic()

    result = _play(sample_env, rows["reply_only"], scripted_model, [error(429)] * 50, limits=Limits(model_deadline_s=2))

    assert _kinds(result) == [FlagKind.SESSION_FAILED]
    assert "HTTP 429" in result.flags[0].message and "sent again before giving up" in result.flags[0].message
    assert result.model_retries >= 1 and len(scripted_model.requests) == result.model_retries + 1
    assert result.timings.model_s < 2 and time.monotonic() - began < 10


def test_an_unreachable_chat_endpoint_is_retried_then_a_failed_session(sample_env: ServedBundle, rows: Rows) -> None:
    chat = ChatEndpoint(f"http://127.0.0.1:{free_port()}/v1/chat/completions", "policy")

    result = asyncio.run(play(rows["reply_only"], chat, {}, Limits(model_deadline_s=1.5)))

    assert _kinds(result) == [FlagKind.SESSION_FAILED]
    assert "Connect" in result.flags[0].message and result.model_retries >= 1


class _InProcessModel:
    """A chat endpoint served in the test's own process: it answers each request with the next of ``answers``
    (status, headers, completion or text) and keeps what it was sent."""

    def __init__(self, *answers: tuple[int, dict[str, str], Any]):
        self.answers = list(answers)
        self.requests: list[tuple[dict[str, Any], Mapping[str, str]]] = []

    async def __call__(self, body: bytes, headers: Mapping[str, str]) -> Answer:
        self.requests.append((json.loads(body), headers))
        status, answer_headers, answer = self.answers.pop(0)
        sent = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
        return Answer(status, answer_headers, sent)

    def chat(self) -> ChatEndpoint:
        """An endpoint whose URL nothing listens on, so a request sent over HTTP would be refused."""
        url = f"http://127.0.0.1:{free_port()}/v1/chat/completions"
        return ChatEndpoint(url, "policy", {"Authorization": "Bearer in-process"}, in_process=self)


def _completion(content: str) -> tuple[int, dict[str, str], Any]:
    message = {"role": "assistant", "content": content}
    return 200, {}, {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


def test_an_in_process_chat_endpoint_plays_the_episode_without_http(sample_env: ServedBundle, rows: Rows) -> None:
    model = _InProcessModel(_completion("A banana."))

    result = asyncio.run(play(rows["reply_only"], model.chat(), {"temperature": 0.5}, Limits()))

    assert result.reward == 1.0 and result.scored and result.flags == []
    [(body, headers)] = model.requests
    assert body["model"] == "policy" and body["temperature"] == 0.5 and body["messages"][-1]["role"] == "user"
    assert headers["Authorization"] == "Bearer in-process" and headers["Content-Type"] == "application/json"


def test_an_in_process_chat_endpoint_is_waited_for_as_retry_after_asks(sample_env: ServedBundle, rows: Rows) -> None:
    model = _InProcessModel((503, {"Retry-After": "0.3"}, "busy"), _completion("A banana."))

    result = asyncio.run(play(rows["reply_only"], model.chat(), {}, Limits()))

    assert result.reward == 1.0 and result.flags == []
    assert result.model_retries == 1 and result.timings.model_s >= 0.3 and len(model.requests) == 2


def test_an_in_process_answer_past_max_chat_answer_bytes_is_a_failed_session(
    sample_env: ServedBundle, rows: Rows
) -> None:
    model = _InProcessModel(_completion("A banana. " * 200))

    result = asyncio.run(play(rows["reply_only"], model.chat(), {}, Limits(max_chat_answer_bytes=1000)))

    assert _kinds(result) == [FlagKind.SESSION_FAILED]
    assert "max_chat_answer_bytes=1000" in result.flags[0].message


def test_a_row_of_another_task_is_refused(sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel) -> None:
    moved = {**rows["played"], "episode": {**rows["played"]["episode"], "task_id": "@local/elsewhere/played"}}

    result = _play(sample_env, moved, scripted_model, SCRIPTS["played"])

    assert _kinds(result) == [FlagKind.TASK_MISMATCH]
    assert "@local/elsewhere/played" in result.flags[0].message
    assert scripted_model.requests == []


def test_an_episode_the_env_cant_start_is_flagged(tmp_path: Path, scripted_model: ScriptedModel) -> None:
    bundle = tmp_path / "jammed-env"
    (bundle / "tasks").mkdir(parents=True)
    (bundle / "tasks" / "jammed.json").write_text(json.dumps(JAMMED_AT_RESET))
    (bundle / "artifacts" / "jam").mkdir(parents=True)
    (bundle / "artifacts" / "jam" / "run.py").write_text("def run(input):\n    raise RuntimeError('jammed bay')\n")

    with serve_bundle(bundle) as served:
        [task] = served.tasks()
        metadata = {
            "episode": {"split": "all", "index": 0, "task_id": task["id"], "task_name": task["name"]},
            "server": {"url": served.url, "env_name": served.env_name},
            "tools": [],
        }
        result = _play(served, metadata, scripted_model, [text("Hello.")])

    assert result.reward is None and not result.scored
    assert _kinds(result) == [FlagKind.ENV_FAILED]
    assert "jammed bay" in result.flags[0].message
    assert (result.transcript, result.turns, scripted_model.requests) == ([], [], [])


def test_a_turn_that_times_out_during_a_tool_call_ends_the_episode(
    single: ServedBundle, single_rows: Rows, scripted_model: ScriptedModel
) -> None:
    steps = [delay(3, tool_call("find_crate", {"name": "pears"})), text("Shelf 9C.")]

    result = _play(single, single_rows["hurried"], scripted_model, steps)

    assert result.reward is None and not result.scored
    assert _kinds(result) == [FlagKind.ENV_FAILED]
    assert "TimeoutError" in result.flags[0].message
    assert len(scripted_model.requests) == 1


def test_an_episode_without_a_reward_is_flagged(
    single: ServedBundle, single_rows: Rows, scripted_model: ScriptedModel
) -> None:
    result = _play(single, single_rows["unscored"], scripted_model, [text("Anything.")])

    assert result.reward is None and not result.scored
    assert _kinds(result) == [FlagKind.NO_REWARD]


def test_a_full_server_is_waited_for(single: ServedBundle, single_rows: Rows, scripted_model: ScriptedModel) -> None:
    scripted_model.script([text("Hello, welcome!")], session="waits")

    async def scenario() -> EpisodeResult:
        async with _held(single, single_rows["unscored"]):
            waiting = asyncio.create_task(play(single_rows["greets"], _chat(scripted_model, "waits"), {}, Limits()))
            await asyncio.sleep(2)
            assert not waiting.done()
        result = await waiting
        await _closed(single)
        return result

    result = asyncio.run(scenario())

    assert result.reward == 1.0 and result.scored
    timings = result.timings
    assert timings.capacity_wait_s > 0
    assert timings.env_s + timings.model_s + timings.capacity_wait_s <= timings.wall_s


def test_a_server_full_for_too_long_is_flagged(
    single: ServedBundle, single_rows: Rows, scripted_model: ScriptedModel
) -> None:
    async def scenario() -> EpisodeResult:
        async with _held(single, single_rows["unscored"]), asyncio.timeout(60):  # a guard against a wait without end
            result = await play(single_rows["greets"], _chat(scripted_model, "gives_up"), {}, Limits(capacity_wait_s=1))
        await _closed(single)
        return result

    result = asyncio.run(scenario())

    assert result.reward is None and not result.scored
    assert _kinds(result) == [FlagKind.CAPACITY_EXHAUSTED]
    assert "all 1 of its sessions" in result.flags[0].message
    assert scripted_model.requests == []
    timings = result.timings
    assert timings.capacity_wait_s >= 1
    assert timings.env_s + timings.capacity_wait_s <= timings.wall_s


def test_cancelling_closes_the_episode(sample_env: ServedBundle, rows: Rows, scripted_model: ScriptedModel) -> None:
    scripted_model.script([delay(30, text("I added the crate."))], session="cancelled")

    async def scenario() -> None:
        playing = asyncio.create_task(play(rows["adds_a_crate"], _chat(scripted_model, "cancelled"), {}, Limits()))
        await until(lambda: scripted_model.requests_of("cancelled"), "the model asked")
        assert sample_env.open_episodes() == 1
        playing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await playing
        await _closed(sample_env)

    asyncio.run(scenario())


def test_cancelling_while_waiting_for_a_session_leaves_none(
    single: ServedBundle, single_rows: Rows, scripted_model: ScriptedModel
) -> None:
    async def scenario() -> None:
        async with _held(single, single_rows["unscored"]):
            waiting = asyncio.create_task(play(single_rows["greets"], _chat(scripted_model, "never"), {}, Limits()))
            await asyncio.sleep(1)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
        await _closed(single)

    asyncio.run(scenario())

    assert scripted_model.requests == []


def test_an_unreachable_env_server_is_flagged(rows: Rows, scripted_model: ScriptedModel) -> None:
    elsewhere = {
        **rows["reply_only"],
        "server": {**rows["reply_only"]["server"], "url": f"http://127.0.0.1:{free_port()}"},
    }

    result = _play(None, elsewhere, scripted_model, SCRIPTS["reply_only"])

    assert _kinds(result) == [FlagKind.ENV_UNREACHABLE]
    assert scripted_model.requests == []


@pytest.mark.parametrize(("answer", "says"), [
    ({"type": "error", "data": {"code": "EXECUTION_ERROR", "message": "it broke"}}, "EXECUTION_ERROR: it broke"),
    (None, "the server closed the session"),
    ("not json", "isn't JSON"),
    (TOO_DEEP, "nested too deeply"),
    ({"type": "observation", "data": {"observation": {}, "done": False}}, "neither ended the episode nor opened"),
    ({"type": "observation", "data": {"observation": {}, "done": True, "reward": "1.0"}}, "reward that isn't a number"),
])  # fmt: skip
def test_an_env_server_breaking_the_protocol_is_flagged(scripted_model: ScriptedModel, answer: Any, says: str) -> None:
    result = _play_on_fake_env(answer, scripted_model)

    assert result.reward is None and not result.scored
    assert _kinds(result) == [FlagKind.PROTOCOL_ERROR]
    assert says in result.flags[0].message


def test_an_episode_the_env_ends_as_its_turn_opens_is_not_played(scripted_model: ScriptedModel) -> None:
    # The real server ends an episode at list_tools only when its run fails between a turn opening and the listing,
    # which can't be made to happen on cue.
    metadata = {"status": "error", "error": "RuntimeError: the warehouse flooded"}
    ended = {"type": "observation", "data": {"observation": {"tools": []}, "done": True, "metadata": metadata}}

    result = _play_on_fake_env(ended, scripted_model)

    assert _kinds(result) == [FlagKind.ENV_FAILED]
    assert "the warehouse flooded" in result.flags[0].message
    assert scripted_model.requests == []


def test_a_reward_that_isnt_finite_is_no_reward(scripted_model: ScriptedModel) -> None:
    # agent-env scores 1.0, 0.0 or None, but JSON from Python may carry NaN, which no trainer should get.
    ended = {"type": "observation", "data": {"observation": {}, "done": True, "reward": math.nan}}

    result = _play_on_fake_env(ended, scripted_model)

    assert result.reward is None and not result.scored
    assert _kinds(result) == [FlagKind.NO_REWARD]


def test_a_tool_argument_past_64_bits_reaches_the_env_as_the_model_wrote_it(scripted_model: ScriptedModel) -> None:
    # Python writes integers of any size, and so may a model; read as the nearest float, the serial number below
    # would reach the env as 1.2345678901234568e+29.
    arguments = {"serial": 123456789012345678901234567890, "offset": -9223372036854775809}
    called: list[dict[str, Any]] = []

    def env(data: dict[str, Any]) -> dict[str, Any]:
        if data["type"] == "list_tools":
            tools = [{"name": "stamp", "input_schema": {"type": "object"}}]
            return {"type": "observation", "data": {"observation": {"tools": tools}, "done": False}}
        called.append(data["arguments"])
        return {"type": "observation", "data": {"observation": {}, "done": True, "reward": 1.0}}

    scripted_model.script([tool_call("stamp", arguments)], session="fake")

    async def scenario() -> EpisodeResult:
        async with _fake_env(env) as url:
            return await play(_fake_row(url), _chat(scripted_model, "fake"), {}, Limits())

    result = asyncio.run(scenario())

    assert result.scored and called == [arguments]
    assert [type(value) for value in called[0].values()] == [int, int]


def test_metadata_prepare_didnt_write_is_refused_up_front() -> None:
    chat = ChatEndpoint("http://127.0.0.1:1/v1/chat/completions", "policy")

    with pytest.raises(ValueError, match="isn't a row written by"):
        asyncio.run(play({"prompt": "hi"}, chat, {}, Limits()))


def test_sampling_cant_replace_what_play_sends(rows: Rows) -> None:
    chat = ChatEndpoint("http://127.0.0.1:1/v1/chat/completions", "policy")

    with pytest.raises(ValueError, match="sampling sets model, tools"):
        asyncio.run(play(rows["played"], chat, {"model": "other", "tools": [], "top_p": 1}, Limits()))


@asynccontextmanager
async def _held(server: ServedBundle, metadata: dict[str, Any]):
    """An episode of ``metadata``'s task held open, taking one of ``server``'s sessions, for the ``with`` body."""
    async with EpisodeSession(server.url) as session:
        await session.reset(metadata["episode"]["split"], metadata["episode"]["index"])
        yield


def _play_on_fake_env(answer: Any, model: ScriptedModel) -> EpisodeResult:
    """The task ``fake`` played on ``_fake_env(answer)``, the model replying ``Hello.`` should it be asked."""
    model.script([text("Hello.")], session="fake")

    async def scenario() -> EpisodeResult:
        async with _fake_env(answer) as url:
            return await play(_fake_row(url), _chat(model, "fake"), {}, Limits())

    return asyncio.run(scenario())


def _fake_row(url: str) -> dict[str, Any]:
    """The metadata of a row of the task ``fake`` on the server at ``url``."""
    return {
        "episode": {"split": "all", "index": 0, "task_id": "fake", "task_name": "fake"},
        "server": {"url": url, "env_name": "fake"},
        "tools": [],
    }


@asynccontextmanager
async def _fake_env(answer: Any):
    """A WebSocket server that starts the task ``fake`` and answers every later message with ``answer``: a frame,
    text that isn't JSON, (None) a closed connection, or a function of the message's ``data`` giving the frame."""

    async def session(ws: ServerConnection) -> None:
        async for message in ws:
            if json.loads(message)["type"] == "reset":
                task = {"id": "fake", "name": "fake", "split": "all", "index": 0}
                await ws.send(
                    json.dumps(
                        {
                            "type": "observation",
                            "data": {
                                "observation": {},
                                "reward": None,
                                "done": False,
                                "metadata": {"prompt": "Hi.", "system_prompt": None, "task": task},
                            },
                        }
                    )
                )
            elif answer is None:
                return
            elif callable(answer):
                await ws.send(json.dumps(answer(json.loads(message)["data"])))
            else:
                await ws.send(answer if isinstance(answer, str) else json.dumps(answer))

    async with serve(session, "127.0.0.1", 0) as server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
