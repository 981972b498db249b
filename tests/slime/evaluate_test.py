"""``python -m chat_core.evaluate`` against slime's real ``OpenAIAdapter``, built as the slime tier builds it (slime's
launch flags through ``AdapterService``), over the stand-in for SGLang's ``/generate`` and agent-env's real env
server: what a person evaluating through slime's adapter reads, and the adapter really serving every turn.

evaluate names no session, so all its episodes share the adapter's ``"default"`` session and reach SGLang without a
routing key; the test plays them several at once to see that they don't get in each other's way there. Thinking is
off through slime's own ``--apply-chat-template-kwargs``, as in the rest of the tier: slime's adapter renders the chat
itself and reads no ``chat_template_kwargs`` from a request, so evaluate's ``--chat-template-kwargs`` changes nothing
behind it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from chat_core.record.outcome import EpisodeOutcome
from sglang_stand_in import by_task
from slime_helper import AdapterService
from test_support import REWARDS, SCRIPTS, delay, text
from test_support.script import Reply, Step

SAMPLES = 2
CONCURRENCY = 4
REPLY_DELAY_S = 0.2
"""How long the stand-in takes over each reply, so that the episodes evaluate plays at once are in the adapter
together."""
THINKING_OFF_PROMPT_END = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
STOP_TOKEN = "<|im_end|>"
"""Qwen3's stop token, which slime's adapter leaves at the end of a text reply's content: it asks SGLang not to trim
it and decodes the reply with the special tokens kept."""


class Overlap:
    """A stand-in's ``sleep`` that also counts the replies waiting at once, and the most it has seen."""

    def __init__(self, sleep: Callable[[float], object]):
        self._sleep = sleep
        self._lock = threading.Lock()
        self._waiting = 0
        self.most = 0

    def __call__(self, seconds: float) -> None:
        with self._lock:
            self._waiting += 1
            self.most = max(self.most, self._waiting)
        try:
            self._sleep(seconds)
        finally:
            with self._lock:
                self._waiting -= 1


def slow_task_scripts(served) -> Callable[[str], Sequence[Step]]:
    """Each task's test_support script with every reply delayed by ``REPLY_DELAY_S``, and a one-word reply for the
    one chat that is no task's: evaluate's pre-flight request."""
    scripts = by_task(served)

    def script_of(prompt: str) -> Sequence[Step]:
        try:
            steps = scripts(prompt)
        except LookupError:
            return [text("OK")]
        return [delay(REPLY_DELAY_S, step) for step in steps]

    return script_of


def said(transcript: list[dict[str, Any]]) -> list[Any]:
    """What the model said in an episode, a reply at a time: its tool call's name and arguments, or its text."""
    replies = []
    for message in transcript:
        if message["role"] != "assistant":
            continue
        if calls := message.get("tool_calls"):
            [call] = calls
            replies.append((call["function"]["name"], json.loads(call["function"]["arguments"])))
        else:
            replies.append(message["content"])
    return replies


def scripted(steps: Sequence[Reply]) -> list[Any]:
    """What ``said`` reads from an episode whose model, behind slime's adapter, replied with ``steps``."""
    return [
        (step.tool_calls[0].name, json.loads(step.tool_calls[0].arguments))
        if step.tool_calls
        else step.content + STOP_TOKEN
        for step in steps
    ]


def row_tasks(rows: Path) -> dict[str, list[str]]:
    """Each split of the rows folder and the task of each of its rows, in order."""
    return {
        file.stem: [json.loads(line)["metadata"]["episode"]["task_name"] for line in file.read_text().splitlines()]
        for file in sorted(rows.glob("*.jsonl"))
    }


