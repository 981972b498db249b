"""Per-episode metrics in Miles' own tracking: a train rollout through Miles' agentic path, its samples as Miles'
rollout manager hands them to ``log_rollout_data`` and ``log_eval_rollout_data``, which call
``miles_helper.log_rollout`` and ``miles_helper.log_eval_rollout``; TensorBoard is Miles' backend, and the values
are read back from its event files."""

from __future__ import annotations

from pathlib import Path

import pytest
from miles.ray.rollout.metrics import log_eval_rollout_data, log_rollout_data
from miles.ray.rollout.rollout_data_conversion import postprocess_rollout_data
from miles.utils.tracking_utils import tracking
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_support import text

TASKS = ["two_turns", "played", "reply_only", "scores_zero"]


def test_a_rollout_and_an_eval_log_metrics_per_episode_beside_miles_own(miles, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path))
    args = miles.args(
        TASKS,
        extra=[
            "--n-samples-per-prompt", "2", "--rollout-batch-size", "4", "--global-batch-size", "8",
            "--use-tensorboard",
            "--custom-rollout-log-function-path", "miles_helper.log_rollout",
            "--custom-eval-rollout-log-function-path", "miles_helper.log_eval_rollout",
        ],
    )  # fmt: skip
    miles.chat.take_turns(miles.prompt("reply_only"), [text("A banana."), text("A cherry.")])
    output = miles.rollout(args)
    data, _ = postprocess_rollout_data(args, output.samples, {"dp_size": 1})

    tracking.init_tracking(args)
    try:
        log_rollout_data(2, args, data, output.metrics, 9.0)
        log_eval_rollout_data(2, args, {"happy": {"rewards": [s.reward for s in data], "samples": data}}, None)
    finally:
        tracking.finish_tracking()

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    for prefix in ("rollout/episode/", "eval/happy/episode/"):
        assert scalars[prefix + "episodes"] == [(2, 8.0)]
        assert scalars[prefix + "reward_mean"] == [(2, pytest.approx(5 / 8))]
        assert scalars[prefix + "zero_reward_share"] == [(2, pytest.approx(3 / 8))]
        assert scalars[prefix + "samples_per_episode"] == [(2, 1.0)]
        assert scalars[prefix + "turns_p90"] == [(2, 2.0)]
        assert scalars[prefix + "tool_calls_mean"] == [(2, pytest.approx(2 / 8))]
    assert scalars["eval/happy"] == [(2, pytest.approx(5 / 8))]
    assert "rollout/response_len/mean" in scalars
