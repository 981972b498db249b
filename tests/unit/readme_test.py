"""README's commands as a user copies them: every Bazel target it or the docs name exists, every command of ours its
shell blocks run answers ``--help`` (so its name and module are right), and every package it installs from a
checkout is a project of that name. The expensive commands themselves run elsewhere: the demo and the benchmarks'
smoke runs through Bazel, the wheels in the trainer tiers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[2]
DOCUMENTS = [CHECKOUT / "README.md", *sorted((CHECKOUT / "docs").glob("*.md"))]
LABEL = re.compile(r"(?<![\w:@])//([a-z_][\w/]*)?:([\w.-]+)")
SHELL_BLOCK = re.compile(r"```sh\n(.*?)```", re.S)
MACRO_TARGETS = {
    r"trainer_tier\(\s*env = \"(\w+)\"": lambda env: [f"{env}_test", "gpu_launch_test", "wheels_test"],
    r"trainer_helper\(": lambda: ["prepare", "wheel"],
}


def labels() -> list[tuple[str, str]]:
    found = {(package or "", name) for doc in DOCUMENTS for package, name in LABEL.findall(doc.read_text())}
    return sorted(found)


def shell_lines() -> list[str]:
    text = (CHECKOUT / "README.md").read_text()
    return [line.strip() for block in SHELL_BLOCK.findall(text) for line in block.replace("\\\n", " ").splitlines()]


def targets_of(package: str) -> set[str]:
    """The targets the BUILD file of ``package`` declares, the ones its macros and list comprehensions make
    included."""
    build = (CHECKOUT / package / "BUILD.bazel").read_text()
    names = set(re.findall(r'\bname = "([\w.-]+)"', build))
    for call, made in MACRO_TARGETS.items():
        for match in re.finditer(call, build):
            names.update(made(*match.groups()))
    for pattern, items in re.findall(r'name = "%s([\w.-]*)" % \w+,.*?for \w+ in \(([^)]*)\)', build, re.S):
        names.update(item + pattern for item in re.findall(r'"([\w.-]+)"', items))
    return names


@pytest.mark.parametrize(("package", "name"), labels(), ids=lambda each: each)
def test_every_target_the_docs_name_exists(package: str, name: str) -> None:
    assert (CHECKOUT / package / "BUILD.bazel").is_file(), f"//{package} has no BUILD.bazel"
    assert name in targets_of(package), f"//{package}:{name} isn't declared in {package or '.'}/BUILD.bazel"


def test_the_docs_name_the_targets_users_run() -> None:
    named = {f"//{package}:{name}" for package, name in labels()}
    assert {"//:demo", "//packages:wheels", "//packages/chat_core:evaluate", "//tests/slime/bench:rollout"} <= named


def our_commands() -> list[list[str]]:
    """The commands of ours README's shell blocks run, each as its ``--help``."""
    commands = []
    for line in shell_lines():
        if match := re.match(r"python3? -m ((?:chat_core)\.\w+)\b", line):
            commands.append(["-m", match.group(1), "--help"])
        elif match := re.match(r"python3? ((?:third_party|tests/gpu)/[\w/]+\.py)\b", line):
            commands.append([match.group(1), "--help"])
    return commands


@pytest.mark.parametrize("command", our_commands(), ids=" ".join)
def test_every_command_of_ours_in_readme_runs(command: list[str]) -> None:
    path = os.pathsep.join(str(CHECKOUT / folder) for folder in ("packages/chat_core", "third_party", "tests/gpu"))
    done = subprocess.run(
        [sys.executable, *command],
        cwd=CHECKOUT,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_readme_runs_prepare_and_evaluate() -> None:
    assert {"chat_core.prepare", "chat_core.evaluate"} <= {command[1] for command in our_commands()}


def test_every_package_readme_installs_from_a_checkout_is_a_project_of_that_name() -> None:
    installed = [
        path for line in shell_lines() if line.startswith("pip install ./") for path in re.findall(r"\./(\S+)", line)
    ]

    assert installed, "README installs nothing from a checkout"
    for path in installed:
        project = tomllib.loads((CHECKOUT / path / "pyproject.toml").read_text())["project"]
        assert project["name"] == Path(path).name.replace("_", "-"), path