def test_evaluate_through_slimes_adapter_scores_every_episode_as_the_env_server_does(
    launch, sglang, env_server, rows, tokenizer, tmp_path, monkeypatch
):
    args = launch(thinking=False)
    adapter = AdapterService.of(args)
    sglang.script_of = slow_task_scripts(env_server)
    monkeypatch.setattr(sglang, "sleep", overlap := Overlap(sglang.sleep))
    before = len(sglang.requests)
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "chat_core.evaluate", str(rows),
        "--model-url", adapter.chat_url.removesuffix("/chat/completions"),
        "--model", Path(args.hf_checkpoint).name,
        "--out", str(out),
        "--samples", str(SAMPLES),
        "--concurrency", str(CONCURRENCY),
        "--sampling", '{"temperature": 0.5}',
    ]  # fmt: skip

    done = subprocess.run(
        command,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    tasks = row_tasks(rows)
    assert Counter((r["split"], r["row"], r["task"], r["sample"]) for r in records) == Counter(
        (split, row, task, sample)
        for split, names in tasks.items()
        for row, task in enumerate(names)
        for sample in range(SAMPLES)
    )
    assert max(Counter((r["split"], r["row"], r["sample"]) for r in records).values()) == 1
    for record in records:
        outcome = EpisodeOutcome.from_metadata(record)
        assert outcome.reward == REWARDS[record["task"]], record
        assert said(record["transcript"]) == scripted(SCRIPTS[record["task"]]), record
        if record["task"] == "fails_after_the_turn":
            assert not outcome.scored and [str(flag.kind) for flag in outcome.flags] == ["env_failed"]
        else:
            assert outcome.scored and outcome.flags == ()

    summary = json.loads((out / "summary.json").read_text())
    everything, happy = summary["splits"]["all"], summary["splits"]["happy"]
    assert everything["episodes"] == len(tasks["all"]) * SAMPLES == 12
    assert everything["reward_mean"] == pytest.approx(0.8)
    assert (everything["pass@1"], everything["pass@2"]) == (pytest.approx(0.8), pytest.approx(0.8))
    assert everything["unscored"] == {"env_failed": 2}
    assert everything["tasks"]["scores_zero"]["reward_mean"] == 0.0
    assert "reward_mean" not in everything["tasks"]["fails_after_the_turn"]
    assert (happy["episodes"], happy["reward_mean"], happy["pass@1"], happy["pass@2"]) == (8, 1.0, 1.0, 1.0)
    assert happy["unscored"] == {}
    assert "split all: 12 episodes, reward 0.800 ± " in done.stdout
    assert "split happy: 8 episodes, reward 1.000 ± " in done.stdout

    generated = sglang.requests[before:]
    prompts = [tokenizer.decode(request["input_ids"]) for request in generated]
    task_prompts = [task["prompt"] for task in env_server.tasks()]
    no_task = [
        request
        for request, prompt in zip(generated, prompts, strict=True)
        if not any(task_prompt in prompt for task_prompt in task_prompts)
    ]
    assert [request["sampling_params"]["max_new_tokens"] for request in no_task] == [1]
    model_calls = sum(EpisodeOutcome.from_metadata(record).model_calls for record in records)
    assert len(generated) == model_calls + 1 == adapter.adapter.manager.turn_count("default")
    assert {request["routing_key"] for request in generated} == {""}
    assert set(adapter.adapter.store) == {"default"}
    assert all(prompt.endswith(THINKING_OFF_PROMPT_END) for prompt in prompts)
    assert all(request["sampling_params"]["temperature"] == 0.5 for request in generated)
    assert overlap.most >= 2


def _evaluate(adapter: AdapterService, args: Any, rows: Path, out: Path, *options: str) -> subprocess.CompletedProcess:
    """``python -m chat_core.evaluate`` on ``rows`` through ``adapter``, into ``out``."""
    command = [
        sys.executable, "-m", "chat_core.evaluate", str(rows),
        "--model-url", adapter.chat_url.removesuffix("/chat/completions"),
        "--model", Path(args.hf_checkpoint).name,
        "--out", str(out),
        *options,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_evaluate_through_slimes_adapter_ends_episodes_at_a_full_context_and_a_cut_reply(
    launch, sglang, env_server, rows, tokenizer, tmp_path
):
    """``played``'s second prompt fills the adapter's ``--rollout-max-context-len``, and ``reply_only``'s reply runs
    past the ``max_tokens`` evaluate sends."""
    scripts = slow_task_scripts(env_server)
    sglang.script_of = lambda prompt: [text("A banana, " * 60)] if "yellow fruit" in prompt else scripts(prompt)
    two = tmp_path / "rows"
    two.mkdir()
    (two / "all.jsonl").write_text(
        "".join(
            line + "\n"
            for line in (rows / "all.jsonl").read_text().splitlines()
            if json.loads(line)["metadata"]["episode"]["task_name"] in ("played", "reply_only")
        )
    )
    cut_at = '{"max_tokens": 40}'
    args = launch(thinking=False)
    assert _evaluate(AdapterService.of(args), args, two, tmp_path / "whole", "--sampling", cut_at).returncode == 0
    [second] = [request for request in sglang.requests if "pears" in tokenizer.decode(request["input_ids"])][1:]
    full = len(second["input_ids"])
    AdapterService.reset()
    sglang.clear()
    filled = launch(thinking=False, extra=("--rollout-max-context-len", str(full)))

    done = _evaluate(AdapterService.of(filled), filled, two, tmp_path / "run", "--sampling", cut_at)

    assert done.returncode == 0, done.stderr
    records = {record["task"]: record for record in map(json.loads, (tmp_path / "run" / "episodes.jsonl").open())}
    played, reply_only = (EpisodeOutcome.from_metadata(records[task]) for task in ("played", "reply_only"))
    assert (played.reason, played.model_calls, played.tool_calls) == ("context_exhausted", 1, 1)
    assert f"this turn's prompt is {full} tokens" in played.flags[0].message
    assert (reply_only.reason, reply_only.model_calls, reply_only.truncated) == ("response_limit", 1, True)
    assert [len(request["input_ids"]) < full for request in sglang.requests] == [True] * 3
    assert "cut short: full context 50.0%, cut reply 50.0%" in done.stdout
