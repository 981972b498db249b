"""``python -m chat_core.evaluate`` against agent-env's real server and the scripted model: the records and the
summary a person reads, the key kept out of every file, the pre-flight that stops a wrong endpoint at once, retries
of an overloaded model, a killed run resumed with every episode counted once, and the comparison of two runs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from chat_core import OUTCOME_KEY
from chat_core.evaluate.command import main
from chat_core.evaluate.summary import pass_at_k
from chat_core.prepare import write_rows
from chat_core.record.outcome import EpisodeOutcome
from test_support import REWARDS, SCRIPTS, ScriptedModel, ServedBundle, delay, error, text

pytest_plugins = ["test_support.pytest_plugin"]

KEY = "sk-test-7f3a9c"
HAPPY = ("played", "two_turns", "adds_a_crate", "reply_only")


def _turn_of(headers: Mapping[str, str], body: Any) -> str:
    """A request's session: its chat's first prompt and how many replies it holds, so every sample of a task walks
    the same script whatever order the episodes run in."""
    messages = body.get("messages") or [] if isinstance(body, dict) else []
    prompt = next((message["content"] for message in messages if message.get("role") == "user"), "")
    return f"{prompt}#{sum(message.get('role') == 'assistant' for message in messages)}"


@pytest.fixture
def model() -> Any:
    with ScriptedModel(session_of=_turn_of) as served:
        served.script([text("OK")] * 20)
        yield served


@pytest.fixture(scope="module")
def rows(sample_env_server: ServedBundle, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sample") / "rows"
    asyncio.run(write_rows(sample_env_server.url, out, progress=False))
    return out


def _prompts(rows: Path) -> dict[str, str]:
    lines = (rows / "all.jsonl").read_text().splitlines()
    return {row["metadata"]["episode"]["task_name"]: row["messages"][-1]["content"] for row in map(json.loads, lines)}


def _script(model: ScriptedModel, rows: Path, scripts: Mapping[str, Any] = SCRIPTS, repeat: int = 20) -> None:
    """Give every sample of each task of ``rows`` the steps ``scripts`` has for it, one per reply."""
    for task, prompt in _prompts(rows).items():
        for position, step in enumerate(scripts.get(task, ())):
            model.script([step] * repeat, session=f"{prompt}#{position}")


def _only(rows: Path, where: Path, *tasks: str) -> Path:
    """A rows file holding only the rows of ``tasks`` of the split ``all``."""
    where.mkdir(exist_ok=True)
    lines = [
        line
        for line in (rows / "all.jsonl").read_text().splitlines()
        if json.loads(line)["metadata"]["episode"]["task_name"] in tasks
    ]
    (where / "all.jsonl").write_text("\n".join(lines) + "\n")
    return where / "all.jsonl"


def _args(rows: Path, model: ScriptedModel, out: Path, *more: str) -> list[str]:
    return [str(rows), "--model-url", model.base_url, "--model", "policy", "--out", str(out), *more]


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]


def test_a_run_records_every_episode_and_summarizes_each_split(
    sample_env: ServedBundle, rows: Path, model: ScriptedModel, tmp_path: Path, capsys, monkeypatch
) -> None:
    _script(model, rows)
    monkeypatch.setenv("EVAL_KEY", KEY)

    options = [
        "--samples",
        "2",
        "--api-key-env",
        "EVAL_KEY",
        "--concurrency",
        "4",
        "--sampling",
        '{"temperature": 0.5}',
    ]
    code = main(_args(rows, model, tmp_path / "run", *options, "--chat-template-kwargs", '{"enable_thinking": false}'))

    shown = capsys.readouterr()
    assert code == 0, shown.err
    records = _records(tmp_path / "run")
    assert sorted((r["split"], r["task"], r["sample"]) for r in records) == sorted(
        [("all", task, sample) for task in SCRIPTS for sample in (0, 1)]
        + [("happy", task, sample) for task in HAPPY for sample in (0, 1)]
    )
    for record in records:
        outcome = EpisodeOutcome.from_metadata(record)
        assert outcome.reward == REWARDS[record["task"]], record
        assert record["model"] == "policy" and record["transcript"][-1]["role"] == "assistant"
    failed = [r for r in records if r["task"] == "fails_after_the_turn"]
    assert all(r[OUTCOME_KEY]["reason"] == "env_failed" for r in failed)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    everything = summary["splits"]["all"]
    assert everything["episodes"] == 12 and everything["reward_mean"] == pytest.approx(0.8)
    assert (everything["pass@1"], everything["pass@2"]) == (pytest.approx(0.8), pytest.approx(0.8))
    assert everything["unscored"] == {"env_failed": 2} and everything["zero_reward_share"] == pytest.approx(0.2)
    assert everything["turns_p50"] == 1 and everything["turns_p90"] == 2
    assert everything["tasks"]["scores_zero"]["reward_mean"] == 0.0
    assert "reward_mean" not in everything["tasks"]["fails_after_the_turn"]
    happy = summary["splits"]["happy"]
    assert (happy["episodes"], happy["reward_mean"], happy["pass@2"], happy["unscored"]) == (8, 1.0, 1.0, {})
    assert "split all: 12 episodes, reward 0.800 ± " in shown.out and "pass@2 0.800" in shown.out
    assert "unscored: env_failed 2" in shown.out
    assert {request.headers.get("authorization") for request in model.requests} == {f"Bearer {KEY}"}
    assert {request.body.get("model") for request in model.requests} == {"policy"}
    assert all(request.body["temperature"] == 0.5 for request in model.requests)
    assert all(request.body["chat_template_kwargs"] == {"enable_thinking": False} for request in model.requests)
    assert model.requests[0].body["max_tokens"] == 1 and "max_tokens" not in model.requests[-1].body
    for file in (tmp_path / "run").iterdir():
        assert KEY not in file.read_text()
    assert KEY not in shown.out + shown.err


def test_pass_at_k_is_the_unbiased_estimate_over_scored_episodes() -> None:
    def outcome(reward: float | None) -> EpisodeOutcome:
        return EpisodeOutcome(
            reward,
            reward is not None,
            None if reward is not None else "session_failed",
            (),
            1,
            1,
            0,
            0,
            0.0,
            0.0,
            0.0,
            0.0,
            False,
            None,
        )

    row = [outcome(1.0), outcome(0.0), outcome(0.0), outcome(None)]

    assert pass_at_k([row], 1) == pytest.approx(1 / 3)
    assert pass_at_k([row], 2) == pytest.approx(1 - 1 / 3)
    assert pass_at_k([row], 3) == 1.0
    assert pass_at_k([row], 4) is None
    assert pass_at_k([row, [outcome(0.0)] * 3], 1) == pytest.approx(1 / 6)


@pytest.mark.parametrize(("status", "body", "says"), [
    (401, {"error": {"message": "Incorrect API key provided"}}, "Incorrect API key provided"),
    (403, "Forbidden:\n  this key can't use the model", "Forbidden: this key can't use the model"),
    (404, {"error": {"message": "The model `policy` does not exist"}}, "The model `policy` does not exist"),
])  # fmt: skip
def test_a_wrong_key_or_model_stops_the_run_before_any_episode(
    rows: Path, model: ScriptedModel, tmp_path: Path, capsys, status: int, body: Any, says: str
) -> None:
    model.script([error(status, body)])

    code = main(_args(rows, model, tmp_path / "run"))

    err = capsys.readouterr().err
    assert code == 1 and f"HTTP {status}" in err and says in err and err.count("\n") == 1
    assert len(model.requests) == 1 and not (tmp_path / "run" / "episodes.jsonl").exists()


def test_the_pre_flight_limits_the_reply_by_the_token_limit_the_sampling_names(
    rows: Path, model: ScriptedModel, tmp_path: Path
) -> None:
    # Newer hosted models refuse max_tokens beside max_completion_tokens; the pre-flight must send what the run does.
    model.script([error(404)])

    main(_args(rows, model, tmp_path / "run", "--sampling", '{"max_completion_tokens": 256}'))

    (preflight,) = model.requests
    assert preflight.body["max_completion_tokens"] == 1 and "max_tokens" not in preflight.body


def test_resuming_a_folder_of_another_models_episodes_is_refused(
    sample_env: ServedBundle, rows: Path, model: ScriptedModel, tmp_path: Path, capsys
) -> None:
    # Their rewards would be summed into this model's summary as if it had played them.
    one = _only(rows, tmp_path / "rows", "reply_only")
    model.script([text("A banana.")] * 2, session=f"{_prompts(rows)['reply_only']}#0")
    assert main(_args(one, model, tmp_path / "run")) == 0
    before = _records(tmp_path / "run")
    capsys.readouterr()

    other = [str(one), "--model-url", model.base_url, "--model", "other", "--out", str(tmp_path / "run"), "--resume"]
    assert main(other) == 1

    err = capsys.readouterr().err
    assert "holds episodes of model policy, not 'other'" in err and err.count("\n") == 1
    assert _records(tmp_path / "run") == before


def test_an_endpoint_refusing_connections_stops_the_run(rows: Path, tmp_path: Path, capsys) -> None:
    code = main(
        [str(rows), "--model-url", "http://127.0.0.1:1/v1", "--model", "policy", "--out", str(tmp_path / "run")]
    )

    err = capsys.readouterr().err
    assert code == 1 and "can't be reached: 127.0.0.1:1 refused the connection" in err and err.count("\n") == 1


def test_an_overloaded_model_is_retried_and_one_that_stays_so_is_flagged(
    sample_env: ServedBundle, rows: Path, model: ScriptedModel, tmp_path: Path, capsys
) -> None:
    prompt = _prompts(rows)["reply_only"]
    model.script([error(503, headers={"Retry-After": "0.3"}), text("A banana.")], session=f"{prompt}#0")
    one = _only(rows, tmp_path / "rows", "reply_only")

    assert main(_args(one, model, tmp_path / "recovers")) == 0
    (record,) = _records(tmp_path / "recovers")
    outcome = EpisodeOutcome.from_metadata(record)
    assert (outcome.reward, outcome.model_retries) == (1.0, 1) and outcome.model_s >= 0.3

    model.script([error(429)] * 50, session=f"{prompt}#0")
    began = time.monotonic()
    assert main(_args(one, model, tmp_path / "stays", "--model-deadline", "2")) == 0
    (record,) = _records(tmp_path / "stays")
    assert (
        record[OUTCOME_KEY]["reason"] == "session_failed" and "HTTP 429" in record[OUTCOME_KEY]["flags"][0]["message"]
    )
    assert record[OUTCOME_KEY]["model_retries"] >= 1 and time.monotonic() - began < 15
    assert "unscored: session_failed 1" in capsys.readouterr().out


def test_a_killed_run_resumed_plays_every_episode_once(
    sample_env: ServedBundle, rows: Path, model: ScriptedModel, tmp_path: Path, capsys
) -> None:
    _script(model, rows, {task: [delay(0.3, step) for step in steps] for task, steps in SCRIPTS.items()}, repeat=50)
    out = tmp_path / "run"
    args = _args(
        _only(rows, tmp_path / "rows", "reply_only", "scores_zero"), model, out, "--samples", "3", "--concurrency", "2"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen([sys.executable, "-m", "chat_core.evaluate", *args], env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not ((out / "episodes.jsonl").exists() and len(_records(out)) >= 2):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
    assert len(_records(out)) < 6
    sample_env.wait_until_closed()
    with open(out / "episodes.jsonl", "a") as file:
        file.write('{"split": "all", "row": 0, "sample"')

    assert main(args) == 1
    assert "already holds files" in capsys.readouterr().err
    assert main([*args, "--resume"]) == 0

    keys = [(r["split"], r["row"], r["sample"]) for r in _records(out)]
    assert len(keys) == len(set(keys)) == 6
    assert json.loads((out / "summary.json").read_text())["splits"]["all"]["episodes"] == 6


def test_compare_prints_the_change_per_split_and_task(
    sample_env: ServedBundle, rows: Path, model: ScriptedModel, tmp_path: Path, capsys
) -> None:
    one = _only(rows, tmp_path / "rows", "reply_only")
    prompt = _prompts(rows)["reply_only"]
    model.script([text("A banana.")] * 5, session=f"{prompt}#0")
    assert main(_args(one, model, tmp_path / "step0", "--samples", "2")) == 0
    model.script([text("A cherry.")] * 5, session=f"{prompt}#0")
    capsys.readouterr()

    assert main(_args(one, model, tmp_path / "step100", "--samples", "2", "--compare", str(tmp_path / "step0"))) == 0

    shown = capsys.readouterr().out
    assert "split all: 1.000 → 0.000: -1.000 ± 0.000" in shown
    assert "  reply_only: 1.000 → 0.000: -1.000 ± 0.000" in shown


CONTEXT_FULL = {"object": "error", "message": "The input (8200 tokens) is longer than the model's context length "
                "(8192 tokens).", "type": "BadRequest", "param": None, "code": 400}  # fmt: skip
"""What SGLang's OpenAI server answers, with HTTP 400, a prompt too long for the model's context."""


def test_episodes_cut_short_are_unscored_or_scored_as_they_stand_and_long_tool_answers_cut(
    sample_env: ServedBundle, rows: Path, model: ScriptedModel, tmp_path: Path, capsys
) -> None:
    cut_short = {
        "played": [SCRIPTS["played"][0], error(400, CONTEXT_FULL)],
        "reply_only": [text("A banana, which is long and", finish_reason="length")],
    }
    _script(model, rows, cut_short)
    two = _only(rows, tmp_path / "rows", "played", "reply_only")

    assert main(_args(two, model, tmp_path / "left-out")) == 0
    assert main(_args(two, model, tmp_path / "scored", "--score-cut-short")) == 0
    assert main(_args(two, model, tmp_path / "played-on", "--play-on-cut-reply", "--max-tool-answer-chars", "12")) == 0

    shown = capsys.readouterr().out
    left_out = {r["task"]: EpisodeOutcome.from_metadata(r) for r in _records(tmp_path / "left-out")}
    assert {task: outcome.reason for task, outcome in left_out.items()} == {
        "played": "context_exhausted",
        "reply_only": "response_limit",
    }
    assert "unscored: context_exhausted 1, response_limit 1" in shown
    assert "cut short: full context 50.0%, cut reply 50.0%; tool answers cut 0 per episode" in shown
    scored = {r["task"]: EpisodeOutcome.from_metadata(r) for r in _records(tmp_path / "scored")}
    assert {task: (outcome.reward, outcome.flags[0].kind) for task, outcome in scored.items()} == {
        "played": (0.0, "context_exhausted"),
        "reply_only": (1.0, "response_limit"),
    }
    played_on = {r["task"]: r for r in _records(tmp_path / "played-on")}
    reply_only = EpisodeOutcome.from_metadata(played_on["reply_only"])
    assert (reply_only.reward, [flag.kind for flag in reply_only.flags]) == (1.0, ["reply_truncated"])
    cut_answer = played_on["played"]["transcript"][3]["content"]
    assert cut_answer == "The crate 'p\n[the tool's answer is cut here: 21 more characters, past the 12 shown]"
    summary = json.loads((tmp_path / "played-on" / "summary.json").read_text())["splits"]["all"]
    assert summary["tool_answers_cut_mean"] == 0.5 and summary["tool_answer_bytes_cut_mean"] == 10.5
