"""Build a trainer's Python environment, or the env server's, outside the repository:
``PYTHONPATH=third_party python3.11 tools/envs/build_env.py slime``, as ``./bazelw`` does for both trainers and for
``env-server``.

An environment is a virtualenv in the pins' cache, ``<cache>/envs/<name>-<hash>``, where the hash covers its spec
(every file in ``tools/envs/<name>/``) and the pins it puts on the path, so a changed spec or pin builds a new one
and an unchanged one is reused at once. ``.venvs/<name>`` in the repository points at the one in use.

A build: ``torch.txt`` → ``no-deps.txt`` (``--no-deps``) → ``requirements.txt``, each step after the first
constrained by ``torch.txt`` so nothing resolves another torch (a spec without ``torch.txt`` or ``no-deps.txt``
skips that step) → the recipe's pinned code copied into the environment's ``upstream/`` folder, which one ``.pth``
puts on the path → an import check → ``freeze.txt`` and ``build.json`` (build time, size, pins) → the completion
marker. The pins' cache is only read.

slime's recipe copies slime's ``slime`` and ``slime_plugins`` packages, and Megatron-LM's ``megatron`` package with
slime's ``docker/patch/latest/megatron*.patch`` applied as slime's image applies them. Only the ``megatron`` package
goes on the path: Megatron-LM's top-level ``tests`` package would shadow others.

Miles' recipe copies Miles' ``miles`` and ``miles_plugins`` packages. Its ``fsdp`` backend, the one whose arguments
the Miles tier parses, needs no Megatron-LM.

The env server's environment (``env-server``) is what ``env_replicas`` runs each replica on through Ray's
``py_executable``: agentenv-framework[openenv], uvicorn and the trainers' Ray, from a lock (``requirements.txt``,
compiled from ``requirements.in``), with no pins and nothing upstream. agentenv-framework can't go into a trainer's
environment (their openai pins clash), and a replica's worker needs the cluster's exact Ray to start.

Standard library only, so any python3.11 runs it; the virtualenv gets the interpreter that runs it. It reads the pins
with ``pins`` from ``third_party``, which whoever runs it puts on ``PYTHONPATH``: ``./bazelw`` here, and Bazel's
runfiles for the tiers, which check their environment with this module.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pins

REPO = Path(__file__).resolve().parents[2]
SPECS = Path(__file__).resolve().parent

DONE_MARKER = ".env-complete"


class BuildError(Exception):
    """The environment can't be built; the message says what to do."""


@dataclass(frozen=True)
class Recipe:
    """What an environment takes beyond its spec's packages: the pins it needs, how their code goes into the
    environment's ``upstream/`` folder (given each pin's work tree; None when nothing does), and the imports that
    prove it works."""

    pins: tuple[str, ...]
    upstream: Callable[[dict[str, Path], Path], None] | None
    import_check: str


def _slime_upstream(trees: dict[str, Path], upstream: Path) -> None:
    for package in ("slime", "slime_plugins"):
        _copy_package(trees["slime"] / package, upstream / package)
    _copy_package(trees["megatron-lm"] / "megatron", upstream / "megatron")
    for patch in ("megatron.patch", "megatron-sglang-aligned.patch"):
        _apply(trees["slime"] / "docker" / "patch" / "latest" / patch, upstream)


def _miles_upstream(trees: dict[str, Path], upstream: Path) -> None:
    for package in ("miles", "miles_plugins"):
        _copy_package(trees["miles"] / package, upstream / package)


RECIPES = {
    "slime": Recipe(
        pins=("slime", "megatron-lm"),
        upstream=_slime_upstream,
        import_check=(
            "import megatron.training, slime.agent.adapters, slime.rollout.sglang_rollout, slime.utils.arguments, "
            "sglang.srt.function_call.function_call_parser, torchvision.io"
        ),
    ),
    "miles": Recipe(
        pins=("miles",),
        upstream=_miles_upstream,
        import_check=(
            "import miles.rollout.generate_hub.agentic_tool_call, miles.ray.rollout.router_manager, "
            "miles.rollout.inference_rollout.inference_rollout_train, miles.rollout.session.server, "
            "miles.utils.arguments, websockets.asyncio.client"
        ),
    ),
    "env-server": Recipe(pins=(), upstream=None, import_check="import agent_env.openenv, ray, uvicorn"),
}


def env_dir(name: str) -> Path:
    """Where environment ``name`` of the current spec and pins lives. Raises BuildError when it has no recipe or
    no spec."""
    return pins.cache_root() / "envs" / f"{name}-{_spec_hash(name)}"


def build(name: str) -> Path:
    """Environment ``name``, built unless it already is, with ``.venvs/<name>`` pointing at it. Raises BuildError
    with pins.py's instructions when a pin is missing, and saying what failed when a step fails."""
    trees = _pin_trees(name)
    target = env_dir(name)
    if (target / DONE_MARKER).is_file():
        print(f"build_env: the {name} environment is up to date: {target}")
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / f".{target.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (target / DONE_MARKER).is_file():
                _build(name, trees, target)
    _link(REPO / ".venvs" / name, target)
    return target


