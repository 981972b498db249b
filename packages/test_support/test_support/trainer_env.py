"""What the slime and Miles tiers share about the trainer environment they run in: the checks that it is the right
one, and the shipped wheels installed into a throwaway copy of it, as a user installs them into the trainer's image,
while the environment itself stays as it was; and what a test asks of the copy afterwards.

A tier runs only in its trainer's environment of the current spec, with the trainer's pins in the cache and a Python
with agent-env for the env server; ``require_tier`` says which is missing and how to provide it, in an exception of
its own that a ``conftest.py`` turns into pytest's usage error, so this module never imports pytest. It checks with
the checkout's ``pins`` and ``build_env`` modules, which the tier's runner puts on the path (``third_party`` and
``tools/envs``, from Bazel's runfiles).

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

import build_env
import pins

from .env_server import serve_bundle

REPO = Path(__file__).resolve().parents[3]
"""The checkout this package lies in."""
PINNED = ("torch", "transformers", "sglang", "openai")
"""Distributions both trainers' images pin: installing the wheels must find each there and leave it as it is."""
NOT_SHIPPED = frozenset({"test_support", "agent_env", "openenv", "pytest"})
"""Top-level modules of the env server and of the tests, none of which the shipped functions may import."""
_WHEELS = ("chat_core", "env_replicas", "miles_helper", "slime_helper")
_CHAT_CORE_REQUIREMENTS = [
    "aiohttp>=3.13.4",
    'miles-helper==0.1.0; extra == "miles"',
    "orjson>=3.9",
    'slime-helper==0.1.0; extra == "slime"',
    "tqdm>=4.66",
    "websockets<17.5,>=17.4",
]
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

    def check_adds_only(self, ours: Iterable[str]) -> None:
        """Raises AssertionError unless installing added exactly the distributions ``ours``, moved the version of
        none that was there, and found every one of ``PINNED`` there."""
        added, ours = set(self.after) - set(self.before), set(ours)
        assert added == ours, f"installing added {sorted(added)}, not {sorted(ours)}"
        moved = {name: (was, self.after.get(name)) for name, was in self.before.items() if self.after.get(name) != was}
        assert not moved, f"installing moved (before, after) {moved}"
        missing = [name for name in PINNED if name not in self.before]
        assert not missing, f"{self.env.root} lacks the pinned {missing}"

    def check_requirements(self, helper: str) -> None:
        """Raises AssertionError unless chat-core requires only what it talks to the env server with and, by extra,
        each trainer's helper, and ``helper`` (e.g. ``slime-helper``, ``env-replicas``) only chat-core."""
        declared = self.env.requirements(["chat-core", helper])
        expected = {"chat-core": _CHAT_CORE_REQUIREMENTS, helper: ["chat-core==0.1.0"]}
        assert declared == expected, f"declared {declared}, not {expected}"

    def load_from_wheels(self, loader: str, paths: Iterable[str], modules: Iterable[str]) -> dict[str, str]:
        """Each of ``paths`` as ``module.qualname`` once ``loader.load_function`` (the trainer's loader) loaded it in
        a fresh process of the copy. Raises AssertionError unless each of ``modules`` came from the copy's
        site-packages and nothing of ``NOT_SHIPPED`` was imported."""
        loaded = self.env.load(loader, paths, modules)
        site = self.env.site_packages()
        elsewhere = {name: file for name, file in loaded["files"].items() if not Path(file).is_relative_to(site)}
        assert not elsewhere, f"loaded from outside {site}: {elsewhere}"
        imported = NOT_SHIPPED.intersection(loaded["modules"])
        assert not imported, f"loading the functions imported {sorted(imported)}"
        return loaded["functions"]

    def gpu_job(self, trainer: str, folder: Path, gpus: int, *args: str) -> tuple[dict[str, Any], list[str]]:
        """The runtime environment and the command of the Ray job that the GPU command (``tests/gpu/run.py
        trainer``) submits, run in the copy with ``--gpus gpus`` and ``args`` on the sample bundle, served for it,
        while a stand-in ``ray`` in ``folder`` records its calls. Raises AssertionError unless it started a Ray head
        with ``gpus`` GPUs, submitted the one job and stopped Ray."""
        ray = recording_command(folder, "ray")
        with serve_bundle(python=server_python()) as served:
            launch = [str(REPO / "tests" / "gpu" / "run.py"), trainer, "--bundle-url", served.url, "--gpus", str(gpus)]
            self.env.run(*launch, *args, env={"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"})
        start, submit, stop = ray()
        assert start[:2] == ["start", "--head"] and start[start.index("--num-gpus") + 1] == str(gpus), start
        assert stop == ["stop", "--force"], stop
        job, command = submit[: submit.index("--")], submit[submit.index("--") + 1 :]
        return json.loads(job[job.index("--runtime-env-json") + 1]), command


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


@contextmanager
def installed_wheels(requirement: str, folder: Path) -> Iterator[Installed]:
    """``installed_copy`` of ``requirement`` (``chat-core[slime]``, ``env-replicas``) into a copy, at ``folder``, of
    the environment this process runs in, from the wheels Bazel names in ``WHEELS`` (by hand, build them with
    ``bazel build //packages:wheels`` and name them there)."""
    wheels = wheels_from(os.environ.get("WHEELS", ""), _WHEELS)
    with installed_copy(Path(sys.prefix), folder, wheels, requirement) as installed:
        yield installed


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


def server_python() -> Path:
    """The Python the tiers run the env server on, which has agent-env: the one ``ENV_SERVER_PYTHON`` names, by
    default the development virtualenv's."""
    return Path(os.environ.get("ENV_SERVER_PYTHON") or REPO / ".venv" / "bin" / "python")


class TierUnready(Exception):
    """A trainer tier can't run here; the message says what is missing and how to provide it."""


def env_server_environment() -> Path:
    """The Python of the env server's environment of the current spec (``build_env``'s ``env-server``: agent-env,
    uvicorn and the trainers' Ray), on which ``env_replicas`` runs its replicas. Raises TierUnready, saying how to
    build it, when it isn't built."""
    root = build_env.env_dir("env-server")
    if not (root / build_env.DONE_MARKER).is_file():
        raise TierUnready(
            f"the env server's environment of the current spec ({root}) isn't built: run ./bazelw version to build "
            "it (or PYTHONPATH=third_party python3.11 tools/envs/build_env.py env-server)"
        )
    return root / "bin" / "python"


def require_tier(tier: str, pinned: Sequence[str]) -> Path:
    """``server_python()``, once the pins ``pinned`` are in the cache, this process runs in the trainer environment
    ``tier.lower()`` of the current spec, and that Python exists; ``tier`` is the trainer as the messages name it
    ("slime", "Miles"). Raises TierUnready, saying how to fix it, at the first of these that fails."""
    try:
        for name in pinned:
            pins.path_of(name)
    except pins.PinUnavailable as missing:
        raise TierUnready(f"the {tier} tier needs the pinned {' and '.join(pinned)}. {missing}") from None
    env_name = tier.lower()
    if Path(sys.prefix).resolve() != build_env.env_dir(env_name).resolve():
        raise TierUnready(
            f"the {tier} tier runs in the {tier} environment of the current spec ({build_env.env_dir(env_name)}), not "
            f"in {sys.prefix}: run ./bazelw version to build it, then ./bazelw test //tests/{env_name}/..."
        )
    python = server_python()
    if not python.is_file():
        raise TierUnready(
            f"the env server runs on {python}, which is missing: create the development virtualenv (.venv) or name a "
            "Python with agentenv-framework[openenv] in ENV_SERVER_PYTHON"
        )
    return python
