"""The shipped wheels installed into a throwaway copy of a trainer's environment, as a user installs them into the
trainer's image, while the environment itself stays as it was; and what a test asks of the copy afterwards.

The copy is made with hard links (``cp -al``), which takes seconds and no disk for a 6 GB virtualenv. That is safe
because nothing run in it rewrites a file in place: pip and Python only add files or replace them by unlinking
first, which leaves the original's links alone (``installed_copy`` checks the original unchanged at the end). A
``.pth`` file naming a folder inside the original is rewritten, as a new file, to name the copy's, so the copy
imports only from itself. Every command runs with no ``PYTHONPATH`` and from the copy's own folder, so nothing comes
from this repository's source tree.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_DROPPED_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")
_REQUIREMENTS = """
import json, sys
from importlib.metadata import requires
print(json.dumps({name: sorted(requires(name) or []) for name in sys.argv[1:]}))
"""
_LOAD = """
import json, sys
from {loader} import load_function
loaded = {{path: load_function(path) for path in sys.argv[2:]}}
print(json.dumps({{
    "functions": {{path: f"{{function.__module__}}.{{function.__qualname__}}" for path, function in loaded.items()}},
    "files": {{name: sys.modules[name].__file__ for name in sys.argv[1].split(",")}},
    "modules": sorted({{name.partition(".")[0] for name in sys.modules}}),
}}))
"""


@dataclass(frozen=True)
class TrainerEnv:
    """A virtualenv at ``root`` whose Python runs with no ``PYTHONPATH``, from ``root``."""

    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def run(
        self, *args: str, env: Mapping[str, str] | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """The environment's Python run with ``args``, with ``env`` added to its environment. Raises AssertionError
        with its output when ``check`` is set and it fails."""
        env = {
            **{name: value for name, value in os.environ.items() if name not in _DROPPED_VARIABLES},
            "PYTHONNOUSERSITE": "1",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_CACHE_DIR": "1",
            **(env or {}),
        }
        done = subprocess.run(
            [str(self.python), *args], cwd=self.root, env=env, capture_output=True, text=True, check=False
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"{self.python} {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
            )
        return done

    def distributions(self) -> dict[str, str]:
        """Every installed distribution's version by its name, as ``pip list`` reports them."""
        listed = json.loads(self.run("-m", "pip", "list", "--format=json").stdout)
        return {entry["name"].lower().replace("_", "-"): entry["version"] for entry in listed}

    def site_packages(self) -> Path:
        return Path(self.run("-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip())

    def requirements(self, distributions: Iterable[str]) -> dict[str, list[str]]:
        """The requirements (with versions, markers and extras) each of ``distributions`` declares in its installed
        metadata, sorted."""
        return json.loads(self.run("-c", _REQUIREMENTS, *distributions).stdout)

    def load(self, loader: str, paths: Iterable[str], modules: Iterable[str]) -> dict[str, Any]:
        """What a fresh process of this environment sees after ``loader.load_function`` (the trainer's loader, e.g.
        ``slime.utils.misc``) loads each of ``paths``: ``functions``, each path's function as
        ``module.qualname``; ``files``, the file each of ``modules`` came from; and ``modules``, the top-level
        names of every module then imported."""
        return json.loads(self.run("-c", _LOAD.format(loader=loader), ",".join(modules), *paths).stdout)


@dataclass(frozen=True)
class Installed:
    """The copy ``env`` with the wheels installed, and its distributions ``before`` and ``after`` (name → version)."""

    env: TrainerEnv
    before: dict[str, str]
    after: dict[str, str]


@contextmanager
def installed_copy(env: Path, folder: Path, wheels: Sequence[Path], requirement: str) -> Iterator[Installed]:
    """``requirement`` (e.g. ``chat-core[slime]``) installed from ``wheels`` with ``pip install --no-index
    --find-links`` into a hard-link copy of the virtualenv ``env`` at ``folder`` (which must not exist, on the same
    filesystem). ``--no-index`` succeeds only when ``env`` already holds every other dependency, and then adds only
    our distributions, as pip upgrades nothing that is satisfied.

    On exit the copy is removed, and AssertionError is raised if ``env`` itself changed."""
    original = TrainerEnv(env.resolve())
    untouched = original.distributions()
    subprocess.run(["cp", "-al", str(original.root), str(folder)], check=True)
    try:
        copy = TrainerEnv(folder)
        for pth in copy.site_packages().glob("*.pth"):
            text = pth.read_text()
            if str(original.root) in text:
                pth.unlink()
                pth.write_text(text.replace(str(original.root), str(folder)))
        before = copy.distributions()
        links = [option for wheel in wheels for option in ("--find-links", str(wheel.parent))]
        copy.run("-m", "pip", "install", "--no-index", *links, requirement)
        yield Installed(copy, before, copy.distributions())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert original.distributions() == untouched, f"installing into its copy changed {original.root} itself"


def wheels_from(listed: str, distributions: Sequence[str]) -> list[Path]:
    """The wheel of each of ``distributions`` (e.g. ``chat_core``) among the space-separated paths ``listed``, as
    Bazel's ``$(rootpaths //packages:wheels)`` gives them. Raises LookupError naming any that is missing."""
    wheels = {Path(path).name.split("-")[0]: Path(path).resolve() for path in listed.split()}
    missing = [name for name in distributions if name not in wheels]
    if missing:
        raise LookupError(
            f"no wheel of {', '.join(missing)} in {listed!r}: build them with `bazel build //packages:wheels` and "
            "name them, space-separated, in WHEELS"
        )
    return [wheels[name] for name in distributions]


def recording_command(folder: Path, name: str) -> Callable[[], list[list[str]]]:
    """A stand-in for command ``name`` in ``folder`` (put it first on ``PATH``) that succeeds and records its
    arguments; the function returned gives the arguments of each call so far."""
    calls = folder / f"{name}.calls"
    command = folder / name
    command.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"with open({str(calls)!r}, 'a') as calls:\n    calls.write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    command.chmod(0o755)
    return lambda: [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
