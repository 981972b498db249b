"""Episodes seen where slime users look: per-episode metrics through slime's own ``log_rollout_data`` and
``log_eval_rollout_data`` with TensorBoard as slime's logging backend, read back from the event files; and the
episode's spans on the samples, dumped by slime's ``save_debug_rollout_data`` and drawn by slime's
``tools/trace_timeline_viewer.py``, with a screenshot of the page in headless Chromium kept as a test output."""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pins
import pytest
from chat_core import EpisodeOutcome
from launch import EVAL_SPLIT
from PIL import Image
from rollout import SAMPLE_PER_TURN, first_hits_then_misses, on_slime_loop, played_batch
from slime.observability.rollout_data_utils import save_debug_rollout_data
from slime.observability.rollout_metrics import log_eval_rollout_data, log_rollout_data
from slime.observability.tensorboard_utils import _TensorboardAdapter
from slime.rollout.sglang_rollout import eval_rollout_single_dataset
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_support import error

SPANS = ["episode/reset", "episode/list_tools", "episode/model_call", "episode/tool_call", "episode/end_turn"]


@pytest.fixture(scope="module")
def tensorboard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder slime's TensorBoard backend writes to (slime makes one writer per process)."""
    folder = tmp_path_factory.mktemp("tensorboard")
    os.environ["TENSORBOARD_DIR"] = str(folder)
    return folder


def logging_launch(launch, **kwargs):
    args = copy.copy(launch(**kwargs))
    args.custom_rollout_log_function_path = "slime_helper.log_rollout"
    args.custom_eval_rollout_log_function_path = "slime_helper.log_eval_rollout"
    args.use_tensorboard = True
    args.use_wandb = False
    return args


def logged(args, folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in ``folder``'s event files, once slime's writer has flushed: tag → ``(step, value)`` in order."""
    _TensorboardAdapter(args)._writer.flush()
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_rollout_step_logs_metrics_per_episode_beside_slimes_own(launch, sglang, env_server, tensorboard):
    args = logging_launch(launch, thinking=False, config=SAMPLE_PER_TURN)
    sglang.script_of = first_hits_then_misses(env_server)
    samples = played_batch(args)

    log_rollout_data(3, args, samples, {"rollout/dynamic_filter/drop_env_failed": 1}, 12.5)

    scalars = logged(args, tensorboard)
    assert scalars["rollout/episode/episodes"] == [(3, 8.0)]
    assert scalars["rollout/episode/samples_per_episode"] == [(3, pytest.approx(11 / 8))]
    assert scalars["rollout/episode/reward_mean"] == [(3, pytest.approx(0.5))]
    assert scalars["rollout/episode/reward_se"] == [(3, pytest.approx((2 / 7) ** 0.5 / 8**0.5, rel=1e-5))]
    assert scalars["rollout/episode/zero_reward_share"] == [(3, pytest.approx(0.5))]
    assert scalars["rollout/episode/turns_p90"] == [(3, 2.0)]
    assert scalars["rollout/episode/tool_calls_mean"] == [(3, pytest.approx(1 / 8))]
    assert scalars["rollout/episode/env_s_mean"][0][1] > 0
    per_sample = sum(sample.reward for sample in samples) / len(samples)
    assert per_sample == pytest.approx(6 / 11)
    assert scalars["rollout/dynamic_filter/drop_env_failed"] == [(3, 1.0)]
    assert "rollout/response_len/mean" in scalars


def test_an_eval_logs_each_split_per_episode_with_its_unscored_share_by_kind(launch, sglang, env_server, tensorboard):
    args = logging_launch(launch)
    failing = {task["prompt"] for task in env_server.tasks() if task["name"] == "reply_only"}
    scripted = sglang.script_of
    sglang.script_of = lambda prompt: [error(500)] if any(p in prompt for p in failing) else scripted(prompt)
    [dataset] = [config for config in args.eval_datasets if config.name == EVAL_SPLIT]

    evaluated = on_slime_loop(eval_rollout_single_dataset(args, 0, dataset))
    log_eval_rollout_data(4, args, evaluated, None)

    samples = evaluated[EVAL_SPLIT]["samples"]
    unscored = [s for s in samples if not EpisodeOutcome.from_metadata(s.metadata).scored]
    assert 0 < len(unscored) < len(samples)
    scalars = logged(args, tensorboard)
    prefix = f"eval/{EVAL_SPLIT}/episode/"
    assert scalars[prefix + "episodes"] == [(4, float(len(samples)))]
    assert scalars[prefix + "unscored_share/session_failed"] == [(4, pytest.approx(len(unscored) / len(samples)))]
    assert scalars[prefix + "reward_mean"] == [(4, 1.0)]
    assert scalars[f"eval/{EVAL_SPLIT}"] == [(4, pytest.approx(1 - len(unscored) / len(samples)))]


def test_slimes_trace_viewer_draws_each_episodes_spans(launch, sglang, env_server, tmp_path):
    args = launch(thinking=False)
    samples = played_batch(args, ["played", "two_turns"])
    dump = tmp_path / "rollout_{rollout_id}.pt"

    save_debug_rollout_data(str(dump), samples, rollout_id=0, evaluation=False)

    for sample in samples:
        names = [event["name"] for event in sample.trace["events"] if event["type"] == "span_start"]
        outcome = EpisodeOutcome.from_metadata(sample.metadata)
        assert names.count("episode/end_turn") == outcome.turns
        assert names.count("episode/model_call") == outcome.model_calls
        assert names.count("episode/tool_call") == outcome.tool_calls
        assert {"generate_and_rm", "episode/reset", "episode/list_tools"} <= set(names)
    viewer = pins.path_of("slime") / "tools" / "trace_timeline_viewer.py"
    subprocess.run([sys.executable, str(viewer), str(tmp_path / "rollout_0.pt"), "--no-serve"], check=True)
    page = tmp_path / "rollout_0.trace_timeline_viewer.html"
    cache = json.loads((tmp_path / "rollout_0.trace_timeline_cache.json").read_text())
    assert all(name in json.dumps(cache) for name in SPANS)
    outputs = Path(os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR", tmp_path))
    shot = _screenshot(page, outputs / "trace_viewer.png", tmp_path / "chromium-profile")
    assert _share_of_strong_colour(shot) > 0.01, "the viewer drew no spans"


def _share_of_strong_colour(png: Path) -> float:
    """The share of the picture's pixels in a strong colour: the viewer's span bars, on its pale page."""
    pixels = np.asarray(Image.open(png).convert("RGB"), dtype=np.int16)
    return float(((pixels.max(axis=-1) - pixels.min(axis=-1)) > 80).mean())


def _screenshot(page: Path, to: Path, profile: Path) -> Path:
    """``page`` rendered by headless Chromium into the PNG ``to``, served over loopback HTTP as the viewer's own
    ``--serve`` does, since the page fetches its cache beside it."""
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(page.parent))
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            return _rendered(f"http://127.0.0.1:{server.server_address[1]}/{page.name}", to, profile)
        finally:
            server.shutdown()


def _rendered(url: str, to: Path, profile: Path) -> Path:
    chromium = shutil.which("chromium")
    assert chromium, "the trace viewer check needs Debian's chromium (./bazelw installs it)"
    subprocess.run(
        [
            chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", "--window-size=1600,1000",
            "--virtual-time-budget=5000", f"--screenshot={to}", url,
        ],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return to
