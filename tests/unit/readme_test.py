"""README and the reference pages in docs/ as a user reads and copies them: every Bazel target they name exists,
every command of ours their shell blocks run answers ``--help`` (so its name and module are right), every package
README installs from a checkout is a project of that name, every link between them leads to a page and a heading
that exist, and README stays a ten-minute read. The expensive commands themselves run elsewhere: the demo and the
benchmarks' smoke runs through Bazel, the wheels in the trainer tiers."""

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
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
ITALIC_REFERENCE = re.compile(r"\bsee \*[^*\n]+\*")
README_LIMIT_BYTES = 20 * 1024
MACRO_TARGETS = {
    r"trainer_tier\(\s*env = \"(\w+)\"": lambda env: [f"{env}_test", "gpu_launch_test", "wheels_test"],
    r"trainer_helper\(": lambda: ["prepare", "wheel"],
}


def labels() -> list[tuple[str, str]]:
    found = {(package or "", name) for doc in DOCUMENTS for package, name in LABEL.findall(doc.read_text())}
    return sorted(found)


def shell_lines(documents: list[Path] = DOCUMENTS) -> list[str]:
    text = "".join(doc.read_text() for doc in documents)
    return [line.strip() for block in SHELL_BLOCK.findall(text) for line in block.replace("\\\n", " ").splitlines()]


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but hyphens and underscores dropped, spaces as
    hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    return {anchor(heading) for heading in re.findall(r"^#+ (.+)$", text, re.M)}


def links() -> list[tuple[str, str]]:
    """Every relative link of README and docs/, as (the page it is in, its target)."""
    found = []
    for doc in DOCUMENTS:
        prose = CODE.sub("", doc.read_text())
        found += [(doc.relative_to(CHECKOUT).as_posix(), target) for target in LINK.findall(prose)]
    return [(page, target) for page, target in found if "://" not in target]


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
    """The commands of ours the shell blocks of README and docs/ run, each as its ``--help``."""
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
        path
        for line in shell_lines([CHECKOUT / "README.md"])
        if line.startswith("pip install ./")
        for path in re.findall(r"\./(\S+)", line)
    ]

    assert installed, "README installs nothing from a checkout"
    for path in installed:
        project = tomllib.loads((CHECKOUT / path / "pyproject.toml").read_text())["project"]
        assert project["name"] == Path(path).name.replace("_", "-"), path


@pytest.mark.parametrize(("page", "target"), links(), ids=lambda each: each)
def test_every_link_leads_to_a_page_and_heading_that_exist(page: str, target: str) -> None:
    path, _, heading = target.partition("#")
    linked = (CHECKOUT / page).parent / path if path else CHECKOUT / page
    assert linked.exists(), f"{page} links to {target}, and there is no {path}"
    if heading:
        assert heading in anchors(linked), f"{page} links to {target}, and {path or page} has no heading {heading!r}"


def test_cross_references_are_links() -> None:
    named = {
        doc.relative_to(CHECKOUT).as_posix(): ITALIC_REFERENCE.findall(CODE.sub("", doc.read_text()))
        for doc in DOCUMENTS
    }
    assert not {page: found for page, found in named.items() if found}, "write a cross-reference as a link"


def test_readme_reads_in_ten_minutes() -> None:
    assert (CHECKOUT / "README.md").stat().st_size <= README_LIMIT_BYTES
