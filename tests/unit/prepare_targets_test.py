"""The trainer-named ``prepare`` commands, ``bazel run //packages/slime_helper:prepare`` and
``//packages/miles_helper:prepare``, run as Bazel builds them against agent-env's real server of the sample bundle:
both write the same rows, since both name chat_core's one implementation, and both refuse an OUT that exists; and no
module beside their script shadows a module of the standard library."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_support import ServedBundle

pytest_plugins = ["test_support.pytest_plugin"]

TRAINERS = ("slime", "miles")


def _command(trainer: str) -> Path:
    """The ``prepare`` binary of ``//packages/<trainer>_helper`` in this test's runfiles."""
    return Path(os.environ["TEST_SRCDIR"]) / "trainer_helpers" / "packages" / f"{trainer}_helper" / "prepare"


def _prepare(trainer: str, url: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(_command(trainer)), url, str(out)], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def written(sample_env_server: ServedBundle, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each trainer's rows folder, written by its own ``prepare`` command."""
    folders = {}
    for trainer in TRAINERS:
        out = tmp_path_factory.mktemp(trainer) / "rows"
        done = _prepare(trainer, sample_env_server.url, out)
        assert done.returncode == 0, done.stderr
        assert f"prepare: split 'all': 6 rows in {out / 'all.jsonl'}" in done.stderr
        folders[trainer] = out
    return folders


def test_both_trainers_prepare_commands_write_the_same_rows(written, sample_env):
    slime, miles = (written[trainer] for trainer in TRAINERS)
    assert sorted(path.name for path in slime.iterdir()) == ["all.jsonl", "happy.jsonl"]
    for name in ("all.jsonl", "happy.jsonl"):
        assert (slime / name).read_bytes() == (miles / name).read_bytes()


@pytest.mark.parametrize("trainer", TRAINERS)
def test_each_prepare_command_refuses_an_out_that_exists(trainer, written, sample_env):
    before = (written[trainer] / "all.jsonl").read_bytes()
    done = _prepare(trainer, sample_env.url, written[trainer])

    assert done.returncode == 1
    assert "already exists" in done.stderr
    assert (written[trainer] / "all.jsonl").read_bytes() == before


def test_no_module_beside_a_commands_script_shadows_the_standard_library():
    # A script runs with its own folder first on sys.path, so a module there named like one of the standard library's
    # is what every import of that name gets: chat_core's ``_json`` once stood in for the json parser's C half. Every
    # folder of the packages is checked, not only the commands' own, so a command that moves keeps its check.
    packages = Path(os.environ["TEST_SRCDIR"]) / "trainer_helpers" / "packages"
    modules = [
        path
        for name in ("chat_core", *(f"{trainer}_helper" for trainer in TRAINERS))
        for path in (packages / name / name).rglob("*.py")
    ]
    assert len(modules) > 10
    assert [path.name for path in modules if path.stem in sys.stdlib_module_names] == []
