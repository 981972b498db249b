"""The shipped wheels in slime's environment, installed as a user installs them into slime's image: ``pip install
chat-core[slime]`` adds ``chat_core`` and ``slime_helper`` to a copy of the slime environment and moves none of its
packages, slime's own loader finds the generate function and filter in the installed wheels without pulling in
anything of the env server or of the tests, and the GPU command (``tests/gpu/run.py slime``) runs from them up to the
Ray job it submits.

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

from launches import QWEN3_4B_CONFIG, Run, eval_splits, slime_args  # noqa: E402

PINNED = ("torch", "transformers", "sglang", "openai")
FUNCTIONS = ("slime_helper.generate.generate", "slime_helper.generate.keep_scored_groups")
NOT_SHIPPED = {"test_support", "agent_env", "openenv", "pytest"}
GPUS = 4


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    wheels = wheels_from(os.environ.get("WHEELS", ""), ["chat_core", "miles_helper", "slime_helper"])
    folder = tmp_path_factory.mktemp("slime") / "env"
    with installed_copy(Path(sys.prefix), folder, wheels, "chat-core[slime]") as installed:
        yield installed


def test_the_slime_extra_adds_chat_core_and_slime_helper_only_and_moves_none_of_slimes_packages(installed):
    assert set(installed.after) - set(installed.before) == {"chat-core", "slime-helper"}
    assert {name: installed.after[name] for name in installed.before} == installed.before
    assert all(name in installed.before for name in PINNED)


def test_the_wheels_need_only_chat_core_and_what_it_talks_to_the_env_server_with(installed):
    assert installed.env.requirements(["chat-core", "slime-helper"]) == {
        "chat-core": [
            "httpx>=0.27",
            'miles-helper==0.1.0; extra == "miles"',
            'slime-helper==0.1.0; extra == "slime"',
            "tqdm>=4.66",
            "websockets>=13",
        ],
        "slime-helper": ["chat-core==0.1.0"],
    }


def test_slimes_loader_finds_the_generate_function_and_filter_in_the_installed_wheels(installed):
    loaded = installed.env.load("slime.utils.misc", FUNCTIONS, ["chat_core", "slime_helper"])

    assert loaded["functions"] == {path: path for path in FUNCTIONS}
    site_packages = installed.env.site_packages()
    assert all(Path(file).is_relative_to(site_packages) for file in loaded["files"].values()), loaded["files"]
    assert NOT_SHIPPED.isdisjoint(loaded["modules"])


def test_the_gpu_command_writes_the_rows_and_submits_slimes_train_py_with_the_launch_arguments(
    installed, tmp_path: Path
):
    model = weightless_checkpoint(tmp_path / "Qwen3-4B", QWEN3_4B_CONFIG).resolve()
    ray = recording_command(tmp_path, "ray")
    out = tmp_path / "run"
    ours = ["--model", str(model), "--gpus", str(GPUS), "--out", str(out)]
    checkouts = ["--trainer-dir", "/opt/slime", "--megatron-dir", "/opt/Megatron-LM"]
    with serve_bundle(python=os.environ.get("ENV_SERVER_PYTHON") or REPO / ".venv" / "bin" / "python") as served:
        installed.env.run(
            str(GPU / "run.py"), "slime", *ours, "--bundle-url", served.url, *checkouts,
            "--", "--attention-backend", "unfused",
            env={"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"},
        )  # fmt: skip

    start, submit, stop = ray()
    assert start[:2] == ["start", "--head"] and start[start.index("--num-gpus") + 1] == str(GPUS)
    job, train = submit[: submit.index("--")], submit[submit.index("--") + 1 :]
    assert json.loads(job[job.index("--runtime-env-json") + 1])["env_vars"]["PYTHONPATH"] == "/opt/Megatron-LM"
    run = Run(model=model, folder=out, gpus=GPUS)
    assert train == [
        str(installed.env.python),
        "/opt/slime/train.py",
        *slime_args(run),
        "--attention-backend",
        "unfused",
    ]
    assert eval_splits(run.rows) == ["happy"]
    assert (out / "slime-episodes.yaml").read_text() == "episode_max_turns: 4\n"
    assert stop == ["stop", "--force"]