def _build(name: str, trees: dict[str, Path], target: Path) -> None:
    began = time.monotonic()
    spec = SPECS / name
    shutil.rmtree(target, ignore_errors=True)
    print(f"build_env: building the {name} environment in {target}", flush=True)
    _run([sys.executable, "-m", "venv", str(target)])
    python = str(target / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"]
    constraint = []
    if (spec / "torch.txt").is_file():
        _run([*pip, "-r", str(spec / "torch.txt")])
        constraint = ["-c", str(spec / "torch.txt")]
    if (spec / "no-deps.txt").is_file():
        _run([*pip, "--no-deps", *constraint, "-r", str(spec / "no-deps.txt")])
    _run([*pip, *constraint, "-r", str(spec / "requirements.txt")])

    if (upstream_of := RECIPES[name].upstream) is not None:
        upstream = target / "upstream"
        upstream_of(trees, upstream)
        site = Path(_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]))
        (site / "trainer_helpers_upstream.pth").write_text(f"{upstream}\n")
        print(f"build_env: on the path from {upstream}: " + ", ".join(sorted(p.name for p in upstream.iterdir())))
    _run([python, "-c", RECIPES[name].import_check])

    frozen = _output([python, "-m", "pip", "freeze", "--disable-pip-version-check"])
    (target / "freeze.txt").write_text(frozen + "\n")
    seconds = round(time.monotonic() - began, 1)
    size = _size(target)
    record = {
        "built_s": seconds,
        "size_bytes": size,
        "python": sys.version.split()[0],
        "pins": {pin: pins.PINS[pin]["commit"] for pin in trees},
        "spec_hash": _spec_hash(name),
    }
    (target / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    (target / DONE_MARKER).write_text("")
    print(f"build_env: built the {name} environment in {seconds:.0f} s, {size / 2**30:.1f} GiB: {target}")


def _recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise BuildError(f"there is no recipe for an environment named {name!r}; there are {', '.join(RECIPES)}")
    return RECIPES[name]


def _spec_hash(name: str) -> str:
    recipe = _recipe(name)
    spec = SPECS / name
    files = sorted(path for path in spec.rglob("*") if path.is_file()) if spec.is_dir() else []
    if not files:
        raise BuildError(f"there is no spec for the {name} environment in {spec}")
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.relative_to(spec)}\0".encode())
        digest.update(path.read_bytes())
        digest.update(b"\0")
    for pin in recipe.pins:
        digest.update(f"{pin}={pins.PINS[pin]['commit']}\0".encode())
    return digest.hexdigest()[:12]


def _pin_trees(name: str) -> dict[str, Path]:
    try:
        return {pin: pins.path_of(pin) for pin in _recipe(name).pins}
    except pins.PinUnavailable as missing:
        raise BuildError(str(missing)) from None


def _pinned(name: str) -> bool:
    try:
        _pin_trees(name)
    except BuildError:
        _recipe(name)
        return False
    return True


def _copy_package(source: Path, destination: Path) -> None:
    if not source.is_dir():
        raise BuildError(f"{source} is missing; is the pin at {source.parent} whole?")
    shutil.copytree(source, destination, ignore=shutil.ignore_patterns("__pycache__"))


def _apply(patch: Path, tree: Path) -> None:
    """Apply ``patch`` to the files under ``tree``, which is no git work tree: git must not look above it."""
    if not patch.is_file():
        raise BuildError(f"the pin has no {patch}; the pinned commit no longer matches this recipe")
    git = ["git", "apply", "--whitespace=nowarn", str(patch)]
    environment = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent)}
    check = subprocess.run([*git[:2], "--check", *git[2:]], cwd=tree, env=environment, capture_output=True, text=True)
    if check.returncode != 0:
        raise BuildError(f"{patch.name} does not apply to the pinned code:\n{check.stderr.strip()}")
    _run(git, cwd=tree, env=environment)


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(exist_ok=True)
    staged = link.with_name(f".{link.name}.new")
    staged.unlink(missing_ok=True)
    staged.symlink_to(target, target_is_directory=True)
    os.replace(staged, link)
    print(f"build_env: {link} -> {target}")


def _size(root: Path) -> int:
    return sum((Path(folder) / name).lstat().st_size for folder, _, names in os.walk(root) for name in names)


def _run(command: list[str], **kwargs) -> None:
    print("build_env: $ " + " ".join(command), flush=True)
    if subprocess.run(command, **kwargs).returncode != 0:
        raise BuildError(f"this step failed (its output is above): {' '.join(command)}")


def _output(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise BuildError(f"{' '.join(command)} failed:\n{done.stderr.strip()}")
    return done.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", metavar="NAME", help=f"the environments to build ({', '.join(RECIPES)})")
    parser.add_argument(
        "--if-pinned",
        action="store_true",
        help="skip, with a note, an environment whose pins are not in the cache, instead of failing",
    )
    args = parser.parse_args(argv)
    if sys.version_info[:2] != (3, 11):
        print(
            f"build_env: run this with python3.11, not {sys.version.split()[0]}: the environment gets the "
            "interpreter that runs it",
            file=sys.stderr,
        )
        return 1
    for name in args.names:
        try:
            if args.if_pinned and not _pinned(name):
                print(f"build_env: skipping the {name} environment: its pins are not in the cache", file=sys.stderr)
                continue
            build(name)
        except BuildError as failed:
            print(f"build_env: {failed}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
