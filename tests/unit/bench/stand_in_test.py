"""The benchmark's stand-ins are honest: the stand-in env server plays the recorded episode exactly as agent-env's
real server plays it (the same rows, the same chat, the same reward), and the benchmark runs, on a few episodes."""

from __future__ import annotations

import asyncio

import episode_overhead_bench as bench
import pytest
import stand_in
from chat_core import ChatEndpoint, EpisodeResult, Limits, play
from test_support import serve_bundle


def _played(rows: list[dict], model_url: str) -> EpisodeResult:
    (metadata,) = rows
    return asyncio.run(play(metadata, ChatEndpoint(model_url + "/v1/chat/completions", "bench"), {}, Limits()))


def test_the_stand_in_scores_an_episode_like_the_real_server() -> None:
    with (
        serve_bundle(bench.BUNDLE) as real,
        stand_in.served("env", str(stand_in.FRAMES)) as fake_url,
        stand_in.served("model") as model_url,
    ):
        real_rows, _ = bench.rows_of(real.url)
        fake_rows, _ = bench.rows_of(fake_url)
        on_real, on_fake = _played(real_rows, model_url), _played(fake_rows, model_url)

    for row in (*real_rows, *fake_rows):
        del row["server"]["url"]
    assert fake_rows == real_rows
    assert on_real.scored and on_real.reward == 1.0
    assert (on_fake.reward, on_fake.flags, on_fake.transcript) == (on_real.reward, on_real.flags, on_real.transcript)
    assert on_fake.turns == on_real.turns
    assert [(turn.model_calls, turn.tool_calls) for turn in on_fake.turns] == [(2, 3), (2, 3)]


def test_the_benchmark_runs_on_a_few_episodes(capsys: pytest.CaptureFixture[str]) -> None:
    bench.main(["--smoke"])

    printed = capsys.readouterr().out
    for title in ("driver's own CPU per model turn", "model turns", "prepare from a stand-in"):
        assert title in printed
