"""The shipped wheels in Miles' environment, installed as a user installs them into Miles' image: ``pip install
chat-core[miles]`` adds ``chat_core`` and ``miles_helper`` to a copy of the Miles environment and moves none of its
packages, Miles' own loader finds the agent, its abort hook, the reward and the filter in the installed wheels
without pulling in anything of the env server or of the tests, and the GPU command (``tests/gpu/run.py miles``) runs
from them up to the Ray job it submits.

The copy is a hard-link copy of the environment this test runs in, removed afterwards; the environment itself is
checked unchanged at the end. Bazel names the wheels in ``WHEELS``; by hand, build them with
``bazel build //packages:wheels`` and name them there.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_support import serve_bundle
from test_support.checkpoint import weightless_checkpoint
from test_support.trainer_env import Installed, installed_copy, recording_command, wheels_from

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "tests" / "gpu"
sys.path.insert(0, str(GPU))

from launches import QWEN3_4B_CONFIG, Run, eval_splits, miles_args  # noqa: E402

PINNED = ("torch", "transformers", "sglang", "openai")
FUNCTIONS = {
    "miles_helper.agent.run": "miles_helper.agent.make_agent.<locals>.agent",
    "miles_helper.agent.abort": "miles_helper.agent.abort",
    "miles_helper.reward": "miles_helper.scoring.reward",
    "miles_helper.keep_scored_groups": "miles_helper.scoring.keep_scored_groups",
}
NOT_SHIPPED = {"test_support", "agent_env", "openenv", "pytest"}
GPUS = 4


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    wheels = wheels_from(os.environ.get("WHEELS", ""), ["chat_core", "miles_helper", "slime_helper"])
    folder = tmp_path_factory.mktemp("miles") / "env"
    with installed_copy(Path(sys.prefix), folder, wheels, "chat-core[miles]") as installed:
        yield installed


def test_the_miles_extra_adds_chat_core_and_miles_helper_only_and_moves_none_of_miles_packages(installed):
    assert set(installed.after) - set(installed.before) == {"chat-core", "miles-helper"}
    assert {name: installed.after[name] for name in installed.before} == installed.before
    assert all(name in installed.before for name in PINNED)


def test_the_wheels_need_only_chat_core_and_what_it_talks_to_the_env_server_with(installed):
    assert installed.env.requirements(["chat-core", "miles-helper"]) == {
        "chat-core": [
            "httpx>=0.27",
            'miles-helper==0.1.0; extra == "miles"',
            'slime-helper==0.1.0; extra == "slime"',
            "tqdm>=4.66",
            "websockets>=13",
        ],
        "miles-helper": ["chat-core==0.1.0"],
    }


def test_miles_loader_finds_the_agent_abort_reward_and_filter_in_the_installed_wheels(installed):
    loaded = installed.env.load("miles.utils.misc", FUNCTIONS, ["chat_core", "miles_helper"])

    assert loaded["functions"] == FUNCTIONS
    site_packages = installed.env.site_packages()
    assert all(Path(file).is_relative_to(site_packages) for file in loaded["files"].values()), loaded["files"]
    assert NOT_SHIPPED.isdisjoint(loaded["modules"])


def test_the_gpu_command_writes_the_rows_and_submits_miles_train_py_with_the_launch_arguments(
    installed, tmp_path: Path
):
    model = weightless_checkpoint(tmp_path / "Qwen3-4B", QWEN3_4B_CONFIG).resolve()
    ray = recording_command(tmp_path, "ray")
    out = tmp_path / "run"
    ours = ["--model", str(model), "--gpus", str(GPUS), "--out", str(out), "--trainer-dir", "/opt/miles"]
    with serve_bundle(python=os.environ.get("ENV_SERVER_PYTHON") or REPO / ".venv" / "bin" / "python") as served:
        installed.env.run(
            str(GPU / "run.py"), "miles", *ours, "--bundle-url", served.url,
            env={"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"},
        )  # fmt: skip

    start, submit, stop = ray()
    assert start[:2] == ["start", "--head"] and start[start.index("--num-gpus") + 1] == str(GPUS)
    job, train = submit[: submit.index("--")], submit[submit.index("--") + 1 :]
    assert json.loads(job[job.index("--runtime-env-json") + 1])["env_vars"]["PYTHONPATH"] == str(GPU.resolve())
    run = Run(model=model, folder=out, gpus=GPUS)
    assert train == [str(installed.env.python), "/opt/miles/train.py", *miles_args(run)]
    assert eval_splits(run.rows) == ["happy"]
    assert stop == ["stop", "--force"]
